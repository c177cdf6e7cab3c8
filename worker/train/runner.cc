#include "worker/train/runner.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <glog/logging.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/agent/agent.h"
#include "worker/agent/coordinator_store.h"
#include "worker/fsdp/fully_shard.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/train/checkpointing.h"
#include "worker/train/optimizer.h"
#include "worker/train/report_file.h"
#include "worker/train/shard_context.h"
#include "worker/train/step_trace.h"
#include "worker/train/task_sharding.h"
#include "worker/train/training_options.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::train {
namespace {

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// Runs `fn`, turning any exception (c10::Error from LibTorch, gloo::Exception,
// std::exception) into a one-line status: nothing crosses the worker boundary
// as an exception.
template <typename Fn>
absl::Status Guard(const std::string& what, Fn fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// OpenBLAS (the pthread build Debian's libtorch uses for CPU matmuls) keeps its
// own thread pool, one thread per core by default, which at::set_num_threads
// does not touch: with several single-threaded workers on one machine the extra
// BLAS threads contend for the cores and yield-spin while idle. Looked up at
// run time so other BLAS builds (no such symbol) are left alone. OpenBLAS
// splits a GEMM across threads by output rows and columns only, so every
// element sums in the same order and the results are bitwise the same.
void SetThreads(int threads) {
  if (threads <= 0) return;
  at::set_num_threads(threads);
  using SetNumThreadsFn = void (*)(int);
  if (auto* set_num_threads = reinterpret_cast<SetNumThreadsFn>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_num_threads(threads);
  }
}

c10::ScalarType DtypeFromName(const std::string& name) {
  return name == "bf16" ? at::kBFloat16 : at::kFloat;
}

fsdp::EngineOptions EngineOptionsFor(const TrainingOptions& t,
                                     const c10::Device& device) {
  fsdp::EngineOptions eo;
  eo.device = device;
  if (t.param_dtype == "bf16") {
    eo.mixed_precision.param_dtype = at::kBFloat16;
    eo.mixed_precision.reduce_dtype =
        t.reduce_dtype.empty() ? at::kFloat : DtypeFromName(t.reduce_dtype);
  } else if (!t.reduce_dtype.empty()) {
    eo.mixed_precision.reduce_dtype = DtypeFromName(t.reduce_dtype);
  }
  eo.offload.offload_params = t.cpu_offload;
  return eo;
}

// Per task unit: recompute on, from the --recompute-units glob.
std::vector<bool> RecomputeFlags(const std::string& glob,
                                 const std::vector<fsdp::UnitInfo>& units) {
  std::vector<bool> flags;
  for (size_t i = 1; i < units.size(); ++i)
    flags.push_back(!glob.empty() && GlobMatch(glob, units[i].name));
  return flags;
}

// The task's optimizer, else the job's.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Task& task, const TrainingOptions& t,
    const std::vector<at::Tensor>& params) {
  std::unique_ptr<torch::optim::Optimizer> opt = task.MakeOptimizer(params);
  if (opt == nullptr) opt = MakeJobOptimizer(t.optimizer, params);
  return opt;
}

// Loss() of one microbatch, checked: a scalar that requires grad.
absl::StatusOr<at::Tensor> MicrobatchLoss(Task& task, const Batch& batch) {
  HSDP_ASSIGN_OR_RETURN(at::Tensor loss, task.Loss(batch));
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::Loss returned ",
        loss.defined()
            ? absl::StrCat(
                  "a tensor of shape ", c10::str(loss.sizes()),
                  loss.requires_grad() ? "" : " that does not require grad")
            : std::string("an undefined tensor"),
        "; it must return the microbatch's mean loss, a scalar that requires "
        "grad"));
  }
  return loss.reshape({});
}

absl::StatusOr<Batch> MicrobatchBatch(Task& task, const BatchRequest& request,
                                      const c10::Device& device) {
  HSDP_ASSIGN_OR_RETURN(Batch batch, task.GetBatch(request));
  if (!batch.input.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::GetBatch(step ", request.step, ", samples ", request.first, "..",
        request.first + request.count, ") returned no input"));
  }
  batch.input = batch.input.to(device);
  if (batch.target.defined()) batch.target = batch.target.to(device);
  return batch;
}

