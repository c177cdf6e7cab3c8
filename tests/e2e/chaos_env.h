// The fault injectors of the chaos soak (tests/e2e/chaos_soak_test.cc): one
// network namespace per "pod" on a private bridge, with link faults (delay and
// loss, a cut link), and a size-limited tmpfs that can be filled. Both need
// root; Create() says why not when they cannot be had. Thread-compatible.
#ifndef HSDP_TESTS_E2E_CHAOS_ENV_H_
#define HSDP_TESTS_E2E_CHAOS_ENV_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hsdp::e2e {

// Namespaces "<tag>-sw" (the bridge) and "<tag>-<pod>", each pod with eth0 at
// 10.251.9.<n>/24 and no route off that subnet. Everything it made is removed
// by the destructor, and namespaces of an earlier run whose process is gone by
// Create().
class PodNetwork {
 public:
  static absl::StatusOr<std::unique_ptr<PodNetwork>> Create(
      const std::string& scratch_dir);
  ~PodNetwork();
  PodNetwork(const PodNetwork&) = delete;
  PodNetwork& operator=(const PodNetwork&) = delete;

  // Adds pod `name`; returns its address.
  absl::StatusOr<std::string> AddPod(const std::string& name);
  // argv run inside the pod's namespace.
  std::vector<std::string> Exec(const std::string& pod,
                                const std::vector<std::string>& argv) const;

  // Delays and drops the pod's outgoing packets: tc netem (delay_ms ± a
  // quarter, loss_percent) where the kernel has it, else a token-bucket
  // filter whose queue delays packets and drops what waits past delay_ms.
  // Returns what it installed, in words.
  absl::StatusOr<std::string> Impair(const std::string& pod, int delay_ms,
                                     int loss_percent);
  // Removes the impairment (a no-op without one).
  void Repair(const std::string& pod);
  // Takes the pod's link down or up (a partition: every packet dropped).
  absl::Status SetLink(const std::string& pod, bool up);

 private:
  PodNetwork(std::string tag, std::string scratch_dir);
  std::string Namespace(const std::string& pod) const;
  // Runs argv to completion; its output goes to the scratch log.
  int Run(const std::vector<std::string>& argv) const;

  std::string tag_;
  std::string scratch_dir_;
  std::vector<std::string> namespaces_;
  std::vector<std::string> pods_;
  int netem_ = -1;  // -1 unknown, 0 not in this kernel, 1 available
};

// A tmpfs of `bytes` mounted at `dir` (created), unmounted by the destructor.
class SizedTmpfs {
 public:
  static absl::StatusOr<std::unique_ptr<SizedTmpfs>> Mount(
      const std::string& dir, int64_t bytes);
  ~SizedTmpfs();
  SizedTmpfs(const SizedTmpfs&) = delete;
  SizedTmpfs& operator=(const SizedTmpfs&) = delete;

  // Writes a file until the file system is full; returns the bytes written.
  int64_t Fill();
  // Removes that file.
  void Free();

 private:
  explicit SizedTmpfs(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace hsdp::e2e

#endif  // HSDP_TESTS_E2E_CHAOS_ENV_H_
