#include "worker/train/elastic_loop.h"

#include <glog/logging.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/status_util.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/agent/agent.h"
#include "worker/agent/coordinator_store.h"
#include "worker/fsdp/fully_shard.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/train/checkpointing.h"
#include "worker/train/microbatch.h"
#include "worker/train/optimizer.h"
#include "worker/train/report_file.h"
#include "worker/train/run_setup.h"
#include "worker/train/shard_state.h"
#include "worker/train/step_trace.h"
#include "worker/train/task_checks.h"
#include "worker/train/task_units.h"
#include "worker/train/training_options.h"
#include "worker/train/unit_entry.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::train {
namespace {

using hsdp::v1::Generation;

// Marks a status as a failure of the generation's communicators (a
// collective, the rendezvous, a heal), which re-forms instead of stopping.
constexpr absl::string_view kCollectiveFailureUrl =
    "type.hsdp.dev/collective-failure";

// One AwaitGeneration call's bound; the call is repeated while nothing
// changes (the job may be waiting for workers).
constexpr absl::Duration kAwaitPoll = absl::Seconds(60);

absl::Status CollectiveFailure(absl::Status s) {
  if (!s.ok()) s.SetPayload(kCollectiveFailureUrl, absl::Cord("1"));
  return s;
}

bool IsCollectiveFailure(const absl::Status& s) {
  return s.GetPayload(kCollectiveFailureUrl).has_value();
}

// LibTorch's words for a tensor whose storage bytes are freed: what reading a
// resharded unit's parameters outside its forward gives.
bool IsFreedStorageError(const std::string& what) {
  return absl::StrContains(what, "data is not allocated yet") ||
         (absl::StrContains(what, "setStorage") &&
          absl::StrContains(what, "storage of size 0"));
}

// FAILED_PRECONDITION naming the likely unit (fsdp::Engine::ForwardPosition)
// instead of LibTorch's allocation error.
absl::Status UnitUsedOutsideItsForward(int64_t step, const fsdp::Engine& engine,
                                       const std::string& what) {
  const auto [entered, next] = engine.ForwardPosition();
  const std::string where =
      next.empty() ? absl::StrCat("after the last unit, ", entered)
                   : absl::StrCat("after unit ", entered,
                                  " and before the forward entered unit ", next,
                                  ": most likely unit ", next,
                                  "'s module was called directly");
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step,
      ": a sharded unit's parameters were used outside its forward, ", where,
      ". Call a unit's module through its hsdp::train::Unit<> wrapper or "
      "ShardContext::Forward (LibTorch said: ",
      what.substr(0, what.find('\n')), ")"));
}

// Errors a communicator gives when a peer or the generation went away, as
// opposed to bad input or a broken checkpoint.
bool IsCommunicationCode(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted ||
         code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded;
}

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

bool EveryRoleTrains(const Generation& g) {
  return std::all_of(g.roles().begin(), g.roles().end(), [](int role) {
    return role == hsdp::v1::GENERATION_ROLE_TRAIN ||
           role == hsdp::v1::GENERATION_ROLE_UNSPECIFIED;
  });
}

const char* RoleName(int role) {
  switch (role) {
    case hsdp::v1::GENERATION_ROLE_HEAL_SOURCE:
      return "heal source";
    case hsdp::v1::GENERATION_ROLE_HEAL_TARGET:
      return "heal target";
    default:
      return "train";
  }
}

// What a step (or entering a generation) leads to.
enum class Next { kStep, kReform, kFinish };

// The loop of worker/agent/ELASTIC.md for one process. Thread-compatible
// except OnGenerationEnd, which the agent's watcher calls from its thread.
class ShardedRun {
 public:
  ShardedRun(std::unique_ptr<Task> task, const WorkerOptions& options)
      : task_(std::move(task)),
        o_(options),
        t_(options.training),
        device_(options.device) {}
  ~ShardedRun() {
    {
      absl::MutexLock lock(&mu_);
      abort_target_ = nullptr;
    }
    // The engine before the communicators its works were issued on, those
    // before the stores they rendezvoused through, and the agent (whose
    // watcher calls OnGenerationEnd) before mu_.
    checkpointing_.reset();
    unit_bindings_.Clear();
    units_context_.reset();
    opt_.reset();
    engine_.reset();
    mesh_.reset();
    old_mesh_.reset();
    store_.reset();
    old_store_.reset();
    agent_.reset();
  }
  ShardedRun(const ShardedRun&) = delete;
  ShardedRun& operator=(const ShardedRun&) = delete;

