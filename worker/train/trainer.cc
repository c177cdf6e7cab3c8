#include "worker/train/trainer.h"

#include <dlfcn.h>
#include <glog/logging.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/utils.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_util.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/agent/agent.h"
#include "worker/agent/coordinator_store.h"
#include "worker/comm/device_mesh.h"
#if defined(HSDP_WITH_NCCL)
#include "worker/comm/nccl_communicator.h"
#endif
#include "worker/fsdp/fully_shard.h"
#include "worker/models/data.h"
#include "worker/models/gpt.h"

namespace hsdp::train {
namespace {

namespace fs = std::filesystem;
using models::Gpt;
using models::GptConfig;
using models::TextDataset;
using models::TokenBatch;

constexpr char kStepDirPrefix[] = "step-";
// AdamW keeps two moments per parameter element next to the parameter itself.
constexpr int64_t kAdamStateCopies = 2;

// --- small helpers
// -----------------------------------------------------------------------------

// Reads a "VmHWM:  1234 kB" style line of /proc/self/status; 0 when
// unavailable.
int64_t ProcStatusBytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, field)) {
      std::istringstream fields(line.substr(std::strlen(field)));
      int64_t kb = 0;
      fields >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

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

// The model, its data and its unit list, built the same way by worker and
// reference.
struct ModelSetup {
  GptConfig config;
  Gpt model{nullptr};
  std::unique_ptr<TextDataset> data;
};

// OpenBLAS (the pthread build Debian's libtorch uses for CPU matmuls) keeps its
// own thread pool, one thread per core by default, which at::set_num_threads
// does not touch: with several single-threaded workers on one machine the extra
// BLAS threads contend for the cores and yield-spin while idle. Looked up at
// run time so other BLAS builds (no such symbol) are left alone. OpenBLAS
// splits a GEMM across threads by output rows and columns only, so every
// element sums in the same order and the results are bitwise the same.
void SetBlasThreads(int threads) {
  using SetNumThreadsFn = void (*)(int);
  if (auto* set_num_threads = reinterpret_cast<SetNumThreadsFn>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_num_threads(threads);
  }
}

// Threads, model and data from the options shared by the worker and the
// reference.
absl::StatusOr<ModelSetup> BuildModel(const TrainingOptions& run) {
  if (run.threads > 0) {
    at::set_num_threads(run.threads);
    SetBlasThreads(run.threads);
  }
  ModelSetup setup;
  HSDP_ASSIGN_OR_RETURN(setup.config,
                        models::ResolveGptConfig(run.model, run.dims));
  HSDP_ASSIGN_OR_RETURN(TextDataset data, TextDataset::Open(run.data));
  if (data.size() <= static_cast<size_t>(setup.config.seq_len) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data '", data.source(), "' is shorter than ",
                     "the model's seq_len ", setup.config.seq_len));
  }
  setup.data = std::make_unique<TextDataset>(std::move(data));
  setup.model = Gpt(setup.config, run.seed);
  return setup;
}

std::vector<hsdp::v1::UnitInfo> UnitInfos(const Gpt& model) {
  std::vector<hsdp::v1::UnitInfo> units;
  const std::vector<std::string> names = model->UnitNames();
  for (int i = 0; i < static_cast<int>(names.size()); ++i) {
    hsdp::v1::UnitInfo info;
    info.set_name(names[i]);
    int64_t count = 0, bytes = 0;
    for (const at::Tensor& p : model->UnitParameters(i)) {
      count += p.numel();
      bytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
    info.set_param_count(count);
    info.set_param_bytes(bytes);
    units.push_back(std::move(info));
  }
  return units;
}

// --- report file
// ---------------------------------------------------------------------------------

// JSON lines, one object per step; the loss also as a C99 hex float so tests
// compare bits.
class ReportFile {
 public:
  absl::Status Open(const std::string& path) {
    if (path.empty()) return absl::OkStatus();
    out_.open(path, std::ios::app);
    if (!out_)
      return absl::NotFoundError(
          absl::StrCat("cannot open report file '", path, "'"));
    return absl::OkStatus();
  }
  void Write(const std::string& json_object) {
    if (!out_.is_open()) return;
    out_ << json_object << "\n";
    out_.flush();  // the launcher and tests tail this file while the worker
                   // runs
  }

 private:
  std::ofstream out_;
};

std::string LossFields(double loss) {
  return absl::StrFormat("\"loss\":%.9g,\"loss_hex\":\"%a\"", loss, loss);
}

// --- full parameter dump (parity checks)
// ---------------------------------------------------------

absl::Status SaveParams(const std::map<std::string, at::Tensor>& params,
                        const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : params) archive.write(name, t.detach().cpu());
  archive.save_to(path);
  return absl::OkStatus();
}

