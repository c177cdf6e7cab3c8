// Fuzzes hsdp-coordinator's job file (`--job-file`, `name = value` lines read
// by CLI11) together with the job checks the coordinator runs on it: the
// coordinator's own main() is compiled into this target (renamed, see
// CMakeLists.txt) and run with `--job-file INPUT --check-config`, which parses,
// validates and prints the job, then returns before serving anything.
//
// Invariant: it returns 0 (valid), 2 (invalid job) or 1 (a --validate-policy
// the file asked for refused its policy); it never crashes or hangs.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_check.h"

int hsdp_coordinator_main(int argc, char** argv);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      absl::StrCat("/tmp/hsdp-job-file-fuzz-", ::getpid(), ".toml");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data),
              static_cast<std::streamsize>(size));
  }
  std::string args[] = {"hsdp-coordinator", "--job-file", path,
                        "--check-config"};
  char* argv[] = {args[0].data(), args[1].data(), args[2].data(),
                  args[3].data(), nullptr};
  const int rc = hsdp_coordinator_main(4, argv);
  FUZZ_CHECK(rc == 0 || rc == 2 || rc == 1);
  return 0;
}
