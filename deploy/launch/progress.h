// What hsdp-launch prints while a job runs: one live progress line read from
// the workers' report files and the coordinator's status, and a line for each
// generation that trained a step.
#ifndef HSDP_DEPLOY_LAUNCH_PROGRESS_H_
#define HSDP_DEPLOY_LAUNCH_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <ios>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hsdp/v1/control_service.pb.h"

namespace hsdp::launch {

// Reads what the workers append to their report files: the first step each
// generation trained, its world size, and which files have lines of it.
// Every member of a generation trains its first step, so the first line of a
// generation in any file names the generation's start step.
// Thread-compatible.
class ReportScanner {
 public:
  struct Generation {
    int64_t first_step = 0;
    int world_size = 0;
    std::set<std::string> files;
  };

  // Reads the complete lines appended to `paths` since the last call.
  void Scan(const std::vector<std::string>& paths);

  const std::map<int64_t, Generation>& generations() const {
    return generations_;
  }

 private:
  std::map<std::string, std::streamoff> offsets_;
  std::map<int64_t, Generation> generations_;
};

// The launcher's output while the job runs: on a terminal the progress line
// is redrawn in place, in logs and pipes it is printed every few seconds.
// Thread-compatible: the launcher's main loop only.
class Progress {
 public:
  // `reports`: each rank's report file; `shard`: the mesh's shard size;
  // `steps`: the job's.
  Progress(bool tty, int shard, int64_t steps,
           std::vector<std::string> reports);

  // Rank `rank`'s restart number `restart` writes to `report` from now on.
  void Restarted(int rank, int restart, const std::string& report);
  // Something that happened to the workers, said with the next generation.
  void AddEvent(std::string event);
  // Says each generation that trained a step since the last call: its mesh,
  // its start step, what led to it and which restarted workers rejoined in
  // it.
  void SayGenerations();
  // The progress line: step, generation and mesh (once the coordinator
  // said), `restarts` (when any), loss, throughput, step time and memory.
  // `final_line` ends it.
  void Show(bool final_line,
            const std::optional<hsdp::v1::GetStatusResponse>& status,
            int restarts);
  // What a message line starts with: on a terminal, it clears the progress
  // line.
  const char* LineStart() const { return tty_ ? "\r\033[K" : ""; }

 private:
  const bool tty_;
  const int shard_;
  const int64_t steps_;
  // The live incarnation's report file of each rank.
  std::vector<std::string> reports_;
  // Every report file of every incarnation, and the restarted ones' ranks
  // and restart numbers (until their rejoining is said).
  std::vector<std::string> all_reports_;
  std::map<std::string, std::pair<int, int>> restarted_reports_;
  // What happened to the workers since the last generation line.
  std::vector<std::string> events_;
  ReportScanner scanner_;
  int64_t said_generation_ = 0;
  std::string last_printed_;
  std::chrono::steady_clock::time_point last_print_;
};

}  // namespace hsdp::launch

#endif  // HSDP_DEPLOY_LAUNCH_PROGRESS_H_