  absl::Status Run();

 private:
  absl::Status Start();
  // The next generation this worker is a member of; nullopt when it must
  // stop without an error (job finished, evicted).
  absl::StatusOr<std::optional<Generation>> AwaitNext(int64_t known);
  absl::StatusOr<Next> RunGeneration(const Generation& g);
  absl::Status Enter(const Generation& g);
  absl::Status Heal(const Generation& g);
  absl::StatusOr<Next> Step(int64_t step);
  // The step's mean loss (or clipped norm) is not finite, on every rank: the
  // one line naming the step, and the first rank and microbatch whose loss is
  // not finite (a collective: every rank calls it). `microbatch_losses` are
  // this rank's real microbatches' losses.
  absl::StatusOr<std::string> DescribeNonFinite(
      int64_t step, double loss, std::optional<double> norm,
      const std::vector<at::Tensor>& microbatch_losses);
  // Fails the job with `message` at the coordinator and returns it.
  absl::Status StopForNonFinite(int64_t step, const std::string& message);
  // A failed step or entry: re-form (after reporting a failed collective), or
  // the error when it is not a communication failure.
  absl::StatusOr<Next> OnFailure(const absl::Status& s, int64_t step);
  void Leave();
  absl::Status Finish();
  void OnGenerationEnd(int64_t generation, const absl::Status& why);
  void PublishMesh();

  std::unique_ptr<Task> task_;
  const WorkerOptions& o_;
  const TrainingOptions& t_;
  const c10::Device device_;
  fsdp::EngineOptions engine_options_;
  std::vector<fsdp::UnitInfo> units_;
  CheckpointingOptions checkpointing_options_;
  std::unique_ptr<agent::Agent> agent_;
  ReportFile report_file_;
  // The training settings reported at Join and written to the report file.
  hsdp::v1::TrainingSpec spec_;
  int64_t last_step_ = 0;

  // The current generation and its communicators. The previous ones are kept
  // until the engine's Rebind dropped the works it issued on them.
  Generation generation_;
  int rank_ = -1;
  std::unique_ptr<agent::CoordinatorStore> store_;
  std::unique_ptr<comm::DeviceMesh> mesh_;
  std::unique_ptr<agent::CoordinatorStore> old_store_;
  std::unique_ptr<comm::DeviceMesh> old_mesh_;
  std::unique_ptr<Checkpointing> checkpointing_;
  // Set by a heal this rank took part in, reported with the next step.
  std::optional<uint32_t> heal_crc_;

  // The model's state: kept across generations.
  std::unique_ptr<fsdp::Engine> engine_;
  std::unique_ptr<EngineShardContext> units_context_;
  // The task's Unit<> wrappers, pointed at units_context_ (declared after it:
  // cleared first).
  UnitBindings unit_bindings_;
  // CheckDeterministicBatch and CheckLossGraph ran (the first microbatch).
  bool task_checked_ = false;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  // The first step after a resumed checkpoint (0 when fresh).
  int64_t first_step_ = 0;

  // The last step report: sent again with `finished` at the end.
  hsdp::v1::StepReport last_report_;
  bool have_report_ = false;

  absl::Mutex mu_;
  // The mesh the watcher aborts when its generation ends.
  comm::DeviceMesh* abort_target_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t abort_generation_ ABSL_GUARDED_BY(mu_) = -1;
  // The newest generation the watcher saw end.
  int64_t ended_generation_ ABSL_GUARDED_BY(mu_) = -1;
};

void ShardedRun::OnGenerationEnd(int64_t generation, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  ended_generation_ = std::max(ended_generation_, generation);
  if (abort_target_ == nullptr || abort_generation_ != generation) return;
  LOG(INFO) << why.message() << "; aborting the communicators";
  if (absl::Status s = abort_target_->Abort(why.message()); !s.ok()) {
    LOG(WARNING) << "abort: " << s;
  }
}

void ShardedRun::PublishMesh() {
  absl::MutexLock lock(&mu_);
  abort_target_ = mesh_.get();
  abort_generation_ = generation_.generation();
  // The generation may have ended while the mesh was being built.
  if (ended_generation_ >= abort_generation_) {
    (void)abort_target_->Abort(absl::StrCat("generation ", abort_generation_,
                                            " ended while it was forming"));
  }
}