std::map<std::string, at::Tensor> ModelParams(const Gpt& model) {
  std::map<std::string, at::Tensor> params;
  for (const auto& item : model->named_parameters())
    params[item.key()] = item.value();
  return params;
}

// --- checkpoints
// ---------------------------------------------------------------------------------

std::string StepDir(const std::string& root, int64_t step) {
  return absl::StrFormat("%s/%s%08d", root, kStepDirPrefix, step);
}

std::string RankFile(const std::string& root, int64_t step, int rank,
                     int world) {
  return absl::StrFormat("%s/rank-%d-of-%d.pt", StepDir(root, step), rank,
                         world);
}

// Newest step under `root` for which every rank of `world` wrote its
// (atomically renamed) file; -1 when none. Every rank scans the same directory
// and so agrees on the step.
int64_t LatestCompleteCheckpoint(const std::string& root, int world) {
  std::error_code ec;
  if (root.empty() || !fs::is_directory(root, ec)) return -1;
  int64_t best = -1;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step;
    if (!absl::StartsWith(name, kStepDirPrefix) ||
        !absl::SimpleAtoi(name.substr(std::strlen(kStepDirPrefix)), &step) ||
        step <= best) {
      continue;
    }
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      complete = fs::exists(RankFile(root, step, r, world), ec);
    }
    if (complete) best = step;
  }
  return best;
}

absl::Status SaveCheckpoint(const std::string& root, int64_t step, int rank,
                            int world, const std::vector<at::Tensor>& shards,
                            torch::optim::AdamW& opt) {
  std::error_code ec;
  fs::create_directories(StepDir(root, step), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create checkpoint dir ", StepDir(root, step), ": ",
                     ec.message()));
  }
  torch::serialize::OutputArchive archive;
  archive.write("step", c10::IValue(step));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(world)));
  for (size_t i = 0; i < shards.size(); ++i) {
    archive.write(absl::StrCat("shard.", i), shards[i].detach());
  }
  torch::serialize::OutputArchive optim;
  opt.save(optim);
  archive.write("optimizer", optim);
  const std::string final_path = RankFile(root, step, rank, world);
  const std::string tmp_path = final_path + ".tmp";
  archive.save_to(tmp_path);
  // Rename is atomic: a file with the final name is always complete.
  fs::rename(tmp_path, final_path, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("rename ", tmp_path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::Status LoadCheckpoint(const std::string& root, int64_t step, int rank,
                            int world, const std::vector<at::Tensor>& shards,
                            torch::optim::AdamW& opt) {
  const std::string path = RankFile(root, step, rank, world);
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  c10::IValue saved_world;
  archive.read("world_size", saved_world);
  if (saved_world.toInt() != world) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path, " is for world size ",
                     saved_world.toInt(), ", this job has ", world));
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < shards.size(); ++i) {
    at::Tensor saved;
    archive.read(absl::StrCat("shard.", i), saved);
    if (!saved.sizes().equals(shards[i].sizes())) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", path, " shard ", i, " has shape ",
                       c10::str(saved.sizes()), ", the model's is ",
                       c10::str(shards[i].sizes())));
    }
    // Copy into the engine's shard tensors (never replace them: the engine
    // keeps views).
    shards[i].copy_(saved);
  }
  torch::serialize::InputArchive optim;
  archive.read("optimizer", optim);
  opt.load(optim);
  return absl::OkStatus();
}

// --- the sharded worker
// -------------------------------------------------------------------------

// Averages a scalar over the whole mesh (shard group, then replicate group) so
// every rank reports the global mean loss.
// The value lives on the compute device: NCCL only reduces device memory.
absl::StatusOr<double> MeshAverage(comm::DeviceMesh& mesh, double value,
                                   const c10::Device& device) {
  at::Tensor v = at::full(
      {1}, value, at::TensorOptions().dtype(at::kDouble).device(device));
  comm::Buffer buf{v.data_ptr(), 1, comm::DataType::kFloat64};
  HSDP_RETURN_IF_ERROR(
      mesh.shard().AllReduce(buf, comm::ReduceOp::kAvg)->Wait());
  HSDP_RETURN_IF_ERROR(
      mesh.replicate().AllReduce(buf, comm::ReduceOp::kAvg)->Wait());
  return v.item<double>();  // on CUDA this synchronises with the collective's
                            // stream order
}

