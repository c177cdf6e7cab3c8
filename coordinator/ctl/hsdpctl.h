// hsdpctl: the operator CLI for a running coordinator's ControlService.
#ifndef HSDP_COORDINATOR_CTL_HSDPCTL_H_
#define HSDP_COORDINATOR_CTL_HSDPCTL_H_

#include <ostream>

namespace hsdp::ctl {

// Exit codes: 0 success, 1 the coordinator refused or could not be reached, 2
// bad command line.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRpcError = 1;
inline constexpr int kExitUsage = 2;

// Runs one hsdpctl command line. Results go to `out`; errors are one line on
// `err`
// ("hsdpctl: <command>: <CODE>: <reason>"). Thread-compatible (no shared
// state).
int RunHsdpctl(int argc, char** argv, std::ostream& out, std::ostream& err);

}  // namespace hsdp::ctl

#endif  // HSDP_COORDINATOR_CTL_HSDPCTL_H_
