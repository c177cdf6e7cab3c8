// ThreadSanitizer annotations for Debian's Abseil Mutex and CondVar (TSan
// builds only: cmake/sanitizers.cmake links this object into every executable).
//
// Why: Debian's libabsl_synchronization is not built with TSan, so TSan never
// sees absl::Mutex take or release a lock (it is futexes and atomics inside an
// uninstrumented library). Every access to ABSL_GUARDED_BY state from two
// threads would then be reported as a race. Abseil's own TSan build annotates
// Mutex with __tsan_mutex_* calls; this file adds the same annotations from
// outside: it defines the exported Mutex/CondVar entry points (the executable's
// definitions take precedence over the shared library's, for our code and for
// calls from gRPC and Abseil itself), annotates, and forwards to the library's
// implementation found with dlsym(RTLD_NEXT).
//
// Semantics: pre_lock..post_lock and pre_unlock..post_unlock bracket the real
// call, so TSan ignores what happens inside (including Condition evaluations,
// which Abseil runs inside lock and unlock operations). A wait (Await,
// CondVar::Wait, the *When* variants after the first evaluation) is an unlock
// followed by a lock: whoever changed the state under the mutex meanwhile
// happens-before the waiter's return.
//
// The mangled names are those of Abseil 20220623 as Debian packages it (inline
// namespace absl::debian3); a missing one aborts at first use with its name.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

void* Real(const char* mangled) {
  void* fn = dlsym(RTLD_NEXT, mangled);
  if (fn == nullptr) {
    std::fprintf(stderr,
                 "absl_mutex_tsan: %s not found in the Abseil library "
                 "(not Debian's Abseil 20220623?)\n",
                 mangled);
    std::abort();
  }
  return fn;
}

template <typename Fn>
Fn RealFn(const char* mangled) {
  return reinterpret_cast<Fn>(Real(mangled));
}

constexpr unsigned kRead = __tsan_mutex_read_lock;

// Abseil's entry points call one another through the PLT, and so reach these
// wrappers again: CondVar::WaitWithTimeout calls CondVar::WaitWithDeadline,
// for one. Only a thread's outermost call is annotated; a nested one would
// annotate an unlock of a mutex the outer call has already marked released.
thread_local int t_depth = 0;

class Outermost {
 public:
  Outermost() : outermost_(t_depth++ == 0) {}
  ~Outermost() { --t_depth; }
  Outermost(const Outermost&) = delete;
  Outermost& operator=(const Outermost&) = delete;
  explicit operator bool() const { return outermost_; }

 private:
  const bool outermost_;
};

// The caller holds `mu` before and after; the real call releases and
// reacquires it while waiting.
template <typename Call>
auto Wait(absl::Mutex* mu, unsigned flags, Call call) {
  const Outermost outer;
  if (!outer) return call();
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  auto result = call();
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

// A lock that may block on a condition first: the mutex is held on return.
template <typename Call>
auto LockThen(absl::Mutex* mu, unsigned flags, Call call) {
  const Outermost outer;
  if (!outer) return call();
  __tsan_mutex_pre_lock(mu, flags);
  auto result = call();
  __tsan_mutex_post_lock(mu, flags, 0);
  return result;
}

template <typename Call>
void AnnotatedUnlock(absl::Mutex* mu, unsigned flags, Call call) {
  const Outermost outer;
  if (outer) __tsan_mutex_pre_unlock(mu, flags);
  call();
  if (outer) __tsan_mutex_post_unlock(mu, flags);
}

// A try-lock: `flags` includes __tsan_mutex_try_lock.
template <typename Call>
bool AnnotatedTryLock(absl::Mutex* mu, unsigned flags, Call call) {
  const Outermost outer;
  if (!outer) return call();
  __tsan_mutex_pre_lock(mu, flags);
  const bool locked = call();
  __tsan_mutex_post_lock(
      mu, flags | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  return locked;
}

struct Done {};

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = RealFn<void (*)(Mutex*)>("_ZN4absl7debian35Mutex4LockEv");
  LockThen(this, 0, [&] { return real(this), Done{}; });
}

void Mutex::ReaderLock() {
  static auto real =
      RealFn<void (*)(Mutex*)>("_ZN4absl7debian35Mutex10ReaderLockEv");
  LockThen(this, kRead, [&] { return real(this), Done{}; });
}

void Mutex::Unlock() {
  static auto real =
      RealFn<void (*)(Mutex*)>("_ZN4absl7debian35Mutex6UnlockEv");
  ::AnnotatedUnlock(this, 0, [&] { real(this); });
}

void Mutex::ReaderUnlock() {
  static auto real =
      RealFn<void (*)(Mutex*)>("_ZN4absl7debian35Mutex12ReaderUnlockEv");
  ::AnnotatedUnlock(this, kRead, [&] { real(this); });
}

bool Mutex::TryLock() {
  static auto real =
      RealFn<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex7TryLockEv");
  return ::AnnotatedTryLock(this, __tsan_mutex_try_lock,
                            [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static auto real =
      RealFn<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex13ReaderTryLockEv");
  return ::AnnotatedTryLock(this, kRead | __tsan_mutex_try_lock,
                            [&] { return real(this); });
}

void Mutex::LockWhen(const Condition& cond) {
  static auto real = RealFn<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  LockThen(this, 0, [&] { return real(this, cond), Done{}; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real = RealFn<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  LockThen(this, kRead, [&] { return real(this, cond), Done{}; });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_"
      "8DurationE");
  return LockThen(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_"
      "8DurationE");
  return LockThen(this, kRead, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_"
      "4TimeE");
  return LockThen(this, 0, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_"
      "4TimeE");
  return LockThen(this, kRead, [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  static auto real = RealFn<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  Wait(this, 0, [&] { return real(this, cond), Done{}; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Duration)>(
      "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_"
      "8DurationE");
  return Wait(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static auto real = RealFn<bool (*)(Mutex*, const Condition&, Time)>(
      "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Wait(this, 0, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static auto real = RealFn<void (*)(CondVar*, Mutex*)>(
      "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  ::Wait(mu, 0, [&] { return real(this, mu), Done{}; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static auto real = RealFn<bool (*)(CondVar*, Mutex*, Duration)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return ::Wait(mu, 0, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static auto real = RealFn<bool (*)(CondVar*, Mutex*, Time)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return ::Wait(mu, 0, [&] { return real(this, mu, deadline); });
}

ABSL_NAMESPACE_END
}  // namespace absl