// Gloo over TCP for CPU ranks; NCCL (when built in) for CUDA ranks. Both
// bootstrap through the coordinator's store.
absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> BuildMesh(
    const WorkerOptions& o, const comm::MeshShape& shape, int rank,
    comm::Store& store, const c10::Device& device) {
  if (device.is_cuda()) {
#if defined(HSDP_WITH_NCCL)
    comm::NcclOptions nccl;
    nccl.device = device.has_index() ? device.index() : 0;
    nccl.collective_timeout = o.collective_timeout;
    return comm::DeviceMesh::Create(shape, rank, "nccl",
                                    comm::NcclCommunicatorFactory(store, nccl));
#else
    return absl::FailedPreconditionError(
        absl::StrCat("--device ", o.device,
                     " needs NCCL, and this hsdp-worker was built without it"));
#endif
  }
  comm::GlooDeviceOptions dev;
  dev.hostname = o.gloo_hostname;
  dev.iface = o.gloo_iface;
  HSDP_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> gloo_device,
                        comm::CreateGlooDevice(dev));
  return comm::DeviceMesh::Create(
      shape, rank, "gloo",
      comm::GlooCommunicatorFactory(
          store, std::move(gloo_device), o.collective_timeout, o.shared_memory,
          [rank](const comm::GroupSpec& group, const std::string& why) {
            LOG(INFO) << "rank " << rank << ": the " << group.kind
                      << " group stays on Gloo TCP (no shared memory: " << why
                      << ")";
          }));
}

// The checkpoint step to resume from, or -1. Prefers the coordinator's record
// of the latest step every rank saved (works with per-rank volumes) when this
// rank has that file; otherwise the newest step whose files for all ranks are
// in `dir` (a shared directory). Every rank must pick the same step: checked
// with two mesh averages (mean and mean square agree only when all values are
// equal), so a partial checkpoint ends in an error instead of diverging ranks.
absl::StatusOr<int64_t> ResumeStep(const std::string& dir,
                                   int64_t coordinator_step, int rank,
                                   int world, comm::DeviceMesh& mesh,
                                   const c10::Device& device) {
  std::error_code ec;
  int64_t step = -1;
  if (coordinator_step >= 0 &&
      fs::exists(RankFile(dir, coordinator_step, rank, world), ec)) {
    step = coordinator_step;
  } else {
    step = LatestCompleteCheckpoint(dir, world);
  }
  const double x = static_cast<double>(step);
  HSDP_ASSIGN_OR_RETURN(const double mean, MeshAverage(mesh, x, device));
  HSDP_ASSIGN_OR_RETURN(const double mean_square,
                        MeshAverage(mesh, x * x, device));
  if (mean_square - mean * mean != 0.0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ranks disagree on the checkpoint to resume from (rank ", rank,
        " found step ", step, " in ", dir, ", the mean over ranks is ", mean,
        "); is --checkpoint-dir complete?"));
  }
  return step;
}