absl::Status ShardedRun::Start() {
  HSDP_RETURN_IF_ERROR(ValidateTrainingOptions(t_));
  fsdp::InstallCountingCpuAllocator();  // before any tensor of the model
  SetThreads(o_.process.threads);
  if (device_.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device ", o_.device,
        ": no CUDA device here, or LibTorch was built without CUDA"));
  }
  HSDP_RETURN_IF_ERROR(task_->Build(BuildContext{device_, t_.seed}));
  engine_options_ = EngineOptionsFor(t_, device_);
  HSDP_ASSIGN_OR_RETURN(units_, DescribeTaskUnits(*task_, engine_options_));
  {
    std::vector<std::string> names;
    for (size_t i = 1; i < units_.size(); ++i) names.push_back(units_[i].name);
    HSDP_RETURN_IF_ERROR(
        CheckUnitGlob("--recompute-units", t_.recompute_units, names));
  }

  agent::AgentOptions ao;
  ao.coordinator = o_.coordinator;
  ao.job_id = o_.job_id;
  ao.rank_hint = o_.rank_hint;
  ao.hostname = Hostname();
  ao.device = o_.device;
  ao.model = task_->Name();
  for (const fsdp::UnitInfo& u : units_) ao.units.push_back(fsdp::ToProto(u));
  spec_ = ToProto(t_, o_.task_args, task_->Name(), task_->Version());
  ao.training = spec_;
  ao.retry_budget = o_.coordinator_timeout;
  HSDP_RETURN_IF_ERROR(agent::LoadAgentSecurityFiles(
      {o_.job_token_file, o_.tls_ca, o_.tls_client_cert, o_.tls_client_key},
      &ao));
  agent_ = std::make_unique<agent::Agent>(ao);

  checkpointing_options_.root = o_.checkpoint_dir;
  checkpointing_options_.async = !o_.sync_checkpoint;
  checkpointing_options_.keep = o_.keep_checkpoints;
  checkpointing_options_.model_name = task_->Name();
  checkpointing_options_.model_version = std::to_string(task_->Version());
  checkpointing_options_.seed = t_.seed;
  checkpointing_options_.job = {
      {"steps", std::to_string(t_.steps)},
      {"microbatch_size", std::to_string(t_.microbatch_size)},
      {"optimizer", t_.optimizer.kind == OptimizerKind::kSgd ? "sgd" : "adamw"},
      {"lr", std::to_string(t_.optimizer.lr)},
      {"param_dtype", t_.param_dtype},
      {"device", o_.device}};
  HSDP_RETURN_IF_ERROR(report_file_.Open(o_.process.report_file));
  last_step_ = t_.steps - 1;
  return absl::OkStatus();
}