// Clips the gradients of `params` (unsharded) as fsdp::ClipGradNormGlobal
// clips shards: the global norm in double precision, one coefficient.
void ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm) {
  constexpr double kClipEpsilon = 1e-6;
  at::NoGradGuard no_grad;
  double sum_sq = 0;
  for (const at::Tensor& p : params) {
    if (p.grad().defined())
      sum_sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double coef = max_norm / (std::sqrt(sum_sq) + kClipEpsilon);
  if (coef >= 1.0) return;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
}

absl::Status SaveParams(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : params) archive.write(name, t.detach().cpu());
  archive.save_to(path);
  return absl::OkStatus();
}

// ---- the sharded worker -----------------------------------------------------

absl::Status TrainSharded(std::unique_ptr<Task> task, const WorkerOptions& o) {
  const TrainingOptions& t = o.training;
  HSDP_RETURN_IF_ERROR(ValidateTrainingOptions(t));
  fsdp::InstallCountingCpuAllocator();  // before any tensor of the model
  SetThreads(o.process.threads);
  const c10::Device device(o.device);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device ", o.device,
        ": no CUDA device here, or LibTorch was built without CUDA"));
  }
  HSDP_RETURN_IF_ERROR(task->Build(BuildContext{device, t.seed}));
  const fsdp::EngineOptions engine_options = EngineOptionsFor(t, device);
  HSDP_ASSIGN_OR_RETURN(const std::vector<fsdp::UnitInfo> units,
                        DescribeTaskUnits(*task, engine_options));

  agent::AgentOptions ao;
  ao.coordinator = o.coordinator;
  ao.job_id = o.job_id;
  ao.rank_hint = o.rank_hint;
  ao.hostname = Hostname();
  ao.device = o.device;
  ao.model = task->Name();
  for (const fsdp::UnitInfo& u : units) ao.units.push_back(fsdp::ToProto(u));
  ao.training = ToProto(t, o.task_args, task->Name(), task->Version());
  ao.retry_budget = o.coordinator_timeout;
  HSDP_RETURN_IF_ERROR(agent::LoadAgentSecurityFiles(
      {o.job_token_file, o.tls_ca, o.tls_client_cert, o.tls_client_key}, &ao));
  agent::Agent agent(ao);
  HSDP_ASSIGN_OR_RETURN(hsdp::v1::JoinResponse join, agent.Join());
  const int rank = join.rank();
  const int world = join.world_size();
  comm::MeshShape shape{join.mesh().replicate(), join.mesh().shard()};
  if (shape.world_size() != world) {
    return absl::FailedPreconditionError(
        absl::StrCat("coordinator mesh ", shape.replicate, "x", shape.shard,
                     " does not match world size ", world));
  }
  agent.StartHeartbeat();

  agent::CoordinatorStore store(agent, join.rendezvous_prefix());
  HSDP_ASSIGN_OR_RETURN(std::unique_ptr<comm::DeviceMesh> mesh,
                        BuildWorkerMesh(o, shape, rank, store, device));
  // Says which transport each group ended up on ("shm+gloo:shard" or
  // "gloo:shard", ...).
  LOG(INFO) << "rank " << rank << " communicators: " << mesh->shard().name()
            << ", " << mesh->replicate().name();

  HSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Engine> engine,
                        ShardTask(*task, {&mesh->shard(), &mesh->replicate()},
                                  engine_options, units));
  EngineShardContext units_context(*engine,
                                   RecomputeFlags(t.recompute_units, units));
  task->Shard(units_context);

  const std::vector<at::Tensor> shards = engine->Parameters();
  std::unique_ptr<torch::optim::Optimizer> opt =
      MakeOptimizer(*task, t, shards);

  CheckpointingOptions co;
  co.root = o.checkpoint_dir;
  co.async = !o.sync_checkpoint;
  co.keep = o.keep_checkpoints;
  co.model_name = task->Name();
  co.model_version = std::to_string(task->Version());
  co.seed = t.seed;
  co.job = {
      {"steps", std::to_string(t.steps)},
      {"microbatch_size", std::to_string(t.microbatch_size)},
      {"optimizer", t.optimizer.kind == OptimizerKind::kSgd ? "sgd" : "adamw"},
      {"lr", std::to_string(t.optimizer.lr)},
      {"param_dtype", t.param_dtype},
      {"device", o.device}};
  Checkpointing checkpointing(co, *mesh, device);
  HSDP_ASSIGN_OR_RETURN(const int64_t start,
                        checkpointing.Resume(*engine, *task->Model(), *opt));

  ReportFile report_file;
  HSDP_RETURN_IF_ERROR(report_file.Open(o.process.report_file));
  const int64_t last_step = t.steps - 1;
  // The last report sent; re-sent with `finished` when the run ends without
  // reaching last_step through a normal report (a drain, or nothing left to do
  // after a resume).
  hsdp::v1::StepReport last_report;
  last_report.set_rank(rank);
  last_report.set_step(start - 1);
  bool finished_sent = false;
  for (int64_t step = start; step <= last_step; ++step) {
    agent.SetCurrentStep(step);
    HSDP_RETURN_IF_ERROR(agent.membership_status());
    const int64_t fetch_begin = StepTrace::Now();
    HSDP_ASSIGN_OR_RETURN(hsdp::v1::GetScheduleResponse resp,
                          agent.GetSchedule(step, last_step));
    const int64_t fetch_end = StepTrace::Now();
    if (resp.drained()) {
      LOG(INFO) << "rank " << rank << " drained before step " << step;
      break;
    }
    const hsdp::v1::StepSchedule& schedule = resp.schedule();
    StepTrace trace(*engine, schedule.trace());
    trace.Add("schedule fetch", fetch_begin, fetch_end);
    const int micro = std::max(1, schedule.microbatches_size());
    const int64_t first_sample =
        static_cast<int64_t>(rank) * micro * t.microbatch_size;

    const auto t0 = std::chrono::steady_clock::now();
    ApplyLearningRate(*opt, t, step);
    engine->ResetStats();
    // Summed on the device: one host sync per step, not per microbatch.
    at::Tensor loss_sum =
        at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
    for (int mb = 0; mb < micro; ++mb) {
      HSDP_RETURN_IF_ERROR(engine->Apply(schedule, mb));
      BatchRequest request{step, first_sample + mb * t.microbatch_size,
                           t.microbatch_size, t.seed};
      HSDP_ASSIGN_OR_RETURN(Batch batch,
                            MicrobatchBatch(*task, request, device));
      absl::Status loss_status;
      at::Tensor loss = engine->Root().Forward(
          std::vector<at::Tensor>{},
          [&](const std::vector<at::Tensor>&) -> std::vector<at::Tensor> {
            absl::StatusOr<at::Tensor> l = MicrobatchLoss(*task, batch);
            if (!l.ok()) {
              loss_status = l.status();
              return {at::zeros({}, at::TensorOptions().device(device))};
            }
            return {*l / static_cast<double>(micro)};
          })[0];
      HSDP_RETURN_IF_ERROR(loss_status);
      loss.backward();
      HSDP_RETURN_IF_ERROR(engine->status());
      loss_sum += loss.detach().to(at::kDouble);
    }
    const fsdp::EngineStats stats = engine->Stats();
    const int64_t optimizer_begin = StepTrace::Now();
    if (t.clip_grad_norm > 0) {
      HSDP_RETURN_IF_ERROR(
          fsdp::ClipGradNormGlobal(*engine, t.clip_grad_norm).status());
    }
    opt->step();
    opt->zero_grad();
    trace.Add("optimizer", optimizer_begin, StepTrace::Now());
    HSDP_ASSIGN_OR_RETURN(const double loss,
                          MeshAverage(*mesh, loss_sum.item<double>(), device));
    const double step_seconds = SecondsSince(t0);

    bool saved = false;
    if (schedule.checkpoint() && o.checkpoint_dir.empty()) {
      LOG_FIRST_N(WARNING, 1)
          << "step " << step
          << " asks for a checkpoint but --checkpoint-dir is not set";
    } else if (schedule.checkpoint()) {
      const int64_t checkpoint_begin = StepTrace::Now();
      HSDP_RETURN_IF_ERROR(checkpointing.Save(
          step, *engine, *task->Model(), *opt, schedule.policy_version(),
          static_cast<int64_t>(world) * micro * t.microbatch_size));
      trace.Add("checkpoint", checkpoint_begin, StepTrace::Now());
      saved = true;
    }
    trace.Add("step", fetch_begin, StepTrace::Now());

    // Measured where the device allows (fsdp/memory_meter.h).
    const int64_t peak_bytes = fsdp::MeasuredPeakBytes(stats);
    const double tokens = static_cast<double>(micro * t.microbatch_size *
                                              task->TokensPerSample());
    hsdp::v1::StepReport report;
    report.set_rank(rank);
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
    trace.AttachTo(report, agent.clock_offset());
    HSDP_RETURN_IF_ERROR(agent.ReportStep(report, step == last_step));
    report.clear_trace();
    finished_sent = step == last_step;
    last_report = report;

    StepLine line;
    line.rank = rank;
    line.step = step;
    line.loss = loss;
    line.step_seconds = step_seconds;
    line.tokens_per_second = tokens / step_seconds;
    line.learning_rate =
        t.lr_schedule.LearningRate(t.optimizer.lr, step, t.steps);
    line.peak_memory_bytes = peak_bytes;
    line.activation_bytes = stats.activation_bytes;
    line.policy_version = schedule.policy_version();
    for (const auto& u : schedule.units())
      line.reshard_after_forward += u.reshard_after_forward() ? '1' : '0';
    line.microbatches = micro;
    line.all_gather_seconds = stats.all_gather_seconds;
    line.reduce_scatter_seconds =
        stats.reduce_scatter_seconds + stats.all_reduce_seconds;
    line.checkpoint = saved;
    line.world_size = world;
    line.first_sample = first_sample;
    line.sample_count = micro * t.microbatch_size;
    report_file.Write(line);
  }
  HSDP_RETURN_IF_ERROR(checkpointing.Finish());
  if (!finished_sent && last_report.step() >= 0) {
    HSDP_RETURN_IF_ERROR(agent.ReportStep(last_report, /*finished=*/true));
  }

  if (!o.process.final_params.empty()) {
    HSDP_ASSIGN_OR_RETURN(auto full, fsdp::FullStateDict(*engine));
    if (rank == 0) {
      HSDP_RETURN_IF_ERROR(
          SaveParams(std::vector<std::pair<std::string, at::Tensor>>(
                         full.begin(), full.end()),
                     o.process.final_params));
    }
  }
  return absl::OkStatus();
}

