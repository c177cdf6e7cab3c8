// The TSan annotations of tests/tsan/absl_mutex_tsan.cc, variant by variant:
// a value handed from one thread to another through each Abseil lock, wait and
// lock-when entry point. With an entry point unannotated, TSan reports the
// handover as a data race; annotated twice (Abseil's *WithTimeout calls its
// *WithDeadline through the PLT), as an unlock of an unlocked mutex. Either
// fails the test (tests/sanitize.sh runs TSan with halt_on_error=1). Built in
// the TSan configuration only.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace {

constexpr int kPayload = 42;
// Long enough never to expire here: a wait that times out fails the test.
constexpr absl::Duration kWaitTimeout = absl::Seconds(60);
// Lets the consumer reach its wait first, so that the waits really block.
constexpr absl::Duration kProducerDelay = absl::Milliseconds(20);

struct Box {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready ABSL_GUARDED_BY(mu) = false;
  // Not atomic: only the mutex orders the producer's write and the read.
  std::string payload ABSL_GUARDED_BY(mu);
};

// Runs `consume` on a second thread while this one publishes the payload under
// the mutex; returns what the consumer read.
std::string Handover(const std::function<std::string(Box&)>& consume) {
  Box box;
  std::string seen;
  std::thread consumer([&] { seen = consume(box); });
  absl::SleepFor(kProducerDelay);
  {
    absl::MutexLock lock(&box.mu);
    box.payload = std::to_string(kPayload);
    box.ready = true;
    box.cv.SignalAll();
  }
  consumer.join();
  return seen;
}

const std::string kExpected = std::to_string(kPayload);

TEST(AbslMutexTsanTest, CondVarWait) {
  EXPECT_EQ(Handover([](Box& b) {
              absl::MutexLock lock(&b.mu);
              while (!b.ready) b.cv.Wait(&b.mu);
              return b.payload;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, CondVarWaitWithTimeout) {
  EXPECT_EQ(Handover([](Box& b) {
              absl::MutexLock lock(&b.mu);
              while (!b.ready) {
                if (b.cv.WaitWithTimeout(&b.mu, kWaitTimeout))
                  return std::string();
              }
              return b.payload;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, CondVarWaitWithDeadline) {
  EXPECT_EQ(Handover([](Box& b) {
              const absl::Time deadline = absl::Now() + kWaitTimeout;
              absl::MutexLock lock(&b.mu);
              while (!b.ready) {
                if (b.cv.WaitWithDeadline(&b.mu, deadline))
                  return std::string();
              }
              return b.payload;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, Await) {
  EXPECT_EQ(Handover([](Box& b) {
              absl::MutexLock lock(&b.mu);
              b.mu.Await(absl::Condition(&b.ready));
              return b.payload;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, AwaitWithTimeoutAndDeadline) {
  EXPECT_EQ(
      Handover([](Box& b) {
        absl::MutexLock lock(&b.mu);
        if (!b.mu.AwaitWithTimeout(absl::Condition(&b.ready), kWaitTimeout)) {
          return std::string();
        }
        return b.payload;
      }),
      kExpected);
  EXPECT_EQ(Handover([](Box& b) {
              absl::MutexLock lock(&b.mu);
              if (!b.mu.AwaitWithDeadline(absl::Condition(&b.ready),
                                          absl::Now() + kWaitTimeout)) {
                return std::string();
              }
              return b.payload;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, LockWhenVariants) {
  EXPECT_EQ(Handover([](Box& b) {
              absl::MutexLock lock(&b.mu, absl::Condition(&b.ready));
              return b.payload;
            }),
            kExpected);
  EXPECT_EQ(
      Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        std::string seen;
        if (b.mu.LockWhenWithTimeout(absl::Condition(&b.ready), kWaitTimeout)) {
          seen = b.payload;
        }
        b.mu.Unlock();
        return seen;
      }),
      kExpected);
  EXPECT_EQ(Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              std::string seen;
              if (b.mu.LockWhenWithDeadline(absl::Condition(&b.ready),
                                            absl::Now() + kWaitTimeout)) {
                seen = b.payload;
              }
              b.mu.Unlock();
              return seen;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, ReaderLockVariants) {
  EXPECT_EQ(Handover([](Box& b) {
              absl::ReaderMutexLock lock(&b.mu, absl::Condition(&b.ready));
              return b.payload;
            }),
            kExpected);
  EXPECT_EQ(Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              std::string seen;
              if (b.mu.ReaderLockWhenWithTimeout(absl::Condition(&b.ready),
                                                 kWaitTimeout)) {
                seen = b.payload;
              }
              b.mu.ReaderUnlock();
              return seen;
            }),
            kExpected);
  EXPECT_EQ(Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              std::string seen;
              if (b.mu.ReaderLockWhenWithDeadline(absl::Condition(&b.ready),
                                                  absl::Now() + kWaitTimeout)) {
                seen = b.payload;
              }
              b.mu.ReaderUnlock();
              return seen;
            }),
            kExpected);
}

TEST(AbslMutexTsanTest, TryLockLoops) {
  EXPECT_EQ(Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              for (;;) {
                if (b.mu.TryLock()) {
                  if (b.ready) {
                    std::string seen = b.payload;
                    b.mu.Unlock();
                    return seen;
                  }
                  b.mu.Unlock();
                }
                absl::SleepFor(absl::Milliseconds(1));
              }
            }),
            kExpected);
  EXPECT_EQ(Handover([](Box& b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              for (;;) {
                if (b.mu.ReaderTryLock()) {
                  if (b.ready) {
                    std::string seen = b.payload;
                    b.mu.ReaderUnlock();
                    return seen;
                  }
                  b.mu.ReaderUnlock();
                }
                absl::SleepFor(absl::Milliseconds(1));
              }
            }),
            kExpected);
}

}  // namespace
