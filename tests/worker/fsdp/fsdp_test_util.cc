#include "tests/worker/fsdp/fsdp_test_util.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "coordinator/planner.h"
#include "worker/comm/store/in_memory_store.h"
#include "worker/fsdp/planner_units.h"

namespace hsdp::fsdp::testing {

BlockImpl::BlockImpl(const ModelDims& dims) : heads_(dims.heads) {
  const int64_t d = dims.d_model;
  ln1_ = register_module(
      "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  // No qkv bias: the key bias has a mathematically zero gradient (softmax
  // ignores a constant shift), and AdamW turns its rounding noise into
  // full-size steps, hiding real differences.
  qkv_ = register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d).bias(false)));
  proj_ = register_module("proj", torch::nn::Linear(d, d));
  ln2_ = register_module(
      "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  fc1_ = register_module("fc1", torch::nn::Linear(d, dims.hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(dims.hidden, d));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2), dh = d / heads_;
  std::vector<at::Tensor> qkv = qkv_(ln1_(x)).chunk(3, -1);
  auto split = [&](const at::Tensor& z) {
    return z.reshape({b, t, heads_, dh}).transpose(1, 2);
  };
  at::Tensor q = split(qkv[0]), k = split(qkv[1]), v = split(qkv[2]);
  at::Tensor att =
      q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
  at::Tensor mask = torch::ones({t, t}, torch::kBool).triu(1);
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity())
            .softmax(-1);
  at::Tensor y = att.matmul(v).transpose(1, 2).reshape({b, t, d});
  at::Tensor h = x + proj_(y);
  return h + fc2_(torch::gelu(fc1_(ln2_(h))));
}

TinyTransformerImpl::TinyTransformerImpl(const ModelDims& d) : dims(d) {
  embed_ = register_module("embed", torch::nn::Embedding(d.vocab, d.d_model));
  pos_ = register_parameter("pos", torch::randn({d.seq_len, d.d_model}) * 0.02);
  // Parameter names follow the GPT's "layers.<i>.…", which the policy globs
  // match.
  torch::nn::ModuleList layers;
  for (int64_t i = 0; i < d.layers; ++i) {
    blocks.push_back(Block(d));
    layers->push_back(blocks.back());
  }
  register_module("layers", layers);
  mix_ = register_parameter("mix", torch::ones({3}));
  ln_f_ = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d.d_model})));
  head_ = register_module("head", torch::nn::Linear(d.d_model, d.vocab));
}

at::Tensor TinyTransformerImpl::Embed(const at::Tensor& tokens) {
  return embed_(tokens) + pos_.narrow(0, 0, tokens.size(1));
}

at::Tensor TinyTransformerImpl::Head(const at::Tensor& h) {
  return head_(ln_f_(h)) * mix_.mean();
}

at::Tensor TinyTransformerImpl::forward(const at::Tensor& tokens) {
  at::Tensor h = Embed(tokens);
  for (Block& block : blocks) h = block->forward(h);
  return Head(h);
}

StateDict MakeInitialState(const ModelDims& dims, uint64_t seed) {
  torch::manual_seed(seed);
  TinyTransformer model(dims);
  StateDict state;
  for (const auto& item : model->named_parameters()) {
    at::Tensor v = item.value().detach().clone();
    // Perturb the ones-initialised parameters so every parameter matters in the
    // checks.
    if (item.key() == "mix" || item.key().find("ln") != std::string::npos) {
      v += torch::randn(v.sizes()) * 0.1;
    }
    state[item.key()] = v;
  }
  return state;
}

TinyTransformer MakeModel(const ModelDims& dims, const StateDict& init) {
  TinyTransformer model(dims);
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters())
    item.value().copy_(init.at(item.key()));
  return model;
}

hsdp::v1::Policy PolicyFor(const RunConfig& config) {
  hsdp::v1::Policy policy;
  policy.set_reshard_after_forward(config.reshard_after_forward);
  policy.set_reshard_after_backward(config.reshard_after_backward);
  policy.set_forward_prefetch_depth(config.prefetch);
  policy.set_backward_prefetch_depth(config.prefetch);
  policy.set_microbatches(config.microbatches);
  policy.set_grad_sync(config.sync_every_microbatch
                           ? hsdp::v1::GRAD_SYNC_MODE_EVERY_MICROBATCH
                           : hsdp::v1::GRAD_SYNC_MODE_LAST_MICROBATCH);
  policy.set_all_reduce(config.all_reduce_every_microbatch
                            ? hsdp::v1::ALL_REDUCE_MODE_EVERY_MICROBATCH
                            : hsdp::v1::ALL_REDUCE_MODE_LAST_MICROBATCH);
  policy.set_comm_fusion_bucket_bytes(config.comm_fusion_bucket_bytes);
  policy.set_reshard_after_forward_within_host(config.within_host_group > 0);
  return policy;
}

