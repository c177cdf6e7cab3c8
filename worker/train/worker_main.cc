// hsdp-worker: joins a coordinator and trains its model shard (see
// worker/README.md).
//   hsdp-worker --coordinator HOST:PORT --job-id JOB --model gpt-tiny --steps
//   100 hsdp-worker --reference --world-size 4 --microbatches 1 ... (unsharded
//   single-process reference)
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "worker/train/trainer.h"

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

int Fail(const std::string& message) {
  std::cerr << "hsdp-worker: " << absl::StrReplaceAll(message, {{"\n", " "}})
            << std::endl;
  return kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  hsdp::train::WorkerOptions w;
  hsdp::train::ReferenceOptions ref;
  int rank_hint = -1;
  double collective_timeout = 60, coordinator_timeout = 60;
  bool reference = false;

  CLI::App app{
      "hsdp worker: trains a model shard scheduled by an hsdp coordinator"};
  app.add_option("--coordinator", w.coordinator, "coordinator HOST:PORT")
      ->envname("HSDP_COORDINATOR");
  app.add_option("--job-id", w.job_id, "job id")->envname("HSDP_JOB_ID");
  app.add_option("--rank-hint", rank_hint,
                 "preferred rank (else RANK, else the ordinal suffix of "
                 "POD_NAME/HOSTNAME)")
      ->envname("HSDP_RANK_HINT");
  app.add_option("--device", w.device, "cpu or cuda:N")->envname("HSDP_DEVICE");
  app.add_option("--model", w.training.model,
                 "gpt-tiny, gpt-small, gpt-medium, gpt-1b")
      ->envname("HSDP_MODEL");
  app.add_option("--dims", w.training.dims,
                 "explicit dims d_model,n_layers,n_heads,seq_len");
  app.add_option("--data", w.training.data,
                 "training text file (default: built-in corpus)")
      ->envname("HSDP_DATA");
  app.add_option("--steps", w.training.steps, "total training steps")
      ->envname("HSDP_STEPS");
  app.add_option("--microbatch-size", w.training.microbatch_size,
                 "sequences per microbatch per rank")
      ->envname("HSDP_MICROBATCH_SIZE");
  app.add_option("--lr", w.training.lr, "AdamW learning rate")
      ->envname("HSDP_LR");
  app.add_option("--checkpoint-dir", w.checkpoint_dir,
                 "sharded checkpoints; resume from here")
      ->envname("HSDP_CHECKPOINT_DIR");
  app.add_option("--threads", w.training.threads,
                 "intra-op threads (0: LibTorch default)")
      ->envname("HSDP_THREADS");
  app.add_option("--gloo-iface", w.gloo_iface, "network interface for Gloo")
      ->envname("HSDP_GLOO_IFACE");
  app.add_option("--gloo-hostname", w.gloo_hostname, "address Gloo listens on")
      ->envname("HSDP_GLOO_HOSTNAME");
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
  app.add_option("--seed", w.training.seed, "model init and data seed")
      ->envname("HSDP_SEED");
  app.add_option("--report-file", w.training.report_file,
                 "JSON lines, one per step")
      ->envname("HSDP_REPORT_FILE");
  app.add_option("--final-params", w.training.final_params,
                 "after the last step rank 0 writes the full parameters here");
  app.add_flag(
      "--reference", reference,
      "train unsharded in this process on the global batches of a sharded run");
  app.add_option("--world-size", ref.world_size,
                 "--reference: world size mirrored");
  app.add_option("--microbatches", ref.microbatches,
                 "--reference: microbatches per step");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "hsdp-worker: " << e.what() << " (see --help)" << std::endl;
    return kExitUsage;
  }
  if (w.training.steps < 0 || w.training.microbatch_size <= 0 ||
      collective_timeout <= 0 || coordinator_timeout <= 0 ||
      ref.world_size <= 0 || ref.microbatches <= 0) {
    std::cerr << "hsdp-worker: --steps must be >= 0 and --microbatch-size, "
                 "--world-size, "
                 "--microbatches and timeouts > 0"
              << std::endl;
    return kExitUsage;
  }

  hsdp::train::InitLogging(argv[0]);
  if (reference) {
    ref.training = w.training;
    absl::Status s = hsdp::train::RunReference(ref);
    return s.ok() ? 0 : Fail(std::string(s.message()));
  }

  if (rank_hint >= 0) {
    w.rank_hint = rank_hint;
  } else {
    w.rank_hint = RankHintFromEnvironment();
  }
  w.collective_timeout = absl::Seconds(collective_timeout);
  w.coordinator_timeout = absl::Seconds(coordinator_timeout);
  absl::Status s = hsdp::train::RunWorker(w);
  return s.ok() ? 0 : Fail(std::string(s.message()));
}