absl::Status ShardedRun::Run() {
  HSDP_RETURN_IF_ERROR(Start());
  HSDP_ASSIGN_OR_RETURN(hsdp::v1::JoinResponse join, agent_->Join());
  agent_->StartHeartbeat();
  agent_->StartGenerationWatch(
      [this](int64_t generation, const absl::Status& why) {
        OnGenerationEnd(generation, why);
      });

  std::optional<Generation> next;
  if (join.worker_state() == hsdp::v1::WORKER_STATE_ALIVE) {
    next = join.generation_info();
    if (next->worker_ids_size() == 0) {
      // A coordinator that describes no generation: the Join fields are it.
      next->set_generation(join.generation());
      *next->mutable_mesh() = join.mesh();
      next->set_rendezvous_prefix(join.rendezvous_prefix());
    }
  } else {
    LOG(INFO) << "worker " << agent_->worker_id()
              << " joined a running job; waiting for a generation";
    HSDP_ASSIGN_OR_RETURN(next, AwaitNext(-1));
  }
  while (next.has_value()) {
    HSDP_ASSIGN_OR_RETURN(const Next outcome, RunGeneration(*next));
    if (outcome == Next::kFinish) return Finish();
    Leave();
    HSDP_ASSIGN_OR_RETURN(next, AwaitNext(generation_.generation()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Generation>> ShardedRun::AwaitNext(int64_t known) {
  while (true) {
    absl::StatusOr<hsdp::v1::AwaitGenerationResponse> r =
        agent_->AwaitGeneration(known, kAwaitPoll);
    if (r.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
    if (r.status().code() == absl::StatusCode::kFailedPrecondition &&
        absl::StrContains(r.status().message(), "declared lost")) {
      // Its state is stale: join again as a new worker, to be healed.
      LOG(WARNING) << "worker " << agent_->worker_id() << ": "
                   << r.status().message() << "; joining again";
      HSDP_ASSIGN_OR_RETURN(hsdp::v1::JoinResponse join, agent_->Join());
      if (join.worker_state() == hsdp::v1::WORKER_STATE_ALIVE) {
        return std::optional<Generation>(join.generation_info());
      }
      known = -1;
      continue;
    }
    if (!r.ok()) return r.status();
    switch (r->outcome()) {
      case hsdp::v1::AWAIT_OUTCOME_FORMED:
        return std::optional<Generation>(r->generation());
      case hsdp::v1::AWAIT_OUTCOME_STANDBY:
        LOG(INFO) << "worker " << agent_->worker_id()
                  << " stands by in generation "
                  << r->generation().generation();
        // Nothing of the old mesh is needed while standing by.
        old_mesh_.reset();
        old_store_.reset();
        known = r->generation().generation();
        continue;
      case hsdp::v1::AWAIT_OUTCOME_EXIT:
        if (absl::StartsWith(r->message(), "the job failed")) {
          return absl::FailedPreconditionError(r->message());
        }
        LOG(INFO) << "worker " << agent_->worker_id()
                  << " stops: " << r->message();
        return std::optional<Generation>();
      default:  // ENDED: ask again
        continue;
    }
  }
}

absl::StatusOr<Next> ShardedRun::RunGeneration(const Generation& g) {
  generation_ = g;
  rank_ = agent_->rank();
  if (absl::Status s = Enter(g); !s.ok()) return OnFailure(s, -1);
  for (int64_t step = std::max(g.start_step(), first_step_); step <= last_step_;
       ++step) {
    absl::StatusOr<Next> next = Step(step);
    if (!next.ok()) return OnFailure(next.status(), step);
    if (*next != Next::kStep) return *next;
  }
  return Next::kFinish;
}

absl::Status ShardedRun::Enter(const Generation& g) {
  const comm::MeshShape shape{g.mesh().replicate(), g.mesh().shard()};
  const int role = rank_ < g.roles_size() ? g.roles(rank_) : 0;
  LOG(INFO) << "rank " << rank_ << " (worker " << agent_->worker_id()
            << ") enters generation " << g.generation() << ": mesh "
            << shape.replicate << "x" << shape.shard << ", from step "
            << std::max(g.start_step(), first_step_) << ", role "
            << RoleName(role);
  store_ =
      std::make_unique<agent::CoordinatorStore>(*agent_, g.rendezvous_prefix());
  absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> mesh =
      BuildWorkerMesh(o_, shape, rank_, *store_, device_);
  if (!mesh.ok()) return CollectiveFailure(mesh.status());
  mesh_ = *std::move(mesh);
  PublishMesh();
  // Says which transport each group ended up on ("shm+gloo:shard" or
  // "gloo:shard", ...).
  LOG(INFO) << "rank " << rank_ << " communicators: " << mesh_->shard().name()
            << ", " << mesh_->replicate().name();

  const fsdp::MeshComms comms{&mesh_->shard(), &mesh_->replicate()};
  if (engine_ == nullptr) {
    std::vector<std::shared_ptr<UnitBinding>> bindings;
    HSDP_ASSIGN_OR_RETURN(
        engine_, ShardTask(*task_, comms, engine_options_, units_, &bindings));
    units_context_ = std::make_unique<EngineShardContext>(
        *engine_, RecomputeFlags(t_.recompute_units, units_));
    unit_bindings_.Bind(std::move(bindings), units_context_.get());
    task_->Shard(*units_context_);
    opt_ = MakeOptimizer(*task_, t_, engine_->Parameters());
  } else {
    // Keeps the shards and the optimizer state; drops the interrupted step.
    HSDP_RETURN_IF_ERROR(engine_->Rebind(comms));
  }
  old_mesh_.reset();
  old_store_.reset();
  checkpointing_ =
      std::make_unique<Checkpointing>(checkpointing_options_, *mesh_, device_);

  if ((g.start_step() == 0 && EveryRoleTrains(g)) ||
      g.restore_from_checkpoint()) {
    // No step has committed, or no live worker held some shard's state: every
    // rank builds the state itself (the seeded init, or the newest
    // checkpoint), also a rank that did so in an earlier generation, so that
    // the ranks agree on it.
    absl::StatusOr<int64_t> start = checkpointing_->Resume(*engine_, *opt_);
    if (!start.ok()) {
      return IsCommunicationCode(start.status().code())
                 ? CollectiveFailure(start.status())
                 : start.status();
    }
    first_step_ = *start;
    if (g.restore_from_checkpoint() && first_step_ != g.start_step()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "generation ", g.generation(),
          " restarts from the checkpoint of "
          "step ",
          g.start_step() - 1, ", but the newest complete checkpoint in ",
          o_.checkpoint_dir.empty() ? "(no --checkpoint-dir)"
                                    : o_.checkpoint_dir,
          " leads to step ", first_step_));
    }
  }
  return Heal(g);
}

absl::Status ShardedRun::Heal(const Generation& g) {
  heal_crc_.reset();
  const int shards = g.mesh().shard();
  const int shard_index = rank_ % shards;
  for (const hsdp::v1::HealPlan& plan : g.heal_plans()) {
    if (plan.shard_index() != shard_index) continue;
    // Ranks of the replicate group are replica indices.
    comm::HealRoles roles;
    for (int r : plan.source_ranks()) roles.sources.push_back(r / shards);
    for (int r : plan.target_ranks()) roles.targets.push_back(r / shards);
    const auto start = std::chrono::steady_clock::now();
    absl::Status s =
        HealShardState(mesh_->replicate(), roles, engine_->Parameters(), *opt_);
    if (!s.ok()) return CollectiveFailure(s);
    heal_crc_ = ShardStateCrc32c(engine_->Parameters(), *opt_);
    LOG(INFO) << "rank " << rank_ << " healed shard " << shard_index
              << " (sources " << absl::StrJoin(plan.source_ranks(), ",")
              << ", targets " << absl::StrJoin(plan.target_ranks(), ",")
              << ") in " << SecondsSince(start) << " s; state crc32c "
              << std::hex << *heal_crc_ << std::dec;
  }
  return absl::OkStatus();
}

absl::StatusOr<Next> ShardedRun::Step(int64_t step) {
  agent_->SetCurrentStep(step);
  const int64_t fetch_begin = StepTrace::Now();
  HSDP_ASSIGN_OR_RETURN(hsdp::v1::GetScheduleResponse resp,
                        agent_->GetSchedule(step, last_step_));
  const int64_t fetch_end = StepTrace::Now();
  if (resp.drained()) {
    LOG(INFO) << "rank " << rank_ << " drained before step " << step;
    return Next::kFinish;
  }
  const hsdp::v1::StepSchedule& schedule = resp.schedule();
  StepTrace trace(*engine_, schedule.trace());
  trace.Add("schedule fetch", fetch_begin, fetch_end);
  // The step's share of the global batch (schedule.proto): slot
  // i = rank * M + m carries global microbatch F + i while i < U, padding
  // (weight 0) past it; a real microbatch's loss is divided by U / W.
  const int micro = std::max(1, schedule.microbatches_size());
  const int world = schedule.world_size() > 0
                        ? schedule.world_size()
                        : mesh_->shard().size() * mesh_->replicate().size();
  const int64_t global = schedule.global_microbatches() > 0
                             ? schedule.global_microbatches()
                             : static_cast<int64_t>(world) * micro;
  const int64_t first_microbatch = schedule.first_microbatch();
  const double scale = static_cast<double>(global) / world;
  const int64_t first_slot = static_cast<int64_t>(rank_) * micro;
  const int64_t real = std::clamp<int64_t>(global - first_slot, 0, micro);

  const auto t0 = std::chrono::steady_clock::now();
  ApplyLearningRate(*opt_, t_, step);
  engine_->ResetStats();
  // Summed on the device: one host sync per step, not per microbatch.
  at::Tensor loss_sum =
      at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  // Read only when the step's loss is not finite.
  std::vector<at::Tensor> microbatch_losses;
  try {
    for (int mb = 0; mb < micro; ++mb) {
      if (absl::Status s = engine_->Apply(schedule, mb); !s.ok()) {
        return engine_->status().ok() ? s : CollectiveFailure(s);
      }
      const bool padding = mb >= real;
      // Padding runs real data (slot 0's) at weight 0: the same collectives.
      const int64_t slot = padding ? 0 : first_slot + mb;
      BatchRequest request{step, slot * t_.microbatch_size, t_.microbatch_size,
                           t_.seed};
      HSDP_ASSIGN_OR_RETURN(Batch batch,
                            MicrobatchBatch(*task_, request, device_));
      // Once per process: the task's data and graph are what a run needs.
      const bool check_task = !task_checked_;
      if (check_task) {
        task_checked_ = true;
        HSDP_RETURN_IF_ERROR(CheckDeterministicBatch(*task_, request, batch));
      }
      absl::Status loss_status;
      at::Tensor loss = engine_->Root().Forward(
          std::vector<at::Tensor>{},
          [&](const std::vector<at::Tensor>&) -> std::vector<at::Tensor> {
            absl::StatusOr<at::Tensor> l = MicrobatchLoss(*task_, batch);
            if (l.ok() && check_task) {
              absl::Status graph = CheckLossGraph(*l, *task_->Model());
              if (!graph.ok()) l = graph;
            }
            if (!l.ok()) {
              loss_status = l.status();
              return {at::zeros({}, at::TensorOptions().device(device_))};
            }
            return {padding ? *l * 0.0 : *l / scale};
          })[0];
      HSDP_RETURN_IF_ERROR(loss_status);
      loss.backward();
      if (!engine_->status().ok()) return CollectiveFailure(engine_->status());
      if (!padding) {
        microbatch_losses.push_back(loss.detach().to(at::kDouble));
        loss_sum += microbatch_losses.back();
      }
    }
  } catch (const std::exception& e) {
    // A collective that failed under forward or backward surfaces as a
    // c10::Error; the engine keeps its status.
    if (!engine_->status().ok()) return CollectiveFailure(engine_->status());
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what =
        c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    if (IsFreedStorageError(what)) {
      return UnitUsedOutsideItsForward(step, *engine_, what);
    }
    if (absl::StartsWith(what, fsdp::kUsageErrorPrefix)) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, ": ", what));
    }
    return absl::InternalError(absl::StrCat("step ", step, ": ", what));
  }
  const fsdp::EngineStats stats = engine_->Stats();
  std::optional<double> grad_norm;
  if (t_.clip_grad_norm > 0) {
    absl::StatusOr<double> norm =
        fsdp::ClipGradNormGlobal(*engine_, t_.clip_grad_norm);
    if (!norm.ok()) return CollectiveFailure(norm.status());
    grad_norm = *norm;
  }
  absl::StatusOr<double> mean_loss =
      MeshAverage(*mesh_, loss_sum.item<double>(), device_);
  if (!mean_loss.ok()) return CollectiveFailure(mean_loss.status());
  const double loss = *mean_loss;
  // The mean and the norm are the same on every rank: every rank decides
  // alike, and a non-finite loss anywhere makes the mean non-finite.
  std::string nonfinite;
  if (!std::isfinite(loss) ||
      (grad_norm.has_value() && !std::isfinite(*grad_norm))) {
    absl::StatusOr<std::string> what =
        DescribeNonFinite(step, loss, grad_norm, microbatch_losses);
    if (!what.ok()) return CollectiveFailure(what.status());
    if (t_.on_nonfinite == NonFiniteAction::kStop) {
      return StopForNonFinite(step, *what);
    }
    nonfinite = WithNonFiniteAction(*what, t_.on_nonfinite);
    LOG(WARNING) << "rank " << rank_ << ": " << nonfinite;
  }

  // Every collective of the step is done: vote. Nothing changed the state
  // yet, so an aborted step only needs its gradients dropped.
  const int64_t vote_begin = StepTrace::Now();
  absl::StatusOr<hsdp::v1::CommitStepResponse> commit =
      agent_->CommitStep(step);
  if (!commit.ok()) {
    opt_->zero_grad();
    return commit.status();  // ABORTED re-forms; anything else stops
  }
  const int64_t vote_end = StepTrace::Now();
  trace.Add("commit vote", vote_begin, vote_end);
  const int64_t optimizer_begin = StepTrace::Now();
  if (nonfinite.empty()) opt_->step();
  opt_->zero_grad();
  trace.Add("optimizer", optimizer_begin, StepTrace::Now());
  const double step_seconds = SecondsSince(t0);

  // The step is committed: a checkpoint that fails for a lost peer re-forms
  // from the next step, after the step is reported.
  absl::Status checkpoint_status;
  bool saved = false;
  if (schedule.checkpoint() && o_.checkpoint_dir.empty()) {
    LOG_FIRST_N(WARNING, 1)
        << "step " << step
        << " asks for a checkpoint but --checkpoint-dir is not set";
  } else if (schedule.checkpoint()) {
    const int64_t checkpoint_begin = StepTrace::Now();
    checkpoint_status =
        checkpointing_->Save(step, *engine_, *opt_, schedule.policy_version(),
                             global * t_.microbatch_size);
    trace.Add("checkpoint", checkpoint_begin, StepTrace::Now());
    saved = checkpoint_status.ok();
    if (!saved && !IsCommunicationCode(checkpoint_status.code())) {
      return checkpoint_status;
    }
  }
  trace.Add("step", fetch_begin, StepTrace::Now());

  // Measured where the device allows (fsdp/memory_meter.h).
  const int64_t peak_bytes = fsdp::MeasuredPeakBytes(stats);
  const double tokens =
      static_cast<double>(real * t_.microbatch_size * task_->TokensPerSample());
  hsdp::v1::StepReport report;
  report.set_rank(rank_);
  report.set_step(step);
  report.set_loss(loss);
  report.set_step_seconds(step_seconds);
  report.set_tokens_per_second(tokens / step_seconds);
  report.set_peak_memory_bytes(peak_bytes);
  report.set_activation_bytes(stats.activation_bytes);
  report.set_checkpoint_saved(saved);
  for (size_t u = 0; u < stats.units.size(); ++u) {
    hsdp::v1::UnitCommTime* c = report.add_unit_comm();
    c->set_unit_index(static_cast<int>(u));
    c->set_all_gather_seconds(stats.units[u].all_gather_seconds);
    c->set_reduce_scatter_seconds(stats.units[u].reduce_scatter_seconds +
                                  stats.units[u].all_reduce_seconds);
  }
  trace.AttachTo(report, agent_->clock_offset());

  StepLine line;
  line.rank = rank_;
  line.step = step;
  line.loss = loss;
  line.step_seconds = step_seconds;
  line.tokens_per_second = tokens / step_seconds;
  line.learning_rate =
      t_.lr_schedule.LearningRate(t_.optimizer.lr, step, t_.steps);
  line.peak_memory_bytes = peak_bytes;
  line.activation_bytes = stats.activation_bytes;
  line.parameter_state_bytes = stats.peak_memory.shards +
                               stats.peak_memory.sharded_grads +
                               OptimizerStateBytes(*opt_);
  line.gathered_peak_bytes = stats.peak_unsharded_bytes;
  line.policy_version = schedule.policy_version();
  for (const auto& u : schedule.units())
    line.reshard_after_forward += u.reshard_after_forward() ? '1' : '0';
  line.microbatches = micro;
  line.all_gather_seconds = stats.all_gather_seconds;
  line.reduce_scatter_seconds =
      stats.reduce_scatter_seconds + stats.all_reduce_seconds;
  line.checkpoint = saved;
  line.world_size = world;
  line.generation = generation_.generation();
  line.first_microbatch = first_microbatch + first_slot;
  line.microbatch_count = real;
  line.first_sample = line.first_microbatch * t_.microbatch_size;
  line.sample_count = real * t_.microbatch_size;
  line.heal_crc32c = heal_crc_;
  line.commit_seconds = static_cast<double>(vote_end - vote_begin) * 1e-9;
  line.nonfinite = nonfinite;
  heal_crc_.reset();
  report_file_.SetSettings(
      RunSettings{world, micro, global * t_.microbatch_size, spec_});
  report_file_.Write(line);

  // The last step is reported as finished after the final collectives
  // (Finish): a finished job ends every generation watch.
  if (step < last_step_) {
    absl::Status s = agent_->ReportStep(report, /*finished=*/false);
    if (!s.ok()) return s;
  }
  report.clear_trace();
  last_report_ = report;
  have_report_ = true;
  if (!checkpoint_status.ok()) return CollectiveFailure(checkpoint_status);
  return commit->reform_after() ? Next::kReform : Next::kStep;
}