namespace {

// A RunConfig has no memory budget: manual mode, whose schedule does not
// depend on the mesh the planner's memory model is told about.
hsdp::v1::StepSchedule Plan(UnitList units, const RunConfig& config) {
  coordinator::Planner planner(std::move(units), /*shard_size=*/1);
  planner.SetHostGroupSize(config.within_host_group);
  return planner.Plan(PolicyFor(config), coordinator::PlanInput());
}

}  // namespace

hsdp::v1::StepSchedule PlanSchedule(const Engine& engine,
                                    const RunConfig& config) {
  return Plan(PlannerUnits(engine), config);
}

hsdp::v1::StepSchedule MakeSchedule(int num_units, const RunConfig& config) {
  UnitList units;
  for (int i = 0; i < num_units; ++i) {
    hsdp::v1::UnitInfo unit;
    unit.set_name(i == 0 ? "root" : absl::StrCat("layers.", i - 1));
    units.push_back(unit);
  }
  return Plan(std::move(units), config);
}

UnitList TestModelUnits(const RunConfig& config) {
  const StateDict init = MakeInitialState(config.dims, 0);
  UnitList units;
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    units = PlannerUnits(*MakeEngine(model, ctx.comms(), config));
  });
  return units;
}

EngineOptions EngineOptionsFor(const RunConfig& config) {
  EngineOptions options;
  options.mixed_precision = config.mixed_precision;
  options.offload.offload_params = config.offload;
  options.reshard_after_forward = config.reshard_after_forward;
  options.gradient_reduction = config.gradient_reduction;
  return options;
}

std::unique_ptr<Engine> MakeEngine(TinyTransformer& model, MeshComms comms,
                                   const RunConfig& config) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(model.ptr(), comms, EngineOptionsFor(config));
  EXPECT_TRUE(engine.ok()) << engine.status();
  for (size_t i = 0; i < model->blocks.size(); ++i) {
    absl::StatusOr<int> index = (*engine)->FullyShard(
        {model->blocks[i].ptr()}, absl::StrCat("layers.", i));
    EXPECT_TRUE(index.ok()) << index.status();
    EXPECT_EQ(*index, static_cast<int>(i) + 1);
  }
  absl::Status s = (*engine)->FullyShardRoot();
  EXPECT_TRUE(s.ok()) << s;
  return std::move(*engine);
}

at::Tensor EngineForward(Engine& engine, TinyTransformer& model,
                         const at::Tensor& tokens, bool checkpoint,
                         CollectiveLog* log) {
  // Compute events of `unit` around `fn` (no-ops without a log): forward
  // begin/end now, backward begin/end when autograd gets there.
  auto marked = [log](int unit, const at::Tensor& x, auto&& fn) {
    if (log == nullptr) return fn(x);
    log->RecordCompute(EventKind::kComputeBegin, unit, Phase::kForward);
    at::Tensor y =
        OnBackward(log, EventKind::kComputeBegin, unit,
                   fn(OnBackward(log, EventKind::kComputeEnd, unit, x)));
    log->RecordCompute(EventKind::kComputeEnd, unit, Phase::kForward);
    return y;
  };
  return engine.Root().Forward(tokens, [&](const at::Tensor& t) {
    if (log != nullptr) {
      log->RecordCompute(EventKind::kComputeBegin, 0, Phase::kForward);
    }
    // The root's backward ends in its embedding.
    at::Tensor h = model->Embed(t);
    if (log != nullptr) h = OnBackward(log, EventKind::kComputeEnd, 0, h);
    for (size_t i = 0; i < model->blocks.size(); ++i) {
      const int index = static_cast<int>(i) + 1;
      UnitHandle& unit = engine.Unit(index);
      Block block = model->blocks[i];
      TensorFn run = [&unit, block, marked, index](const at::Tensor& x) {
        return unit.Forward(x, [block, marked, index](const at::Tensor& y) {
          return marked(index, y, [block](const at::Tensor& z) mutable {
            return block->forward(z);
          });
        });
      };
      h = checkpoint ? Recompute(engine, run, h) : run(h);
    }
    at::Tensor logits = model->Head(h);
    if (log != nullptr) {
      // The root's backward begins in its head.
      logits = OnBackward(log, EventKind::kComputeBegin, 0, logits);
      log->RecordCompute(EventKind::kComputeEnd, 0, Phase::kForward);
    }
    return logits;
  });
}

std::pair<at::Tensor, at::Tensor> Batch(const ModelDims& dims, int step,
                                        int begin, int count) {
  at::Tensor tokens = torch::empty({count, dims.seq_len}, torch::kLong);
  at::Tensor targets = torch::empty({count, dims.seq_len}, torch::kLong);
  auto tok = tokens.accessor<int64_t, 2>();
  auto tgt = targets.accessor<int64_t, 2>();
  for (int b = 0; b < count; ++b) {
    for (int64_t t = 0; t < dims.seq_len; ++t) {
      const int64_t sample = begin + b;
      tok[b][t] = (sample * 7 + t * 3 + step * 5 + sample * t) % dims.vocab;
      tgt[b][t] = (tok[b][t] * 2 + 1 + sample) % dims.vocab;
    }
  }
  return {tokens, targets};
}

