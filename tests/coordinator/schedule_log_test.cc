#include "coordinator/core/schedule_log.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/policy.h"
#include "coordinator/core/trace_collector.h"
#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator {
namespace {

namespace fs = std::filesystem;
using hsdp::v1::Policy;
using testing::FreshDir;
using testing::MakeUnits;
using testing::P;

constexpr absl::Duration kWait = absl::Seconds(20);
constexpr absl::Duration kShort = absl::Milliseconds(50);

std::unique_ptr<ScheduleLog> MakeLog(int world, int read_ahead,
                                     StateStore* store = nullptr,
                                     const Policy& policy = Policy(),
                                     bool units = true) {
  ScheduleLog::Options options;
  options.world_size = world;
  options.shard_size = world;
  options.read_ahead = read_ahead;
  auto log = ScheduleLog::Create(options, policy, store);
  EXPECT_TRUE(log.ok()) << log.status();
  if (!log.ok()) return nullptr;
  if (units) {
    absl::Status s = (*log)->SetUnits(MakeUnits(3));
    EXPECT_TRUE(s.ok()) << s;
  }
  return std::move(*log);
}

absl::Time Soon() { return absl::Now() + kWait; }

// The log's first generation.
constexpr GenerationContext kGen0{};

// Reports `step` complete for every rank.
void CompleteAll(ScheduleLog& log, int world, int64_t step) {
  for (int rank = 0; rank < world; ++rank) {
    hsdp::v1::StepReport report;
    report.set_rank(rank);
    report.set_step(step);
    ASSERT_TRUE(log.RecordReport(report).ok());
  }
}

TEST(ScheduleLogTest, FirstReadSealsAndLaterReadsAreByteIdentical) {
  auto log = MakeLog(2, 4);
  EXPECT_EQ(log->sealed_step(), -1);
  EXPECT_EQ(log->GetSealed(0).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<ScheduleRead> first = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NE(first->sealed, nullptr);
  EXPECT_FALSE(first->drained);
  EXPECT_EQ(first->sealed->bytes, first->sealed->schedule.SerializeAsString());
  EXPECT_EQ(first->sealed->schedule.generation(), 0);
  EXPECT_EQ(log->sealed_step(), 0);
  // Later reads — even after a policy change — see the same bytes.
  ASSERT_TRUE(log->SetPolicy(P("reshard_after_forward: false")).ok());
  absl::StatusOr<ScheduleRead> again = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->sealed->bytes, first->sealed->bytes);
  absl::StatusOr<std::shared_ptr<const SealedSchedule>> control =
      log->GetSealed(0);
  ASSERT_TRUE(control.ok());
  EXPECT_EQ((*control)->bytes, first->sealed->bytes);
}

TEST(ScheduleLogTest, SealsInOrderAndControlReadsNeverSeal) {
  auto log = MakeLog(1, 4);
  ASSERT_TRUE(log->GetSchedule(2, kGen0, Soon()).ok());
  EXPECT_EQ(log->sealed_step(), 2);
  for (int step = 0; step <= 2; ++step) {
    absl::StatusOr<std::shared_ptr<const SealedSchedule>> s =
        log->GetSealed(step);
    ASSERT_TRUE(s.ok()) << step;
    EXPECT_EQ((*s)->schedule.step(), step);
  }
  EXPECT_EQ(log->GetSealed(3).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(log->sealed_step(), 2);
}

TEST(ScheduleLogTest, BadReads) {
  auto log = MakeLog(1, 4, nullptr, Policy(), /*units=*/false);
  EXPECT_EQ(log->GetSchedule(0, kGen0, Soon()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(log->SetUnits(MakeUnits(3)).ok());
  EXPECT_TRUE(log->SetUnits(MakeUnits(3)).ok());
  EXPECT_EQ(log->SetUnits(MakeUnits(4)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(log->GetSchedule(-1, kGen0, Soon()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ScheduleLogTest, PolicyChangeLandsOnAnnouncedStep) {
  auto log = MakeLog(1, 8);
  ASSERT_TRUE(log->GetSchedule(1, kGen0, Soon()).ok());  // seals 0, 1
  absl::StatusOr<PolicyInfo> change =
      log->SetPolicy(P("forward_prefetch_depth: 2"));
  ASSERT_TRUE(change.ok()) << change.status();
  EXPECT_EQ(change->version, 2);
  EXPECT_EQ(change->effective_step, 2);
  EXPECT_EQ(log->CurrentPolicy().version, 2);
  // Two changes before the next seal: the later one governs step 2.
  change = log->SetPolicy(P("forward_prefetch_depth: 3"));
  ASSERT_TRUE(change.ok());
  EXPECT_EQ(change->version, 3);
  EXPECT_EQ(change->effective_step, 2);
  absl::StatusOr<ScheduleRead> s1 = log->GetSchedule(1, kGen0, Soon());
  absl::StatusOr<ScheduleRead> s2 = log->GetSchedule(2, kGen0, Soon());
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->sealed->schedule.policy_version(), 1);
  EXPECT_EQ(s1->sealed->schedule.units(0).forward_prefetch_size(), 1);
  EXPECT_EQ(s2->sealed->schedule.policy_version(), 3);
  EXPECT_EQ(s2->sealed->schedule.units(0).forward_prefetch_size(), 3);
  EXPECT_EQ(log->PolicyHistory().size(), 3u);
}

TEST(ScheduleLogTest, InvalidPolicyChangesNothing) {
  auto log = MakeLog(1, 4);
  const PolicyInfo before = log->CurrentPolicy();
  absl::StatusOr<PolicyInfo> bad =
      log->SetPolicy(P("forward_prefetch_depth: -1"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  bad = log->SetPolicy(
      P("overrides { unit_glob: \"blocks.*\" reshard_after_forward: false }"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("matches no unit"), std::string::npos);
  EXPECT_EQ(log->CurrentPolicy().version, before.version);
  EXPECT_EQ(log->PolicyHistory().size(), 1u);
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->sealed->schedule.policy_version(), 1);
  // The initial policy is validated too.
  ScheduleLog::Options options;
  EXPECT_EQ(ScheduleLog::Create(options, P("microbatches: -2"), nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ScheduleLogTest, InitialPolicyGlobCheckedWhenUnitsArrive) {
  auto log = MakeLog(
      1, 4, nullptr,
      P("overrides { unit_glob: \"blocks.*\" reshard_after_forward: false }"),
      /*units=*/false);
  EXPECT_EQ(log->SetUnits(MakeUnits(2)).code(),
            absl::StatusCode::kInvalidArgument);
  // The units were still taken: planning works, the override is inert.
  EXPECT_TRUE(log->has_units());
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->sealed->schedule.units(1).reshard_after_forward());
}

// A budget below the least peak the model can reach: refused by SetPolicy
// once the model is known (the running policy stays), reported on every
// sealed step when it came in before the model (the initial policy).
TEST(ScheduleLogTest, MemoryBudgetBelowTheLeastPeakIsRefusedOrReported) {
  auto log = MakeLog(2, 4);
  ASSERT_TRUE(log->SetPolicy(P("memory_budget_bytes: 1000000")).ok());
  absl::StatusOr<PolicyInfo> refused =
      log->SetPolicy(P("memory_budget_bytes: 10"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("policy.memory_budget_bytes"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(log->CurrentPolicy().version, 2);
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->sealed->schedule.over_memory_budget());
  EXPECT_GT(s->sealed->schedule.predicted_peak_bytes(), 0);

  auto early = MakeLog(2, 4, nullptr, P("memory_budget_bytes: 10"),
                       /*units=*/false);
  ASSERT_TRUE(early->SetUnits(MakeUnits(3)).ok());
  s = early->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->sealed->schedule.over_memory_budget());
  for (int i = 1; i < s->sealed->schedule.units_size(); ++i) {
    EXPECT_TRUE(s->sealed->schedule.units(i).reshard_after_forward());
  }
}

// Reported peaks reach the planner: a step measured above its prediction
// raises the correction the next steps are planned with.
TEST(ScheduleLogTest, ReportedPeaksCorrectTheMemoryModel) {
  auto log = MakeLog(2, 4, nullptr, P("memory_budget_bytes: 1000000"));
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  const int64_t predicted = s->sealed->schedule.predicted_peak_bytes();
  for (int rank = 0; rank < 2; ++rank) {
    hsdp::v1::StepReport report;
    report.set_rank(rank);
    report.set_step(0);
    report.set_peak_memory_bytes(predicted + 1000 * (rank + 1));
    ASSERT_TRUE(log->RecordReport(report).ok());
  }
  EXPECT_EQ(log->memory_correction_bytes(), 2000);
}

TEST(ScheduleLogTest, ReadAheadWindowWaitsOrRefuses) {
  // world 2, read-ahead 2 -> refuse beyond 4 * 2 = 8 past floor + 1.
  auto log = MakeLog(2, 2);
  ASSERT_TRUE(
      log->GetSchedule(2, kGen0, Soon()).ok());  // floor -1: steps 0..2 open
  absl::StatusOr<ScheduleRead> blocked =
      log->GetSchedule(3, kGen0, absl::Now() + kShort);
  EXPECT_EQ(blocked.status().code(), absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<ScheduleRead> far = log->GetSchedule(9, kGen0, Soon());
  EXPECT_EQ(far.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(far.status().message().find("too far ahead"), std::string::npos);
  EXPECT_EQ(log->sealed_step(), 2);

  // A blocked read opens once the slowest rank completes step 0.
  absl::StatusOr<ScheduleRead> waited;
  std::thread reader([&] { waited = log->GetSchedule(3, kGen0, Soon()); });
  absl::SleepFor(absl::Milliseconds(20));
  hsdp::v1::StepReport report;
  report.set_rank(0);
  report.set_step(0);
  ASSERT_TRUE(log->RecordReport(report).ok());
  EXPECT_EQ(log->min_completed_step(), -1);  // rank 1 has not reported
  report.set_rank(1);
  ASSERT_TRUE(log->RecordReport(report).ok());
  reader.join();
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_EQ(waited->sealed->schedule.step(), 3);
  EXPECT_EQ(log->min_completed_step(), 0);
}

TEST(ScheduleLogTest, BadReports) {
  auto log = MakeLog(2, 2);
  hsdp::v1::StepReport report;
  report.set_rank(2);
  EXPECT_EQ(log->RecordReport(report).code(),
            absl::StatusCode::kInvalidArgument);
  report.set_rank(0);
  report.set_step(-1);
  EXPECT_EQ(log->RecordReport(report).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ScheduleLogTest, DrainStopsSealing) {
  auto log = MakeLog(1, 2);
  ASSERT_TRUE(log->GetSchedule(1, kGen0, Soon()).ok());
  // A reader blocked beyond the window is released by the drain.
  absl::StatusOr<ScheduleRead> waiting;
  std::thread reader([&] { waiting = log->GetSchedule(4, kGen0, Soon()); });
  absl::SleepFor(absl::Milliseconds(20));
  absl::StatusOr<int64_t> last = log->Drain();
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, 2);
  reader.join();
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_TRUE(waiting->drained);
  EXPECT_EQ(waiting->sealed, nullptr);
  EXPECT_EQ(*log->Drain(), 2);  // idempotent
  EXPECT_EQ(log->drain_step(), 2);
  // The drain step itself still runs; nothing after it is sealed.
  absl::StatusOr<ScheduleRead> s2 = log->GetSchedule(2, kGen0, Soon());
  ASSERT_TRUE(s2.ok());
  EXPECT_FALSE(s2->drained);
  EXPECT_TRUE(log->GetSchedule(3, kGen0, Soon())->drained);
  EXPECT_EQ(log->sealed_step(), 2);
  EXPECT_EQ(log->RequestCheckpoint().status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ScheduleLogTest, CheckpointRequestsAndRecords) {
  auto log = MakeLog(2, 4, nullptr, P("checkpoint_interval: 4"));
  ASSERT_TRUE(log->GetSchedule(0, kGen0, Soon()).ok());
  absl::StatusOr<int64_t> step = log->RequestCheckpoint();
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(*step, 1);
  EXPECT_EQ(*log->RequestCheckpoint(), 1);
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(3, kGen0, Soon());
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE((*log->GetSealed(0))->schedule.checkpoint());
  EXPECT_TRUE((*log->GetSealed(1))->schedule.checkpoint());
  EXPECT_FALSE((*log->GetSealed(2))->schedule.checkpoint());
  EXPECT_TRUE((*log->GetSealed(3))->schedule.checkpoint());  // interval

  EXPECT_EQ(log->last_checkpoint_step(), -1);
  hsdp::v1::StepReport report;
  report.set_step(1);
  report.set_checkpoint_saved(true);
  report.set_rank(0);
  ASSERT_TRUE(log->RecordReport(report).ok());
  EXPECT_EQ(log->last_checkpoint_step(), -1);  // rank 1 has not saved yet
  report.set_rank(1);
  ASSERT_TRUE(log->RecordReport(report).ok());
  EXPECT_EQ(log->last_checkpoint_step(), 1);
}

TEST(ScheduleLogTest, ShutdownReleasesReaders) {
  auto log = MakeLog(1, 0);
  ASSERT_TRUE(log->GetSchedule(0, kGen0, Soon()).ok());
  absl::StatusOr<ScheduleRead> waiting;
  std::thread reader([&] { waiting = log->GetSchedule(1, kGen0, Soon()); });
  absl::SleepFor(absl::Milliseconds(20));
  log->Shutdown();
  reader.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kUnavailable);
}

// Many ranks read every step concurrently while the policy changes every few
// steps: all ranks get byte-identical schedules, each change lands on the
// announced step, and every step carries exactly the version whose range covers
// it.
TEST(ScheduleLogTest, ConcurrentReadersWithPolicyChanges) {
  constexpr int kWorld = 16;
  constexpr int kSteps = 60;
  auto log = MakeLog(kWorld, 2);
  std::vector<std::vector<std::string>> seen(kWorld,
                                             std::vector<std::string>(kSteps));
  std::atomic<int> errors{0};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<ScheduleRead> s = log->GetSchedule(step, kGen0, Soon());
        if (!s.ok() || s->sealed == nullptr) {
          ++errors;
          return;
        }
        seen[rank][step] = s->sealed->bytes;
        hsdp::v1::StepReport report;
        report.set_rank(rank);
        report.set_step(step);
        if (!log->RecordReport(report).ok()) ++errors;
      }
    });
  }
  std::vector<PolicyInfo> announced;
  for (int change = 0; change < 12; ++change) {
    Policy p;
    p.set_forward_prefetch_depth(change % 4);
    p.set_microbatches(1 + change % 3);
    absl::StatusOr<PolicyInfo> info = log->SetPolicy(p);
    ASSERT_TRUE(info.ok());
    announced.push_back(*info);
    absl::SleepFor(absl::Milliseconds(2));
  }
  for (auto& t : ranks) t.join();
  ASSERT_EQ(errors.load(), 0);
  for (int step = 0; step < kSteps; ++step) {
    for (int rank = 1; rank < kWorld; ++rank) {
      ASSERT_EQ(seen[rank][step], seen[0][step])
          << "rank " << rank << " step " << step;
    }
  }
  const std::vector<PolicyInfo> history = log->PolicyHistory();
  for (int step = 0; step < kSteps; ++step) {
    const hsdp::v1::StepSchedule& s = (*log->GetSealed(step))->schedule;
    int64_t expected = 1;
    const PolicyInfo* governing = &history.front();
    for (const PolicyInfo& info : history) {
      if (info.effective_step <= step) {
        expected = info.version;
        governing = &info;
      }
    }
    EXPECT_EQ(s.policy_version(), expected) << step;
    // The whole step follows that one policy.
    const Policy resolved = ResolvePolicyDefaults(governing->policy);
    EXPECT_EQ(s.microbatches_size(), resolved.microbatches()) << step;
    EXPECT_EQ(s.units(0).forward_prefetch_size(),
              std::min(resolved.forward_prefetch_depth(), s.units_size() - 1))
        << step;
  }
  for (const PolicyInfo& info : announced) {
    if (info.effective_step >= kSteps) continue;
    const int64_t v =
        (*log->GetSealed(info.effective_step))->schedule.policy_version();
    EXPECT_GE(
        v, info.version);  // a later change announced for the same step may win
    if (info.effective_step > 0) {
      EXPECT_LT(
          (*log->GetSealed(info.effective_step - 1))->schedule.policy_version(),
          info.version);
    }
  }
}

TEST(ScheduleLogTest, RestartServesIdenticalSealedSteps) {
  const std::string dir = FreshDir("state");
  std::vector<std::string> before;
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    auto log = MakeLog(1, 4, store->get(), P("microbatches: 2"));
    ASSERT_TRUE(log->GetSchedule(1, kGen0, Soon()).ok());
    ASSERT_TRUE(log->SetPolicy(P("forward_prefetch_depth: 0")).ok());
    ASSERT_TRUE(log->GetSchedule(3, kGen0, Soon()).ok());
    CompleteAll(*log, 1, 3);
    ASSERT_TRUE(log->RequestCheckpoint().ok());  // step 4
    hsdp::v1::StepReport saved;
    saved.set_step(3);
    saved.set_checkpoint_saved(true);
    ASSERT_TRUE(log->RecordReport(saved).ok());
    for (int step = 0; step <= 3; ++step)
      before.push_back((*log->GetSealed(step))->bytes);
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  // A different initial policy on restart: the persisted history wins.
  auto log = MakeLog(1, 4, store->get(), P("microbatches: 7"), /*units=*/false);
  EXPECT_TRUE(log->restored());
  EXPECT_FALSE(log->has_units());  // the unit list is persisted by Membership
  ASSERT_TRUE(log->SetUnits(MakeUnits(3)).ok());
  EXPECT_EQ(log->sealed_step(), 3);
  for (int step = 0; step <= 3; ++step) {
    absl::StatusOr<ScheduleRead> s = log->GetSchedule(step, kGen0, Soon());
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->sealed->bytes, before[step]) << step;
  }
  EXPECT_EQ(log->CurrentPolicy().version, 2);
  EXPECT_EQ(log->PolicyHistory().size(), 2u);
  EXPECT_EQ(log->last_checkpoint_step(), 3);
  // The window survives the restart (completed steps are not persisted), and
  // the pending checkpoint request and the persisted policy govern the next
  // step.
  absl::StatusOr<ScheduleRead> next = log->GetSchedule(4, kGen0, Soon());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->sealed->schedule.policy_version(), 2);
  EXPECT_EQ(next->sealed->schedule.microbatches_size(),
            1);  // not the 7 passed now
  EXPECT_EQ(next->sealed->schedule.units(0).forward_prefetch_size(), 0);
  EXPECT_TRUE(next->sealed->schedule.checkpoint());
}

TEST(ScheduleLogTest, RestoresUnitsFromStore) {
  const std::string dir = FreshDir("state");
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)
                  ->Update([](PersistedState* s) {
                    const UnitList units = MakeUnits(2);
                    s->mutable_units()->Assign(units.begin(), units.end());
                    auto* p = s->add_policies();
                    p->set_version(1);
                  })
                  .ok());
  auto log = MakeLog(1, 4, store->get(), Policy(), /*units=*/false);
  EXPECT_TRUE(log->has_units());
  absl::StatusOr<ScheduleRead> s = log->GetSchedule(0, kGen0, Soon());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->sealed->schedule.units_size(), 3);
}

TEST(ScheduleLogTest, TraceRequestsMarkOnlyTheirSteps) {
  auto log = MakeLog(1, 4);
  ASSERT_TRUE(log->GetSchedule(0, kGen0, Soon()).ok());
  // First unsealed (1) through 2.
  absl::StatusOr<std::pair<int64_t, int64_t>> range = log->RequestTrace(0, 2);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->first, 1);
  EXPECT_EQ(range->second, 2);
  CompleteAll(*log, 1, 0);
  CompleteAll(*log, 1, 1);
  ASSERT_TRUE(log->GetSchedule(3, kGen0, Soon()).ok());
  for (int64_t step = 0; step <= 3; ++step) {
    auto sealed = log->GetSealed(step);
    ASSERT_TRUE(sealed.ok());
    EXPECT_EQ((*sealed)->schedule.trace(), step == 1 || step == 2) << step;
  }
  // Sealed steps cannot be traced any more; a bad range changes nothing.
  absl::Status sealed = log->RequestTrace(2, 4).status();
  EXPECT_EQ(sealed.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(sealed.message().find("first_step 2"), std::string::npos) << sealed;
  absl::Status backwards = log->RequestTrace(9, 5).status();
  EXPECT_EQ(backwards.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(backwards.message().find("last_step"), std::string::npos);
  EXPECT_EQ(log->RequestTrace(10, 10 + kMaxTraceSteps).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Restoring a damaged state directory.

// A state directory of a 4-rank job over three generations, as the
// coordinator leaves it: generation 0 sealed steps 0..5 and committed 0..2;
// generation 1 (2 ranks, from step 3) sealed 3..7 and committed 3..5;
// generation 2 (4 ranks, from step 6) sealed 6..9 and committed 6..8 (the
// commit point Membership keeps). Steps 3..5 of generation 0 and 6..7 of
// generation 1 are superseded.
constexpr int64_t kLastSealed = 9;
constexpr int64_t kLastCommitted = 8;

// The generation whose record serves `step` in that directory.
int64_t OwnerOf(int64_t step) { return step < 3 ? 0 : step < 6 ? 1 : 2; }

std::string StepFile(const std::string& dir, int64_t step, int64_t generation) {
  char name[64];
  if (generation == 0) {
    std::snprintf(name, sizeof(name), "%012lld.binpb",
                  static_cast<long long>(step));
  } else {
    std::snprintf(name, sizeof(name), "%012lld-g%lld.binpb",
                  static_cast<long long>(step),
                  static_cast<long long>(generation));
  }
  return (fs::path(dir) / "steps" / name).string();
}

void MakeThreeGenerations(const std::string& dir) {
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto log = MakeLog(4, 4, store->get());
  ASSERT_TRUE(log->GetSchedule(2, kGen0, Soon()).ok());
  log->RecordCommitted(2);
  ASSERT_TRUE(log->GetSchedule(5, kGen0, Soon()).ok());
  const GenerationContext g1{1, 2, 3};
  ASSERT_TRUE(log->BeginGeneration(g1).ok());
  ASSERT_TRUE(log->GetSchedule(7, g1, Soon()).ok());
  log->RecordCommitted(5);
  const GenerationContext g2{2, 4, 6};
  ASSERT_TRUE(log->BeginGeneration(g2).ok());
  ASSERT_TRUE(log->GetSchedule(kLastSealed, g2, Soon()).ok());
  log->RecordCommitted(kLastCommitted);
  state::CommitPoint point;
  point.set_generation(2);
  point.set_step(kLastCommitted);
  point.set_committed_in_generation(kLastCommitted - 6 + 1);
  ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
  ASSERT_EQ(log->sealed_step(), kLastSealed);
}

// A copy of `from` (the original stays for the next case).
std::string CopyOf(const std::string& from, const std::string& name) {
  const std::string to = FreshDir(name);
  fs::copy(from, to,
           fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  return to;
}

// Opens `dir` as a restarting coordinator does.
absl::StatusOr<std::unique_ptr<ScheduleLog>> Restart(
    const std::string& dir, std::unique_ptr<StateStore>* store) {
  absl::StatusOr<std::unique_ptr<StateStore>> opened = StateStore::Open(dir);
  if (!opened.ok()) return opened.status();
  *store = *std::move(opened);
  ScheduleLog::Options options;
  options.world_size = 4;
  options.shard_size = 4;
  options.read_ahead = 4;
  return ScheduleLog::Create(options, Policy(), store->get());
}

// Expects a restart on `dir` to be refused with DATA_LOSS in one line that
// contains each of `needles`.
void ExpectRefused(const std::string& dir,
                   const std::vector<std::string>& needles,
                   const std::string& what) {
  std::unique_ptr<StateStore> store;
  absl::StatusOr<std::unique_ptr<ScheduleLog>> log = Restart(dir, &store);
  ASSERT_FALSE(log.ok()) << what << ": the damaged directory was accepted";
  EXPECT_EQ(log.status().code(), absl::StatusCode::kDataLoss) << what;
  const std::string message(log.status().message());
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos)
        << what << ": \"" << needle << "\" not in: " << message;
  }
}

TEST(ScheduleLogRestoreTest, TheUndamagedDirectoryRestoresEveryGeneration) {
  const std::string dir = FreshDir("state");
  MakeThreeGenerations(dir);
  std::unique_ptr<StateStore> store;
  auto log = Restart(dir, &store);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ((*log)->sealed_step(), kLastSealed);
  EXPECT_EQ((*log)->generation(), 2);
  for (int64_t step = 0; step <= kLastSealed; ++step) {
    EXPECT_EQ((*(*log)->GetSealed(step))->schedule.generation(), OwnerOf(step))
        << step;
  }
  EXPECT_TRUE((*log)->GetSealed(4, 0).ok());  // superseded, still readable
}

// Deleting any one record that serves a step before the last sealed one is
// refused, naming the step and the file.
TEST(ScheduleLogRestoreTest, EveryMissingSealedStepIsRefusedNamingIt) {
  const std::string original = FreshDir("state");
  MakeThreeGenerations(original);
  for (int64_t step = 0; step < kLastSealed; ++step) {
    const std::string dir = CopyOf(original, "copy");
    const std::string file = StepFile(dir, step, OwnerOf(step));
    ASSERT_TRUE(fs::remove(file)) << file;
    ExpectRefused(dir,
                  {absl::StrCat("sealed step ", step, " is missing"), file},
                  absl::StrCat("step ", step, " deleted"));
  }
}

// The last sealed step of the last generation, uncommitted, is what a crash
// before its record was written leaves: it is sealed again. The committed
// last step is refused.
TEST(ScheduleLogRestoreTest, OnlyTheNewestUncommittedRecordMayBeAbsent) {
  const std::string original = FreshDir("state");
  MakeThreeGenerations(original);
  const std::string dir = CopyOf(original, "uncommitted");
  ASSERT_TRUE(fs::remove(StepFile(dir, kLastSealed, 2)));
  {
    std::unique_ptr<StateStore> store;
    auto log = Restart(dir, &store);
    ASSERT_TRUE(log.ok()) << log.status();
    EXPECT_EQ((*log)->sealed_step(), kLastSealed - 1);
  }
  const std::string committed = CopyOf(original, "committed");
  ASSERT_TRUE(fs::remove(StepFile(committed, kLastSealed, 2)));
  ASSERT_TRUE(fs::remove(StepFile(committed, kLastSealed - 1, 2)));
  ExpectRefused(committed,
                {absl::StrCat("sealed step ", kLastCommitted, " is missing"),
                 StepFile(committed, kLastCommitted, 2), "commit.binpb"},
                "the committed last step deleted");
}

// Superseded records serve no step: the directory stays consistent without
// them.
TEST(ScheduleLogRestoreTest, SupersededRecordsAreNotNeeded) {
  const std::string dir = FreshDir("state");
  MakeThreeGenerations(dir);
  for (int64_t step = 3; step <= 5; ++step) {
    ASSERT_TRUE(fs::remove(StepFile(dir, step, 0)));
  }
  ASSERT_TRUE(fs::remove(StepFile(dir, 7, 1)));
  std::unique_ptr<StateStore> store;
  auto log = Restart(dir, &store);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ((*log)->sealed_step(), kLastSealed);
}

// A record of a generation the directory never began, or from before its
// generation's start, is refused naming it.
TEST(ScheduleLogRestoreTest, RecordsOfGenerationsThatDoNotFollowAreRefused) {
  const std::string original = FreshDir("state");
  MakeThreeGenerations(original);
  auto plant = [](const std::string& dir, int64_t step, int64_t generation) {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    hsdp::v1::StepSchedule schedule;
    schedule.set_step(step);
    schedule.set_generation(generation);
    ASSERT_TRUE(
        (*store)
            ->SaveSealedStep(step, generation, schedule.SerializeAsString())
            .ok());
  };
  const std::string unknown = CopyOf(original, "unknown");
  plant(unknown, 8, 3);
  ExpectRefused(
      unknown,
      {"sealed step 8", StepFile(unknown, 8, 3), "generation 3", "never began"},
      "a record of generation 3");
  const std::string early = CopyOf(original, "early");
  plant(early, 4, 2);
  ExpectRefused(early,
                {"sealed step 4", StepFile(early, 4, 2), "began at step 6"},
                "a record from before its generation's start");

  // Generation starts out of order in state.binpb.
  const std::string disorder = CopyOf(original, "disorder");
  {
    auto store = StateStore::Open(disorder);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)
                    ->Update([](PersistedState* s) {
                      s->mutable_generation_starts()->SwapElements(0, 1);
                    })
                    .ok());
  }
  ExpectRefused(disorder, {"state.binpb", "generation 1", "does not follow"},
                "generation starts out of order");
}

// A step file cut anywhere, or with a flipped byte, is refused naming it: the
// write protocol never leaves one (a crash leaves only a temp file).
TEST(ScheduleLogRestoreTest, TruncatedOrCorruptStepFilesAreRefused) {
  const std::string original = FreshDir("state");
  MakeThreeGenerations(original);
  const std::string target = StepFile(original, 4, 1);
  std::string contents;
  {
    std::ifstream in(target, std::ios::binary);
    contents.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_GT(contents.size(), 16u);
  for (size_t length = 0; length < contents.size(); ++length) {
    const std::string dir = CopyOf(original, "cut");
    std::ofstream(StepFile(dir, 4, 1), std::ios::binary | std::ios::trunc)
        << contents.substr(0, length);
    ExpectRefused(dir, {"sealed step 4", StepFile(dir, 4, 1)},
                  absl::StrCat("cut to ", length, " bytes"));
  }
  const std::string flipped = CopyOf(original, "flipped");
  std::string bad = contents;
  bad.back() ^= 0x40;
  std::ofstream(StepFile(flipped, 4, 1), std::ios::binary | std::ios::trunc)
      << bad;
  ExpectRefused(flipped, {"sealed step 4", "checksum"}, "a flipped byte");
}

// What a crash mid-write leaves (a temp file beside the intact target) is
// passed over with a line naming it.
TEST(ScheduleLogRestoreTest, ALeftoverTempFileIsPassedOverAndSaid) {
  const std::string dir = FreshDir("state");
  MakeThreeGenerations(dir);
  const std::string temp = StepFile(dir, kLastSealed + 1, 2) + ".tmp";
  std::ofstream(temp, std::ios::binary) << std::string("\0hsdp", 5);
  ::testing::internal::CaptureStderr();
  std::unique_ptr<StateStore> store;
  auto log = Restart(dir, &store);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ((*log)->sealed_step(), kLastSealed);
  EXPECT_NE(said.find(temp), std::string::npos) << said;
  EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 1) << said;
  EXPECT_FALSE(fs::exists(temp));
}

// A state directory whose state file is gone but which holds sealed steps is
// refused.
TEST(ScheduleLogRestoreTest, SealedStepsWithoutAStateFileAreRefused) {
  const std::string dir = FreshDir("state");
  MakeThreeGenerations(dir);
  ASSERT_TRUE(fs::remove(fs::path(dir) / "state.binpb"));
  ExpectRefused(dir, {"state.binpb", "holds no policy"}, "state file deleted");
}

// A generation that cannot be persisted seals nothing until it can, so no
// record of a generation the directory does not know is ever written.
TEST(ScheduleLogRestoreTest, AGenerationIsPersistedBeforeItsFirstRecord) {
  const std::string dir = FreshDir("state");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    auto log = MakeLog(4, 4, store->get());
    ASSERT_TRUE(log->GetSchedule(2, kGen0, Soon()).ok());
    log->RecordCommitted(1);
    // The state file cannot be replaced (as on a full disk).
    const fs::path blocker = fs::path(dir) / "state.binpb.tmp";
    fs::create_directory(blocker);
    ::testing::internal::CaptureStderr();
    const GenerationContext g1{1, 2, 2};
    EXPECT_FALSE(log->BeginGeneration(g1).ok());
    EXPECT_FALSE(log->GetSchedule(2, g1, Soon()).ok());
    (void)::testing::internal::GetCapturedStderr();
    EXPECT_FALSE(fs::exists(StepFile(dir, 2, 1)));
    fs::remove(blocker);
    ::testing::internal::CaptureStderr();
    absl::StatusOr<ScheduleRead> read = log->GetSchedule(2, g1, Soon());
    (void)::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->sealed->schedule.generation(), 1);
  }
  std::unique_ptr<StateStore> store;
  auto log = Restart(dir, &store);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ((*log)->generation(), 1);
  EXPECT_EQ((*(*log)->GetSealed(2))->schedule.generation(), 1);
}

}  // namespace
}  // namespace hsdp::coordinator
