#include "worker/train/elastic_loop.h"

#include <glog/logging.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_util.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/train/elastic_loop_internal.h"
#include "worker/train/run_setup.h"
#include "worker/train/shard_state.h"
#include "worker/train/task_checks.h"
#include "worker/train/task_units.h"
#include "worker/train/training_options.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::train {
namespace internal {
namespace {

using hsdp::v1::Generation;

// The payload CollectiveFailure sets.
constexpr absl::string_view kCollectiveFailureUrl =
    "type.hsdp.dev/collective-failure";

// One AwaitGeneration call's bound; the call is repeated while nothing
// changes (the job may be waiting for workers).
constexpr absl::Duration kAwaitPoll = absl::Seconds(60);

// The host this worker reports (and finds its host group by): --host-id, or
// the machine's hostname.
std::string HostId(const WorkerOptions& o) {
  if (!o.host_id.empty()) return o.host_id;
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

}  // namespace

absl::Status CollectiveFailure(absl::Status s) {
  if (!s.ok()) s.SetPayload(kCollectiveFailureUrl, absl::Cord("1"));
  return s;
}

bool IsCollectiveFailure(const absl::Status& s) {
  return s.GetPayload(kCollectiveFailureUrl).has_value();
}

bool IsCommunicationCode(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted ||
         code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kDeadlineExceeded;
}

ElasticLoop::ElasticLoop(std::unique_ptr<Task> task,
                         const WorkerOptions& options)
    : task_(std::move(task)),
      o_(options),
      t_(options.training),
      device_(options.device) {}

ElasticLoop::~ElasticLoop() {
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

void ElasticLoop::OnGenerationEnd(int64_t generation, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  ended_generation_ = std::max(ended_generation_, generation);
  if (abort_target_ == nullptr || abort_generation_ != generation) return;
  LOG(INFO) << why.message() << "; aborting the communicators";
  if (absl::Status s = abort_target_->Abort(why.message()); !s.ok()) {
    LOG(WARNING) << "abort: " << s;
  }
}

void ElasticLoop::PublishMesh() {
  absl::MutexLock lock(&mu_);
  abort_target_ = mesh_.get();
  abort_generation_ = generation_.generation();
  // The generation may have ended while the mesh was being built.
  if (ended_generation_ >= abort_generation_) {
    (void)abort_target_->Abort(absl::StrCat("generation ", abort_generation_,
                                            " ended while it was forming"));
  }
}

absl::Status ElasticLoop::Start() {
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
  ao.relay = o_.relay;
  ao.job_id = o_.job_id;
  ao.rank_hint = o_.rank_hint;
  ao.hostname = HostId(o_);
  ao.device = o_.device;
  ao.model = task_->Name();
  for (const fsdp::UnitLayout& u : units_) ao.units.push_back(fsdp::ToProto(u));
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

absl::Status ElasticLoop::Run() {
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

absl::StatusOr<std::optional<Generation>> ElasticLoop::AwaitNext(
    int64_t known) {
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

absl::StatusOr<Next> ElasticLoop::RunGeneration(const Generation& g) {
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

absl::Status ElasticLoop::Enter(const Generation& g) {
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
      BuildWorkerMesh(o_, shape, rank_, *store_, device_, HostId(o_));
  if (!mesh.ok()) return CollectiveFailure(mesh.status());
  mesh_ = *std::move(mesh);
  PublishMesh();
  // Says which transport each group ended up on ("shm+gloo:shard" or
  // "gloo:shard", ...).
  LOG(INFO) << "rank " << rank_ << " communicators: " << mesh_->shard().name()
            << ", " << mesh_->replicate().name()
            << (mesh_->host() != nullptr
                    ? absl::StrCat(", ", mesh_->host()->name(), " (",
                                   mesh_->host()->size(), " ranks)")
                    : std::string());

  const fsdp::MeshComms comms{&mesh_->shard(), &mesh_->replicate(),
                              mesh_->host()};
  if (engine_ == nullptr) {
    std::vector<std::shared_ptr<UnitBinding>> bindings;
    HSDP_ASSIGN_OR_RETURN(
        engine_, ShardTask(*task_, comms, engine_options_, units_, &bindings));
    units_context_ = std::make_unique<EngineShardContext>(
        *engine_, RecomputeFlags(t_.recompute_units, units_));
    unit_bindings_.Bind(std::move(bindings), units_context_.get());
    task_->SetShardContext(*units_context_);
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

absl::Status ElasticLoop::Heal(const Generation& g) {
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

absl::StatusOr<Next> ElasticLoop::OnFailure(const absl::Status& s,
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

void ElasticLoop::Leave() {
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

absl::Status ElasticLoop::Finish() {
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

}  // namespace internal

absl::Status TrainSharded(std::unique_ptr<Task> task,
                          const WorkerOptions& options) {
  internal::ElasticLoop loop(std::move(task), options);
  return loop.Run();
}

}  // namespace hsdp::train
