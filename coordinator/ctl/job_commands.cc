// hsdpctl checkpoint, drain and evict: changes to the running job.
#include <cstdint>
#include <memory>
#include <optional>

#include "coordinator/ctl/command.h"

namespace hsdp::ctl {
namespace {

// Options of `evict`: exactly one target.
struct EvictOptions {
  std::optional<int> rank;
  std::optional<int64_t> worker_id;
};

absl::Status Checkpoint(ControlClient& client, const GlobalOptions& g,
                        std::ostream& out) {
  return CallAndPrint(client, g, &ControlService::Stub::RequestCheckpoint,
                      hsdp::v1::RequestCheckpointRequest(), out,
                      [&](const hsdp::v1::RequestCheckpointResponse& r) {
                        out << "checkpoint scheduled after step " << r.step()
                            << "\n";
                      });
}

absl::Status Evict(ControlClient& client, const GlobalOptions& g,
                   const EvictOptions& o, std::ostream& out) {
  hsdp::v1::EvictWorkerRequest request;
  if (o.rank.has_value() == o.worker_id.has_value()) {
    return absl::InvalidArgumentError("give a RANK or --worker-id, not both");
  }
  if (o.rank.has_value()) request.set_rank(*o.rank);
  if (o.worker_id.has_value()) request.set_worker_id(*o.worker_id);
  return CallAndPrint(client, g, &ControlService::Stub::EvictWorker, request,
                      out, [&](const hsdp::v1::EvictWorkerResponse& r) {
                        if (r.generation() >= 0) {
                          out << "worker " << r.worker_id()
                              << " evicted: generation " << r.generation()
                              << " ends at the next step boundary without it\n";
                        } else {
                          out << "worker " << r.worker_id() << " evicted\n";
                        }
                      });
}

absl::Status Drain(ControlClient& client, const GlobalOptions& g,
                   std::ostream& out) {
  return CallAndPrint(client, g, &ControlService::Stub::Drain,
                      hsdp::v1::DrainRequest(), out,
                      [&](const hsdp::v1::DrainResponse& r) {
                        out << "draining: last step " << r.last_step() << "\n";
                      });
}

}  // namespace

void AddCheckpointCommand(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* checkpoint =
      app.add_subcommand("checkpoint", "Checkpoint at the next unsealed step");
  commands.push_back({checkpoint, Checkpoint});
}

void AddDrainCommand(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* drain =
      app.add_subcommand("drain", "Stop the job after the next unsealed step");
  commands.push_back({drain, Drain});
}

void AddEvictCommand(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* evict = app.add_subcommand(
      "evict",
      "Take a worker out (at the next step boundary), as when draining a node");
  auto eo = std::make_shared<EvictOptions>();
  evict->add_option("rank", eo->rank, "Rank in the current generation");
  evict->add_option("--worker-id", eo->worker_id,
                    "Worker id (also for standby or joining workers)");
  commands.push_back(
      {evict, [eo](ControlClient& client, const GlobalOptions& g,
                   std::ostream& out) { return Evict(client, g, *eo, out); }});
}

}  // namespace hsdp::ctl
