// hsdpctl's subcommands: each file adds its subcommands' flags to the
// command line and says what each runs once parsed.
#ifndef HSDP_COORDINATOR_CTL_COMMAND_H_
#define HSDP_COORDINATOR_CTL_COMMAND_H_

#include <CLI/CLI.hpp>
#include <functional>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/ctl/control_client.h"

namespace hsdp::ctl {

// One subcommand: its (sub)app, parsed or not, and what it runs, writing its
// result to the stream. `run` owns the subcommand's parsed options.
struct Command {
  CLI::App* app = nullptr;
  std::function<absl::Status(ControlClient&, const GlobalOptions&,
                             std::ostream&)>
      run;
};

// status, workers (status_command.cc).
void AddStatusCommands(CLI::App& app, std::vector<Command>& commands);
// policy get, policy set (policy_command.cc).
void AddPolicyCommands(CLI::App& app, std::vector<Command>& commands);
// schedule (schedule_command.cc).
void AddScheduleCommand(CLI::App& app, std::vector<Command>& commands);
// checkpoint, drain, evict (job_commands.cc).
void AddCheckpointCommand(CLI::App& app, std::vector<Command>& commands);
void AddDrainCommand(CLI::App& app, std::vector<Command>& commands);
void AddEvictCommand(CLI::App& app, std::vector<Command>& commands);
// trace (trace_command.cc).
void AddTraceCommand(CLI::App& app, std::vector<Command>& commands);

}  // namespace hsdp::ctl

#endif  // HSDP_COORDINATOR_CTL_COMMAND_H_