absl::StatusOr<std::string> ShardedRun::DescribeNonFinite(
    int64_t step, double loss, std::optional<double> norm,
    const std::vector<at::Tensor>& microbatch_losses) {
  if (std::isfinite(loss)) {
    return NonFiniteNormMessage(step, norm.value_or(0), t_.clip_grad_norm);
  }
  // Per rank: 1 + its first non-finite microbatch (0: none), how many, and
  // that microbatch's loss.
  std::vector<double> mine(3, 0.0);
  for (size_t mb = 0; mb < microbatch_losses.size(); ++mb) {
    const double value = microbatch_losses[mb].item<double>();
    if (std::isfinite(value)) continue;
    if (mine[0] == 0) {
      mine[0] = static_cast<double>(mb + 1);
      mine[2] = value;
    }
    mine[1] += 1;
  }
  HSDP_ASSIGN_OR_RETURN(const std::vector<double> all,
                        MeshGather(*mesh_, mine, device_));
  int64_t count = 0;
  int first_rank = -1;
  for (size_t r = 0; r * 3 < all.size(); ++r) {
    count += static_cast<int64_t>(all[r * 3 + 1]);
    if (first_rank < 0 && all[r * 3] > 0) first_rank = static_cast<int>(r);
  }
  if (first_rank < 0) {
    // Finite microbatch losses whose mean over the mesh overflowed.
    return absl::StrCat("step ", step, ": the mean loss over every rank is ",
                        loss, " (every microbatch's loss is finite)");
  }
  const size_t at = static_cast<size_t>(first_rank) * 3;
  return NonFiniteLossMessage(step, all[at + 2], first_rank,
                              static_cast<int>(all[at]) - 1, count);
}

