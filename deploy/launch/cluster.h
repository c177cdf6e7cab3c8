// The processes hsdp-launch supervises: starting one (Spawn, Respawn),
// reaping those that exited, and stopping them all (Cluster).
#ifndef HSDP_DEPLOY_LAUNCH_CLUSTER_H_
#define HSDP_DEPLOY_LAUNCH_CLUSTER_H_

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsdp::launch {

// The worker flag naming its report file; a restarted worker gets a new one.
inline constexpr char kReportFileFlag[] = "--report-file";

// Child::rank of the processes that are not workers.
inline constexpr int kCoordinatorRank = -1;
inline constexpr int kRelayRank = -2;

struct Child {
  std::string name;
  pid_t pid = -1;
  std::string log;
  bool running = false;
  int exit_status = 0;  // raw waitpid status once exited
  // The worker's rank hint; kCoordinatorRank or kRelayRank for the others.
  int rank = -1;
  // Its command line (restarts run it again).
  std::vector<std::string> argv;
};

// Forks and execs `argv` with stdout+stderr appended to `log`. The child dies
// with the launcher (PDEATHSIG) so a SIGKILLed launcher leaves no orphans.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::string& log);

// Starts an exited `child` again with its own command line, its report file
// (kReportFileFlag's value) replaced by `report`, after appending `log_line`
// to its log.
absl::Status Respawn(Child& child, const std::string& report,
                     const std::string& log_line);

// The last non-empty line of `path`, or "" when it cannot be read.
std::string LastLine(const std::string& path);
// The first line of `path`, or "" when it cannot be read.
std::string FirstLine(const std::string& path);

// "exit status N", "killed by signal N" or "stopped", for a raw waitpid status.
std::string DescribeExit(int status);
bool ExitedOk(int status);

// The children of one launch. Thread-compatible: the launcher's main loop
// only. Terminates what still runs when destroyed.
class Cluster {
 public:
  Cluster() = default;
  ~Cluster() { Terminate(); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  void Add(Child child) { children_.push_back(std::move(child)); }
  std::vector<Child>& children() { return children_; }

  // Reaps exited children; returns the indices (into children()) of those
  // that exited since the last call, in order.
  std::vector<size_t> Reap();

  // SIGTERM to all running children, SIGKILL after the grace period.
  void Terminate();

  bool AnyRunning() const;

 private:
  std::vector<Child> children_;
};

}  // namespace hsdp::launch

#endif  // HSDP_DEPLOY_LAUNCH_CLUSTER_H_
