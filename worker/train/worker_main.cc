#include "hsdp/worker_main.h"

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "hsdp/runner.h"
#include "hsdp/task_options.h"
#include "worker/train/training_options.h"

namespace hsdp::train {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

// "name-3" -> 3 (a StatefulSet pod ordinal); nullopt when there is no numeric
// suffix.
std::optional<int> OrdinalSuffix(const char* name) {
  if (name == nullptr) return std::nullopt;
  const std::string s(name);
  const size_t dash = s.rfind('-');
  int ordinal;
  if (dash == std::string::npos ||
      !absl::SimpleAtoi(s.substr(dash + 1), &ordinal)) {
    return std::nullopt;
  }
  return ordinal;
}

// --rank-hint, else HSDP_RANK_HINT (via CLI11), else RANK (torchrun), else the
// pod ordinal.
std::optional<int> RankHintFromEnvironment() {
  int rank;
  if (const char* r = Env("RANK"); r != nullptr && absl::SimpleAtoi(r, &rank))
    return rank;
  if (auto o = OrdinalSuffix(Env("POD_NAME"))) return o;
  return OrdinalSuffix(Env("HOSTNAME"));
}

std::string ProgramName(const char* argv0) {
  std::string name = argv0 == nullptr ? "hsdp-worker" : argv0;
  const size_t slash = name.rfind('/');
  return slash == std::string::npos ? name : name.substr(slash + 1);
}

int Fail(const std::string& program, const std::string& message) {
  std::cerr << program << ": " << absl::StrReplaceAll(message, {{"\n", " "}})
            << std::endl;
  return kExitFailure;
}

// The command line of both WorkerMain forms: `factory` (the built-in
// registry's form, with the GPT's flags) or `definition` (a user's task with
// typed options, without them); exactly one is set.
int RunWorkerMain(int argc, char** argv, const TaskFactory* factory,
                  const TaskDefinition* definition) {
  // Gloo's TCP transport writes to its peers' sockets without MSG_NOSIGNAL: a
  // peer that died or aborted its communicators mid-write would kill this
  // process with SIGPIPE, turning one lost worker into two. Ignored, the
  // write fails with EPIPE, which the collective reports and the run
  // re-forms from (Python, under PyTorch's Gloo, ignores SIGPIPE the same
  // way).
  std::signal(SIGPIPE, SIG_IGN);
  const std::string program = ProgramName(argc > 0 ? argv[0] : nullptr);
  WorkerOptions w;
  TrainingOptions& t = w.training;
  int microbatches = 1, world_size = 1;
  int rank_hint = -1;
  double collective_timeout = 60, coordinator_timeout = 60;
  double weight_decay = -1;
  bool reference = false;
  std::string optimizer = "adamw", lr_schedule = "constant";
  std::string on_nonfinite = "stop";
  std::vector<std::string> task_options;
  std::string units;

  CLI::App app{definition == nullptr
                   ? absl::StrCat(program,
                                  ": trains a model shard scheduled by an hsdp "
                                  "coordinator")
                   : absl::StrCat(program, ": trains a shard of ",
                                  definition->name,
                                  " scheduled by an hsdp coordinator. ",
                                  definition->description)};
  app.add_option("--coordinator", w.coordinator, "coordinator HOST:PORT")
      ->envname("HSDP_COORDINATOR");
  app.add_option("--relay", w.relay,
                 "this host's hsdp-relay HOST:PORT or unix:PATH: the schedule "
                 "and report streams go there (calls still go to "
                 "--coordinator)")
      ->envname("HSDP_RELAY");
  app.add_option("--job-id", w.job_id, "job id")->envname("HSDP_JOB_ID");
  app.add_option(
      "--job-token-file", w.job_token_file,
      "file holding the job's worker token (else HSDP_JOB_TOKEN_FILE, "
      "else HSDP_JOB_TOKEN)");
  app.add_option("--tls-ca", w.tls_ca,
                 "PEM CA of the coordinator's certificate (TLS)")
      ->envname("HSDP_TLS_CA");
  app.add_option("--tls-client-cert", w.tls_client_cert,
                 "this worker's PEM certificate (mutual TLS)")
      ->envname("HSDP_TLS_CLIENT_CERT");
  app.add_option("--tls-client-key", w.tls_client_key,
                 "this worker's PEM private key (mutual TLS)")
      ->envname("HSDP_TLS_CLIENT_KEY");
  app.add_option("--rank-hint", rank_hint,
                 "preferred rank (else RANK, else the ordinal suffix of "
                 "POD_NAME/HOSTNAME)")
      ->envname("HSDP_RANK_HINT");
  app.add_option("--device", w.device, "cpu or cuda:N")->envname("HSDP_DEVICE");
  if (definition == nullptr) {
    app.add_option("--model", w.task_args.model, "the model (task) to train")
        ->envname("HSDP_MODEL");
    app.add_option("--dims", w.task_args.dims,
                   "explicit dims d_model,n_layers,n_heads,seq_len");
    app.add_option("--vocab-size", w.task_args.vocab_size,
                   "vocabulary size (0: the model's default)")
        ->envname("HSDP_VOCAB_SIZE");
    app.add_option("--task-option", task_options,
                   "KEY=VALUE setting of the model's own (repeatable)");
    app.add_option("--units", units,
                   "glob over submodule names that are sharding units, e.g. "
                   "'layers.*' (torchscript models; same as --task-option "
                   "units=RULE)")
        ->envname("HSDP_UNITS");
    app.add_option("--data", w.task_args.data,
                   "training data: a text file, tokens:PATH (llm.c header), "
                   "tokens-u16:PATH or tokens-u32:PATH (default: built-in "
                   "corpus)")
        ->envname("HSDP_DATA");
  } else {
    app.add_option("--task-option", task_options,
                   "NAME=VALUE setting of the task (repeatable; listed below)");
    app.footer(absl::StrCat("Task options of ", definition->name,
                            " (--task-option NAME=VALUE):\n",
                            definition->options.Help()));
  }
  app.add_option("--steps", t.steps, "total training steps")
      ->envname("HSDP_STEPS");
  app.add_option("--microbatch-size", t.microbatch_size,
                 "samples per microbatch per rank")
      ->envname("HSDP_MICROBATCH_SIZE");
  app.add_option("--seed", t.seed, "model init and data seed")
      ->envname("HSDP_SEED");
  app.add_option("--optimizer", optimizer, "adamw or sgd")
      ->envname("HSDP_OPTIMIZER");
  app.add_option("--lr", t.optimizer.lr, "peak learning rate")
      ->envname("HSDP_LR");
  app.add_option("--weight-decay", weight_decay,
                 "decoupled (AdamW) or L2 (SGD) weight decay (default: 0.01 "
                 "for adamw, 0 for sgd)")
      ->envname("HSDP_WEIGHT_DECAY");
  app.add_option("--momentum", t.optimizer.momentum, "SGD momentum")
      ->envname("HSDP_MOMENTUM");
  app.add_option("--lr-schedule", lr_schedule,
                 "constant or cosine (after the warmup)")
      ->envname("HSDP_LR_SCHEDULE");
  app.add_option("--warmup-steps", t.lr_schedule.warmup_steps,
                 "linear warmup steps")
      ->envname("HSDP_WARMUP_STEPS");
  app.add_option("--min-lr", t.lr_schedule.min_lr,
                 "cosine: learning rate at the last step")
      ->envname("HSDP_MIN_LR");
  app.add_option("--param-dtype", t.param_dtype,
                 "dtype of the gathered parameters: fp32 or bf16")
      ->envname("HSDP_PARAM_DTYPE");
  app.add_option("--reduce-dtype", t.reduce_dtype,
                 "dtype gradients are reduced in (default: fp32)")
      ->envname("HSDP_REDUCE_DTYPE");
  app.add_option("--grad-accumulation-dtype", t.grad_accumulation_dtype,
                 "dtype gradients accumulate in across microbatches that do "
                 "not synchronise them: fp32 or bf16 (default: the param "
                 "dtype; fp32 with bf16 params keeps fp32 main gradients)")
      ->envname("HSDP_GRAD_ACCUMULATION_DTYPE");
  app.add_option("--grad-reduce", t.grad_reduce,
                 "how gradients combine across ranks: avg (the mean; for a "
                 "loss averaged over samples) or sum")
      ->envname("HSDP_GRAD_REDUCE");
  app.add_option("--grad-divide-factor", t.grad_divide_factor,
                 "when > 0: gradients are summed over ranks and divided by "
                 "this (e.g. the global batch's token count)")
      ->envname("HSDP_GRAD_DIVIDE_FACTOR");
  app.add_flag("--cpu-offload", t.cpu_offload,
               "keep shards, gradients and optimizer state on the CPU")
      ->envname("HSDP_CPU_OFFLOAD");
  app.add_option("--recompute-units", t.recompute_units,
                 "glob over unit names whose activations are recomputed in "
                 "backward, e.g. 'layers.*'")
      ->envname("HSDP_RECOMPUTE_UNITS");
  app.add_option("--clip-grad-norm", t.clip_grad_norm,
                 "clip the global gradient norm to this (0: off)")
      ->envname("HSDP_CLIP_GRAD_NORM");
  app.add_option("--on-nonfinite", on_nonfinite,
                 "a step whose loss (or clipped gradient norm) is NaN or "
                 "infinite: stop (the job fails naming the step, rank and "
                 "microbatch) or skip-step (every rank drops the step's "
                 "gradients)")
      ->envname("HSDP_ON_NONFINITE");
  app.add_option("--checkpoint-dir", w.checkpoint_dir,
                 "sharded checkpoints; resume from here")
      ->envname("HSDP_CHECKPOINT_DIR");
  app.add_option("--keep-checkpoints", w.keep_checkpoints,
                 "newest checkpoints kept, older ones deleted once a newer "
                 "one is complete (0: all)")
      ->envname("HSDP_KEEP_CHECKPOINTS");
  app.add_flag("--sync-checkpoint", w.sync_checkpoint,
               "write checkpoints on the training thread (default: in the "
               "background)")
      ->envname("HSDP_SYNC_CHECKPOINT");
  app.add_option("--threads", w.process.threads,
                 "intra-op threads (0: LibTorch default)")
      ->envname("HSDP_THREADS");
  app.add_option("--gloo-iface", w.gloo_iface, "network interface for Gloo")
      ->envname("HSDP_GLOO_IFACE");
  app.add_option("--gloo-hostname", w.gloo_hostname, "address Gloo listens on")
      ->envname("HSDP_GLOO_HOSTNAME");
  app.add_option("--host-id", w.host_id,
                 "the host this worker reports for placement (default: the "
                 "machine's hostname; in a container, the node's name)")
      ->envname("HSDP_HOST_ID");
  app.add_option("--shared-memory", w.shared_memory,
                 "ranks on one host exchange unit all-gathers and "
                 "reduce-scatters through shared memory instead of TCP "
                 "(falls back to Gloo TCP on every rank when any cannot map "
                 "it)")
      ->envname("HSDP_SHARED_MEMORY");
  app.add_option("--collective-timeout", collective_timeout, "seconds")
      ->envname("HSDP_COLLECTIVE_TIMEOUT");
  app.add_option("--coordinator-timeout", coordinator_timeout,
                 "seconds to keep retrying an unreachable coordinator")
      ->envname("HSDP_COORDINATOR_TIMEOUT");
  app.add_option("--report-file", w.process.report_file,
                 "JSON lines, one per step")
      ->envname("HSDP_REPORT_FILE");
  app.add_option("--final-params", w.process.final_params,
                 "after the last step rank 0 writes the full parameters here");
  app.add_flag(
      "--reference", reference,
      "train unsharded in this process on the global batches of a sharded run");
  app.add_option("--world-size", world_size,
                 "--reference (required): world size of the sharded run "
                 "mirrored");
  app.add_option("--microbatches", microbatches,
                 "--reference: microbatches per step");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << program << ": " << e.what() << " (see --help)" << std::endl;
    return kExitUsage;
  }
  auto usage = [&](const std::string& message) {
    std::cerr << program << ": " << message << std::endl;
    return kExitUsage;
  };
  if (collective_timeout <= 0 || coordinator_timeout <= 0 || world_size <= 0 ||
      microbatches <= 0) {
    return usage(
        "--world-size, --microbatches and the timeouts must be positive");
  }
  if (optimizer == "adamw") {
    t.optimizer.kind = OptimizerKind::kAdamW;
  } else if (optimizer == "sgd") {
    t.optimizer.kind = OptimizerKind::kSgd;
  } else {
    return usage(
        absl::StrCat("--optimizer: '", optimizer, "' is not adamw or sgd"));
  }
  if (lr_schedule != "constant" && lr_schedule != "cosine") {
    return usage(absl::StrCat("--lr-schedule: '", lr_schedule,
                              "' is not constant or cosine"));
  }
  t.lr_schedule.cosine = lr_schedule == "cosine";
  if (absl::StatusOr<NonFiniteAction> action =
          ParseNonFiniteAction(on_nonfinite);
      action.ok()) {
    t.on_nonfinite = *action;
  } else {
    return usage(std::string(action.status().message()));
  }
  if (reference && app.count("--world-size") == 0) {
    // The default of 1 would silently mirror a one-rank run.
    return usage(
        "--reference needs --world-size N: the world size of the sharded run "
        "it mirrors (and --microbatches M unless 1)");
  }
  if (app.count("--weight-decay") > 0 || Env("HSDP_WEIGHT_DECAY") != nullptr) {
    t.optimizer.weight_decay = weight_decay;
  }
  for (const std::string& kv : task_options) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return usage(absl::StrCat("--task-option '", kv, "': want KEY=VALUE"));
    }
    w.task_args.options[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  if (!units.empty()) w.task_args.options["units"] = units;
  std::optional<TaskOptionValues> values;
  if (definition != nullptr) {
    absl::StatusOr<TaskOptionValues> parsed =
        definition->options.Parse(w.task_args.options);
    if (!parsed.ok()) return usage(std::string(parsed.status().message()));
    // Canonical and complete: ranks that spell a value differently, or rely
    // on a default, report the same settings.
    w.task_args.options = parsed->AsMap();
    w.task_args.model = definition->name;
    values = *std::move(parsed);
  }
  if (absl::Status s = ValidateTrainingOptions(t); !s.ok()) {
    return usage(std::string(s.message()));
  }

  InitLogging(argc > 0 ? argv[0] : "hsdp-worker");
  absl::StatusOr<std::unique_ptr<Task>> task = definition == nullptr
                                                   ? (*factory)(w.task_args)
                                                   : definition->make(*values);
  if (!task.ok()) return Fail(program, std::string(task.status().message()));

  if (reference) {
    ReferenceOptions ref;
    ref.training = t;
    ref.process = w.process;
    ref.task_args = w.task_args;
    ref.world_size = world_size;
    ref.microbatches = microbatches;
    absl::Status s = RunReference(std::move(*task), ref);
    return s.ok() ? 0 : Fail(program, std::string(s.message()));
  }

  if (rank_hint >= 0) {
    w.rank_hint = rank_hint;
  } else {
    w.rank_hint = RankHintFromEnvironment();
  }
  w.collective_timeout = absl::Seconds(collective_timeout);
  w.coordinator_timeout = absl::Seconds(coordinator_timeout);
  absl::Status s = RunTask(std::move(*task), w);
  return s.ok() ? 0 : Fail(program, std::string(s.message()));
}

}  // namespace

int WorkerMain(int argc, char** argv, const TaskFactory& factory) {
  return RunWorkerMain(argc, argv, &factory, nullptr);
}

int WorkerMain(int argc, char** argv, const TaskDefinition& definition) {
  return RunWorkerMain(argc, argv, nullptr, &definition);
}

}  // namespace hsdp::train