absl::Status ShardedRun::StopForNonFinite(int64_t step,
                                          const std::string& message) {
  opt_->zero_grad();
  const std::string reason = WithNonFiniteAction(message, t_.on_nonfinite);
  LOG(ERROR) << "rank " << rank_ << ": " << reason;
  // Every rank reports: the first report fails the job, the others find it
  // failed.
  absl::StatusOr<bool> failed = agent_->FailJob(step, reason);
  if (!failed.ok()) {
    LOG(WARNING) << "rank " << rank_
                 << ": could not fail the job at the coordinator: "
                 << failed.status();
  }
  return absl::InternalError(reason);
}

absl::StatusOr<Next> ShardedRun::OnFailure(const absl::Status& s,
                                           int64_t step) {
  if (!IsCollectiveFailure(s) && s.code() != absl::StatusCode::kAborted) {
    return s;
  }
  bool ended;
  {
    absl::MutexLock lock(&mu_);
    ended = ended_generation_ >= generation_.generation();
  }
  if (!ended && s.code() != absl::StatusCode::kAborted) {
    // Ends the generation at once, without waiting for a heartbeat timeout.
    LOG(WARNING) << "rank " << rank_ << ": step " << step
                 << " failed in generation " << generation_.generation() << ": "
                 << s.message() << "; reporting it";
    absl::StatusOr<bool> reported =
        agent_->ReportFailure(step, std::string(s.message()));
    if (!reported.ok()) {
      LOG(WARNING) << "rank " << rank_
                   << ": ReportFailure: " << reported.status();
    }
  } else {
    LOG(INFO) << "rank " << rank_ << " leaves generation "
              << generation_.generation() << " at step " << step << ": "
              << s.message();
  }
  return Next::kReform;
}