absl::Status TrainSharded(const WorkerOptions& o) {
  const TrainingOptions& run = o.training;
  HSDP_ASSIGN_OR_RETURN(ModelSetup setup, BuildModel(run));
  Gpt& model = setup.model;
  const c10::Device device(o.device);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device ", o.device,
        ": no CUDA device here, or LibTorch was built without CUDA"));
  }

  agent::AgentOptions ao;
  ao.coordinator = o.coordinator;
  ao.job_id = o.job_id;
  ao.rank_hint = o.rank_hint;
  ao.hostname = Hostname();
  ao.device = o.device;
  ao.model = setup.config.name;
  ao.units = UnitInfos(model);
  ao.retry_budget = o.coordinator_timeout;
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
                        BuildMesh(o, shape, rank, store, device));
  // Says which transport each group ended up on ("shm+gloo:shard" or
  // "gloo:shard", ...).
  LOG(INFO) << "rank " << rank << " communicators: " << mesh->shard().name()
            << ", " << mesh->replicate().name();

  model->to(device);
  fsdp::EngineOptions eo;
  eo.device = device;
  HSDP_ASSIGN_OR_RETURN(
      std::unique_ptr<fsdp::Engine> engine,
      fsdp::Engine::Create(model.ptr(), {&mesh->shard(), &mesh->replicate()},
                           eo));
  for (int i = 0; i < model->num_blocks(); ++i) {
    HSDP_RETURN_IF_ERROR(
        engine->FullyShard({model->block(i).ptr()}, models::UnitName(i + 1))
            .status());
  }
  HSDP_RETURN_IF_ERROR(engine->FullyShardRoot());
  model->set_block_runner([&engine, &model](int i, const at::Tensor& x) {
    return engine->Unit(i + 1).Forward(x, [&model, i](const at::Tensor& in) {
      return model->block(i)->forward(in);
    });
  });
  // The runner captures the engine: drop it before the engine goes away on any
  // return path.
  struct RunnerReset {
    Gpt& m;
    ~RunnerReset() { m->set_block_runner(nullptr); }
  } runner_reset{model};

  const std::vector<at::Tensor> shards = engine->Parameters();
  torch::optim::AdamW opt(shards, torch::optim::AdamWOptions(run.lr));

  int64_t start = 0;
  if (!o.checkpoint_dir.empty()) {
    HSDP_ASSIGN_OR_RETURN(
        const int64_t ckpt,
        ResumeStep(o.checkpoint_dir, join.last_checkpoint_step(), rank, world,
                   *mesh, device));
    if (ckpt >= 0) {
      HSDP_RETURN_IF_ERROR(
          LoadCheckpoint(o.checkpoint_dir, ckpt, rank, world, shards, opt));
      start = ckpt + 1;
      LOG(INFO) << "rank " << rank << " resumed from checkpoint step " << ckpt;
    }
  }

  ReportFile report_file;
  HSDP_RETURN_IF_ERROR(report_file.Open(run.report_file));
  const int64_t last_step = run.steps - 1;
  const int64_t seq = setup.config.seq_len;
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
    HSDP_ASSIGN_OR_RETURN(hsdp::v1::GetScheduleResponse resp,
                          agent.GetSchedule(step, last_step));
    if (resp.drained()) {
      LOG(INFO) << "rank " << rank << " drained before step " << step;
      break;
    }
    const hsdp::v1::StepSchedule& schedule = resp.schedule();
    const int micro = std::max(1, schedule.microbatches_size());

    const auto t0 = std::chrono::steady_clock::now();
    engine->ResetStats();
    // Summed on the device: one host sync per step, not per microbatch.
    at::Tensor loss_sum =
        at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
    for (int mb = 0; mb < micro; ++mb) {
      HSDP_RETURN_IF_ERROR(engine->Apply(schedule, mb));
      TokenBatch batch = setup.data->RankMicrobatch(
          run.seed, step, rank, micro, mb, run.microbatch_size, seq);
      at::Tensor tokens = batch.tokens.to(device),
                 targets = batch.targets.to(device);
      at::Tensor loss =
          engine->Root().Forward(tokens, [&](const at::Tensor& t) {
            return model->Loss(t, targets) / static_cast<double>(micro);
          });
      loss.backward();
      HSDP_RETURN_IF_ERROR(engine->status());
      loss_sum += loss.detach();
    }
    const fsdp::EngineStats stats = engine->Stats();
    opt.step();
    opt.zero_grad();
    HSDP_ASSIGN_OR_RETURN(const double loss,
                          MeshAverage(*mesh, loss_sum.item<double>(), device));
    const double step_seconds = SecondsSince(t0);

    bool saved = false;
    if (schedule.checkpoint() && o.checkpoint_dir.empty()) {
      LOG_FIRST_N(WARNING, 1)
          << "step " << step
          << " asks for a checkpoint but --checkpoint-dir is not set";
    } else if (schedule.checkpoint()) {
      HSDP_RETURN_IF_ERROR(
          SaveCheckpoint(o.checkpoint_dir, step, rank, world, shards, opt));
      saved = true;
    }

    // Parameter-state memory of this rank at its peak in the step: fp32 shards,
    // AdamW moments, gradients, and the largest set of unsharded parameters
    // alive at once.
    const int64_t peak_bytes = stats.sharded_bytes * (1 + kAdamStateCopies) +
                               stats.grad_bytes + stats.peak_unsharded_bytes;
    const double tokens =
        static_cast<double>(micro * run.microbatch_size * seq);
    hsdp::v1::StepReport report;
    report.set_rank(rank);
    report.set_step(step);
    report.set_loss(loss);
    report.set_step_seconds(step_seconds);
    report.set_tokens_per_second(tokens / step_seconds);
    report.set_peak_memory_bytes(peak_bytes);
    report.set_checkpoint_saved(saved);
    for (size_t u = 0; u < stats.units.size(); ++u) {
      hsdp::v1::UnitCommTime* c = report.add_unit_comm();
      c->set_unit_index(static_cast<int>(u));
      c->set_all_gather_seconds(stats.units[u].all_gather_seconds);
      c->set_reduce_scatter_seconds(stats.units[u].reduce_scatter_seconds +
                                    stats.units[u].all_reduce_seconds);
    }
    HSDP_RETURN_IF_ERROR(agent.ReportStep(report, step == last_step));
    finished_sent = step == last_step;
    last_report = report;

    std::string raf;
    for (const auto& u : schedule.units())
      raf += u.reshard_after_forward() ? '1' : '0';
    report_file.Write(absl::StrFormat(
        "{\"rank\":%d,\"step\":%d,%s,\"step_seconds\":%.6f,\"tokens_per_"
        "second\":%.1f,"
        "\"peak_memory_bytes\":%d,\"rss_bytes\":%d,\"rss_peak_bytes\":%d,"
        "\"policy_version\":%d,\"reshard_after_forward\":\"%s\","
        "\"microbatches\":%d,"
        "\"all_gather_seconds\":%.6f,\"reduce_scatter_seconds\":%.6f,"
        "\"checkpoint\":%s,"
        "\"world_size\":%d}",
        rank, step, LossFields(loss), step_seconds, tokens / step_seconds,
        peak_bytes, ProcStatusBytes("VmRSS:"), ProcStatusBytes("VmHWM:"),
        schedule.policy_version(), raf, micro, stats.all_gather_seconds,
        stats.reduce_scatter_seconds + stats.all_reduce_seconds,
        saved ? "true" : "false", world));
  }
  if (!finished_sent && last_report.step() >= 0) {
    HSDP_RETURN_IF_ERROR(agent.ReportStep(last_report, /*finished=*/true));
  }

  if (!run.final_params.empty()) {
    HSDP_ASSIGN_OR_RETURN(auto full, fsdp::FullStateDict(*engine));
    if (rank == 0) HSDP_RETURN_IF_ERROR(SaveParams(full, run.final_params));
  }
  return absl::OkStatus();
}

