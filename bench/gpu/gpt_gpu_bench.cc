// GPU benchmark driver, C++ side: trains a GPT (default gpt-1b) for a few steps
// with either
//   --impl engine  our FSDP engine over a 1x1 NCCL mesh (Gloo on --device cpu),
//   bf16 params,
//                  fp32 reduce, fp32 sharded master weights, AdamW — FSDP2's
//                  configuration;
//   --impl plain   plain unsharded LibTorch with the same numerics: an fp32
//   master model stepped
//                  by AdamW and a bf16 compute copy refreshed after each step
//                  (no engine at all).
// and prints one JSON line: median step time, peak allocator memory and
// achieved TFLOP/s, counted like bench/gpu/fsdp2_gpt_bench.py. tests/gpu/run.sh
// runs both plus the FSDP2 script and prints ratios (bench/gpu/compare.py).
// Each impl runs in its own process so peaks don't mix.
//
// Builds against CPU LibTorch too (CUDA-only calls are behind HSDP_WITH_CUDA);
// on CPU it is a smoke test with a tiny model, e.g. `gpt_gpu_bench --device cpu
// --model gpt-tiny --steps 2`.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/comm/store/in_memory_store.h"
#include "worker/models/gpt_setup.h"
#ifdef HSDP_WITH_NCCL
#include "worker/comm/nccl/nccl_communicator.h"
#endif
#ifdef HSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace hsdp::bench {
namespace {

constexpr int kUsageError = 2;
constexpr int64_t kSeed = 1234;
// Index of the aggregate pool in the allocator's per-pool stat arrays
// (StatType::AGGREGATE in every LibTorch version; the enum itself moved
// namespaces in 2.x, the index did not).
[[maybe_unused]] constexpr size_t kAggregatePool = 0;
constexpr absl::Duration kCollectiveTimeout = absl::Minutes(5);

struct Options {
  std::string impl = "engine";
  std::string device = "cuda:0";
  std::string model = "gpt-1b";
  std::string dims;
  int batch = 8;
  int steps = 10;
  int warmup = 3;
  double lr = 1e-4;
  // Compute dtype of the unsharded parameters (fp32: no mixed precision).
  std::string param_dtype = "bf16";
  std::string json_out;
};

// Peak allocator bytes since Reset(); -1 where not measurable (CPU).
class MemoryMeter {
 public:
  explicit MemoryMeter(c10::Device device) : device_(device) {}
  void Reset() {
#ifdef HSDP_WITH_CUDA
    if (device_.is_cuda())
      c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
#endif
  }
  int64_t PeakAllocated() const { return Peak(/*reserved=*/false); }
  int64_t PeakReserved() const { return Peak(/*reserved=*/true); }

 private:
  int64_t Peak([[maybe_unused]] bool reserved) const {
#ifdef HSDP_WITH_CUDA
    if (device_.is_cuda()) {
      const auto stats =
          c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      return (reserved ? stats.reserved_bytes
                       : stats.allocated_bytes)[kAggregatePool]
          .peak;
    }
#endif
    return -1;
  }

  c10::Device device_;
};

void Synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Same formula as model_flops_per_step() in fsdp2_gpt_bench.py: 6 * matmul
// params * tokens plus the attention matmuls (QK^T, AV), forward + backward.
double ModelFlopsPerStep(const models::GptConfig& c, int batch) {
  const double tokens = static_cast<double>(batch) * c.seq_len;
  const double d = static_cast<double>(c.d_model);
  const double matmul_params =
      c.n_layers * (12.0 * d * d) + static_cast<double>(c.vocab_size) * d;
  return 6.0 * matmul_params * tokens +
         12.0 * c.n_layers * c.seq_len * d * tokens;
}

struct StepTimes {
  std::vector<double> seconds;
  std::vector<double> losses;
};

// Runs warmup + measured steps of `step` (returns the loss); resets the memory
// peak after warmup.
absl::StatusOr<StepTimes> TimeSteps(
    const Options& o, const c10::Device& device, MemoryMeter& meter,
    const std::function<absl::StatusOr<double>()>& step) {
  StepTimes out;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    if (i == o.warmup) {
      Synchronize(device);
      meter.Reset();
    }
    Synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<double> loss = step();
    if (!loss.ok()) return loss.status();
    Synchronize(device);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (i >= o.warmup) out.seconds.push_back(s);
    out.losses.push_back(*loss);
  }
  return out;
}