void ShardedRun::Leave() {
  {
    absl::MutexLock lock(&mu_);
    abort_target_ = nullptr;
  }
  if (mesh_ != nullptr) {
    // Idempotent; once it returned OK no collective touches the buffers.
    absl::Status s = mesh_->Abort(
        absl::StrCat("generation ", generation_.generation(), " ended"));
    if (!s.ok()) LOG(WARNING) << "rank " << rank_ << ": abort: " << s;
  }
  if (opt_ != nullptr) opt_->zero_grad();
  // A checkpoint still publishing waits no longer for writers that may be
  // gone: that step stays unpublished.
  checkpointing_.reset();
  old_mesh_ = std::move(mesh_);
  old_store_ = std::move(store_);
}

absl::Status ShardedRun::Finish() {
  if (checkpointing_ != nullptr) HSDP_RETURN_IF_ERROR(checkpointing_->Finish());
  if (!o_.process.final_params.empty() && engine_ != nullptr) {
    HSDP_ASSIGN_OR_RETURN(auto full, fsdp::FullStateDict(*engine_));
    if (rank_ == 0) {
      HSDP_RETURN_IF_ERROR(
          SaveParams(std::vector<std::pair<std::string, at::Tensor>>(
                         full.begin(), full.end()),
                     o_.process.final_params));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    abort_target_ = nullptr;
  }
  if (!have_report_ && first_step_ > 0) {
    // Resumed after the last step: nothing trained, the job is done.
    last_report_.set_rank(rank_);
    last_report_.set_step(first_step_ - 1);
    have_report_ = true;
  }
  if (have_report_) {
    HSDP_RETURN_IF_ERROR(agent_->ReportStep(last_report_, /*finished=*/true));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TrainSharded(std::unique_ptr<Task> task,
                          const WorkerOptions& options) {
  ShardedRun run(std::move(task), options);
  return run.Run();
}

}  // namespace hsdp::train
