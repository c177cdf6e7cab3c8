// Replays fuzz inputs through a fuzz target's entry point without libFuzzer, so
// the seed corpus and every crash input found so far run in the ordinary test
// set (any compiler, any build).
//
//   <target>_replay PATH...   (files, or directories whose files are replayed)
//
// Exits 0 after replaying at least one input; 1 when no input was found. An
// input that crashes the target crashes this program, naming the file first.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

std::vector<fs::path> Inputs(const fs::path& path) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      if (entry.is_regular_file()) out.push_back(entry.path());
    }
  } else if (fs::is_regular_file(path, ec)) {
    out.push_back(path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    for (const fs::path& input : Inputs(argv[i])) {
      std::fprintf(stderr, "replay %s\n", input.c_str());
      std::ifstream in(input, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                             bytes.size());
      ++replayed;
    }
  }
  std::fprintf(stderr, "replayed %d input(s)\n", replayed);
  return replayed > 0 ? 0 : 1;
}