at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
      targets.reshape({-1}));
}

RunResult TrainSharded(MeshComms comms, int dp_rank, int dp_size,
                       const StateDict& init, const RunConfig& config) {
  RunResult result;
  TinyTransformer model = MakeModel(config.dims, init);
  std::unique_ptr<Engine> engine = MakeEngine(model, comms, config);
  torch::optim::AdamW optimizer(engine->Parameters(),
                                torch::optim::AdamWOptions(config.lr));
  const int local = config.global_batch / dp_size;
  const int per_mb = local / config.microbatches;
  for (int step = 0; step < config.steps; ++step) {
    RunConfig step_config = config;
    if (!config.fusion_bucket_by_step.empty()) {
      step_config.comm_fusion_bucket_bytes =
          config.fusion_bucket_by_step[step %
                                       config.fusion_bucket_by_step.size()];
    }
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, step_config);
    double step_loss = 0;
    for (int mb = 0; mb < config.microbatches; ++mb) {
      absl::Status s = engine->Apply(schedule, mb);
      EXPECT_TRUE(s.ok()) << s;
      auto [tokens, targets] =
          Batch(config.dims, step, dp_rank * local + mb * per_mb, per_mb);
      at::Tensor loss =
          Loss(EngineForward(*engine, model, tokens, config.checkpoint),
               targets) /
          config.microbatches;
      loss.backward();
      step_loss += loss.item<double>();
    }
    if (config.clip_norm > 0) {
      absl::StatusOr<double> norm =
          ClipGradNormGlobal(*engine, config.clip_norm);
      EXPECT_TRUE(norm.ok()) << norm.status();
    }
    optimizer.step();
    optimizer.zero_grad();
    result.losses.push_back(step_loss);
  }
  absl::StatusOr<StateDict> full = FullStateDict(*engine);
  EXPECT_TRUE(full.ok()) << full.status();
  if (full.ok()) result.params = *full;
  result.stats = engine->Stats();
  return result;
}

RunResult TrainReference(const StateDict& init, const RunConfig& config) {
  RunResult result;
  TinyTransformer model = MakeModel(config.dims, init);
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(config.lr));
  for (int step = 0; step < config.steps; ++step) {
    auto [tokens, targets] = Batch(config.dims, step, 0, config.global_batch);
    at::Tensor loss = Loss(model->forward(tokens), targets);
    loss.backward();
    if (config.clip_norm > 0)
      torch::nn::utils::clip_grad_norm_(model->parameters(), config.clip_norm);
    optimizer.step();
    optimizer.zero_grad();
    result.losses.push_back(loss.item<double>());
  }
  for (const auto& item : model->named_parameters()) {
    result.params[item.key()] = item.value().detach().clone();
  }
  return result;
}

void RunOnMesh(comm::MeshShape shape,
               const std::function<void(RankContext&)>& fn,
               absl::Duration timeout, bool shared_memory,
               int host_group_size) {
  static std::atomic<int> run_counter{0};
  const std::string prefix = absl::StrCat("fsdp-test-", run_counter++);
  comm::InMemoryStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < shape.world_size(); ++rank) {
    threads.emplace_back([&, rank] {
      comm::GlooDeviceOptions device;
      device.hostname = "127.0.0.1";
      absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> mesh =
          comm::DeviceMesh::CreateGloo(
              shape, rank, store, prefix, device, timeout, shared_memory,
              host_group_size > 0
                  ? absl::StrCat("host-", rank / host_group_size)
                  : std::string());
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      RankContext ctx;
      ctx.rank = rank;
      ctx.mesh = mesh->get();
      fn(ctx);
    });
  }
  for (std::thread& t : threads) t.join();
}

double MaxAbsDiff(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.sizes() != t.sizes()) {
      return std::numeric_limits<double>::infinity();
    }
    worst =
        std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble))
                            .abs()
                            .max()
                            .item<double>());
  }
  return worst;
}

bool BitwiseEqual(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || !torch::equal(t, it->second)) return false;
  }
  return true;
}

StepGrads CloneGrads(torch::nn::Module& module) {
  StepGrads grads;
  for (const auto& item : module.named_parameters()) {
    const at::Tensor& g = item.value().grad();
    grads[item.key()] = g.defined() ? g.detach().clone() : at::Tensor();
  }
  return grads;
}

StateDict CloneParams(torch::nn::Module& module) {
  StateDict params;
  for (const auto& item : module.named_parameters())
    params[item.key()] = item.value().detach().clone();
  return params;
}

}  // namespace hsdp::fsdp::testing