hsdp::v1::StepSchedule FsdpDefaultSchedule(int num_units) {
  // FSDP2's defaults: blocks reshard after forward, the root does not (FSDP2
  // keeps the root's parameters for backward); one unit of forward and backward
  // prefetch.
  hsdp::v1::StepSchedule schedule;
  for (int i = 0; i < num_units; ++i) {
    hsdp::v1::UnitSchedule* u = schedule.add_units();
    u->set_unit_index(i);
    u->set_unit_name(models::UnitName(i));
    u->set_reshard_after_forward(i != 0);
    u->set_reshard_after_backward(true);
    if (i + 1 < num_units) u->add_forward_prefetch(i + 1);
    const int back =
        i == 0 ? num_units - 1 : i - 1;  // backward: head, then blocks reversed
    if (back >= 1) u->add_backward_prefetch(back);
  }
  hsdp::v1::MicrobatchSchedule* mb = schedule.add_microbatches();
  mb->set_requires_grad_sync(true);
  mb->set_requires_all_reduce(true);
  mb->set_is_last_backward(true);
  return schedule;
}

absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> MakeMesh(
    const c10::Device& device, comm::Store& store) {
  const comm::MeshShape shape{1, 1};
  if (device.is_cuda()) {
#ifdef HSDP_WITH_NCCL
    comm::NcclOptions options;
    options.device = device.index();
    options.name = "nccl";
    options.collective_timeout = kCollectiveTimeout;
#ifdef HSDP_WITH_CUDA
    // The engine's compute stream is whatever LibTorch considers current on the
    // issuing thread (autograd's device thread in backward).
    options.compute_stream = [] {
      return c10::cuda::getCurrentCUDAStream().stream();
    };
#endif
    return comm::DeviceMesh::Create(
        shape, 0, "bench", comm::NcclCommunicatorFactory(store, options));
#else
    return absl::FailedPreconditionError("built without NCCL (HSDP_WITH_NCCL)");
#endif
  }
  comm::GlooDeviceOptions gloo;
  gloo.hostname = "127.0.0.1";
  return comm::DeviceMesh::CreateGloo(shape, 0, store, "bench", gloo,
                                      kCollectiveTimeout);
}

absl::StatusOr<StepTimes> RunEngine(const Options& o,
                                    const models::GptConfig& config,
                                    const c10::Device& device,
                                    const at::Tensor& tokens,
                                    const at::Tensor& targets,
                                    MemoryMeter& meter) {
  comm::InMemoryStore store;
  absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> mesh =
      MakeMesh(device, store);
  if (!mesh.ok()) return mesh.status();
  models::Gpt model(config, kSeed);
  fsdp::EngineOptions eo;
  eo.device = device;
  if (o.param_dtype == "bf16") {
    eo.mixed_precision.param_dtype = at::kBFloat16;
    eo.mixed_precision.reduce_dtype = at::kFloat;
  }
  absl::StatusOr<std::unique_ptr<fsdp::Engine>> engine = models::ShardGpt(
      model, fsdp::MeshComms{&(*mesh)->shard(), &(*mesh)->replicate()}, eo);
  if (!engine.ok()) return engine.status();
  fsdp::Engine& e = **engine;
  torch::optim::AdamW opt(e.Parameters(), torch::optim::AdamWOptions(o.lr));
  const hsdp::v1::StepSchedule schedule = FsdpDefaultSchedule(e.num_units());
  absl::StatusOr<StepTimes> times =
      TimeSteps(o, device, meter, [&]() -> absl::StatusOr<double> {
        if (absl::Status s = e.Apply(schedule, 0); !s.ok()) return s;
        // Root unit around the whole forward; the loss outside (as the engine's
        // tests do).
        at::Tensor logits = e.Root().Forward(
            tokens, [&](const at::Tensor& t) { return model->forward(t); });
        at::Tensor loss = torch::nn::functional::cross_entropy(
            logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
        loss.backward();
        if (absl::Status s = e.status(); !s.ok()) return s;
        opt.step();
        opt.zero_grad();
        return loss.item<double>();
      });
  model->set_block_runner(nullptr);
  return times;
}

absl::StatusOr<StepTimes> RunPlain(const Options& o,
                                   const models::GptConfig& config,
                                   const c10::Device& device,
                                   const at::Tensor& tokens,
                                   const at::Tensor& targets,
                                   MemoryMeter& meter) {
  models::Gpt master(config, kSeed);
  master->to(device);
  models::Gpt compute(config, kSeed);
  compute->to(device, o.param_dtype == "bf16" ? at::kBFloat16 : at::kFloat);
  std::vector<at::Tensor> master_params = master->parameters();
  std::vector<at::Tensor> compute_params = compute->parameters();
  torch::optim::AdamW opt(master_params, torch::optim::AdamWOptions(o.lr));
  return TimeSteps(o, device, meter, [&]() -> absl::StatusOr<double> {
    at::Tensor loss = compute->Loss(tokens, targets);
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < master_params.size(); ++i) {
        at::Tensor& g = compute_params[i].mutable_grad();
        master_params[i].mutable_grad() =
            g.to(at::kFloat);  // fp32 "reduce" dtype
        g.reset();
      }
    }
    opt.step();
    opt.zero_grad();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < master_params.size(); ++i)
        compute_params[i].copy_(master_params[i]);
    }
    return loss.item<double>();
  });
}