// ---- the single-process reference ------------------------------------------

absl::Status TrainReference(std::unique_ptr<Task> task,
                            const ReferenceOptions& o) {
  const TrainingOptions& t = o.training;
  HSDP_RETURN_IF_ERROR(ValidateTrainingOptions(t));
  SetThreads(o.process.threads);
  const c10::Device device(c10::kCPU);
  HSDP_RETURN_IF_ERROR(task->Build(BuildContext{device, t.seed}));
  HSDP_RETURN_IF_ERROR(BuildAllUnits(*task, device));
  DirectShardContext units_context(task->NumUnits());
  task->Shard(units_context);
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : UniqueNamedParameters(*task->Model()))
    params.push_back(p);
  std::unique_ptr<torch::optim::Optimizer> opt =
      MakeOptimizer(*task, t, params);
  ReportFile report_file;
  HSDP_RETURN_IF_ERROR(report_file.Open(o.process.report_file));
  const int micro = std::max(1, o.microbatches);
  const double parts = static_cast<double>(o.world_size) * micro;
  for (int64_t step = 0; step < t.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    ApplyLearningRate(*opt, t, step);
    double loss = 0;
    for (int64_t i = 0; i < o.world_size * micro; ++i) {
      BatchRequest request{step, i * t.microbatch_size, t.microbatch_size,
                           t.seed};
      HSDP_ASSIGN_OR_RETURN(Batch batch,
                            MicrobatchBatch(*task, request, device));
      HSDP_ASSIGN_OR_RETURN(at::Tensor l, MicrobatchLoss(*task, batch));
      l = l / parts;
      l.backward();
      loss += l.item<double>();
    }
    if (t.clip_grad_norm > 0) ClipGradNorm(params, t.clip_grad_norm);
    opt->step();
    opt->zero_grad();
    report_file.WriteReference(step, loss, SecondsSince(t0));
  }
  if (!o.process.final_params.empty()) {
    HSDP_RETURN_IF_ERROR(SaveParams(UniqueNamedParameters(*task->Model()),
                                    o.process.final_params));
  }
  return absl::OkStatus();
}

}  // namespace

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  if (!google::IsGoogleLoggingInitialized()) google::InitGoogleLogging(argv0);
}

absl::Status RunTask(std::unique_ptr<Task> task, const WorkerOptions& options) {
  if (task == nullptr) return absl::InvalidArgumentError("RunTask: null task");
  return Guard("worker",
               [&] { return TrainSharded(std::move(task), options); });
}

absl::Status RunReference(std::unique_ptr<Task> task,
                          const ReferenceOptions& options) {
  if (task == nullptr) {
    return absl::InvalidArgumentError("RunReference: null task");
  }
  return Guard("reference",
               [&] { return TrainReference(std::move(task), options); });
}

}  // namespace hsdp::train