absl::Status TrainReference(const ReferenceOptions& o) {
  const TrainingOptions& run = o.training;
  HSDP_ASSIGN_OR_RETURN(ModelSetup setup, BuildModel(run));
  Gpt& model = setup.model;
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(run.lr));
  ReportFile report_file;
  HSDP_RETURN_IF_ERROR(report_file.Open(run.report_file));
  const int micro = std::max(1, o.microbatches);
  const double parts = static_cast<double>(o.world_size) * micro;
  for (int64_t step = 0; step < run.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    for (int r = 0; r < o.world_size; ++r) {
      for (int mb = 0; mb < micro; ++mb) {
        TokenBatch batch = setup.data->RankMicrobatch(run.seed, step, r, micro,
                                                      mb, run.microbatch_size,
                                                      setup.config.seq_len);
        at::Tensor l = model->Loss(batch.tokens, batch.targets) / parts;
        l.backward();
        loss += l.item<double>();
      }
    }
    opt.step();
    opt.zero_grad();
    report_file.Write(
        absl::StrFormat("{\"rank\":-1,\"step\":%d,%s,\"step_seconds\":%.6f}",
                        step, LossFields(loss), SecondsSince(t0)));
  }
  if (!run.final_params.empty())
    HSDP_RETURN_IF_ERROR(SaveParams(ModelParams(model), run.final_params));
  return absl::OkStatus();
}

}  // namespace

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  if (!google::IsGoogleLoggingInitialized()) google::InitGoogleLogging(argv0);
}

absl::Status RunWorker(const WorkerOptions& options) {
  return Guard("worker", [&] { return TrainSharded(options); });
}

absl::Status RunReference(const ReferenceOptions& options) {
  return Guard("reference", [&] { return TrainReference(options); });
}

}  // namespace hsdp::train