int Run(const Options& o) {
  absl::StatusOr<models::GptConfig> config =
      models::ResolveGptConfig(o.model, o.dims);
  if (!config.ok()) {
    std::cerr << "gpt_gpu_bench: " << config.status().message() << "\n";
    return kUsageError;
  }
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(o.device);
  } catch (const c10::Error& e) {
    std::cerr << "gpt_gpu_bench: bad --device '" << o.device << "'\n";
    return kUsageError;
  }
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::cerr << "gpt_gpu_bench: --device " << o.device
              << " but this LibTorch has no usable CUDA device (CUDA build: "
#ifdef HSDP_WITH_CUDA
              << "yes"
#else
              << "no; rebuild with HSDP_WITH_CUDA"
#endif
              << ")\n";
    return 1;
  }
  if (device.is_cuda() && !device.has_index()) device.set_index(0);

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor tokens = at::randint(0, config->vocab_size,
                                  {o.batch, config->seq_len}, gen, at::kLong)
                          .to(device);
  at::Tensor targets = at::roll(tokens, {-1}, {1});
  MemoryMeter meter(device);

  absl::StatusOr<StepTimes> times;
  try {
    times = o.impl == "engine"
                ? RunEngine(o, *config, device, tokens, targets, meter)
                : RunPlain(o, *config, device, tokens, targets, meter);
  } catch (const c10::Error& e) {
    times = absl::InternalError(e.what_without_backtrace());
  }
  if (!times.ok()) {
    std::cerr << "gpt_gpu_bench: " << o.impl << ": " << times.status() << "\n";
    return 1;
  }
  std::vector<double> sorted = times->seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  const double flops = ModelFlopsPerStep(*config, o.batch);
  const std::string line = absl::StrFormat(
      "{\"impl\": \"%s\", \"model\": \"%s\", \"params\": %d, \"world_size\": "
      "1, "
      "\"batch\": %d, \"seq_len\": %d, \"param_dtype\": \"%s\", \"steps\": %d, "
      "\"step_s_median\": %.6f, \"step_s_min\": %.6f, "
      "\"peak_allocated_bytes\": %d, "
      "\"peak_reserved_bytes\": %d, \"flops_per_step\": %.9e, \"tflops\": "
      "%.3f, "
      "\"loss_first\": %.6f, "
      "\"loss_last\": %.6f, \"torch\": \"%s\", \"device\": \"%s\"}",
      o.impl, o.dims.empty() ? o.model : o.dims, models::GptParamCount(*config),
      o.batch, config->seq_len, o.param_dtype, o.steps, median, sorted.front(),
      meter.PeakAllocated(), meter.PeakReserved(), flops, flops / median / 1e12,
      times->losses.front(), times->losses.back(), TORCH_VERSION, device.str());
  std::cout << line << std::endl;
  if (!o.json_out.empty()) std::ofstream(o.json_out) << line << "\n";
  return 0;
}

}  // namespace
}  // namespace hsdp::bench

int main(int argc, char** argv) {
  hsdp::bench::Options o;
  CLI::App app{
      "GPT training step benchmark: hsdp engine or plain LibTorch (see file "
      "comment)"};
  app.add_option("--impl", o.impl, "engine | plain")
      ->check(CLI::IsMember({"engine", "plain"}));
  app.add_option("--device", o.device, "cuda:N or cpu")->envname("HSDP_DEVICE");
  app.add_option("--model", o.model,
                 "gpt-tiny | gpt-small | gpt-medium | gpt-1b")
      ->envname("HSDP_MODEL");
  app.add_option("--dims", o.dims,
                 "d_model,n_layers,n_heads,seq_len (overrides the model's)");
  app.add_option("--batch", o.batch, "sequences per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "measured steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "unmeasured steps first")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr", o.lr, "AdamW learning rate");
  app.add_option("--param-dtype", o.param_dtype,
                 "bf16 (fp32 reduce + master) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--json-out", o.json_out, "also write the JSON line here");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "gpt_gpu_bench: " << e.what() << "\n";
    return hsdp::bench::kUsageError;
  }
  return hsdp::bench::Run(o);
}
