// The options of the Gloo backend: where its tcp device listens, and how a
// GlooCommunicator behaves. Header-only and free of Gloo's own headers, so a
// public header (device_mesh.h) can take these options without pulling in the
// communicator, its executor or Gloo.
#ifndef HSDP_GLOO_OPTIONS_H_
#define HSDP_GLOO_OPTIONS_H_

#include <cstddef>
#include <string>

#include "absl/time/time.h"

namespace hsdp::comm {

// Where the tcp device listens. Set at most one of hostname / iface; with
// neither, Gloo resolves the machine's hostname. Tests use hostname
// "127.0.0.1".
struct GlooDeviceOptions {
  std::string hostname;
  std::string iface;
};

// The segment collectives pack segments smaller than this into one message
// per peer: a copy of a few KiB beats a Gloo round trip per segment.
inline constexpr size_t kGlooPackBelowBytes = size_t{64} << 10;

struct GlooCommunicatorOptions {
  // Shown in errors and name(), e.g. "gloo:shard".
  std::string name = "gloo";
  // Bounds the rendezvous and every collective.
  absl::Duration timeout = absl::Seconds(30);
  // Segments under this many bytes travel packed (see kGlooPackBelowBytes);
  // the rest go on their own, straight from and into the caller's memory.
  // Changes the messages, never the result: 0 packs nothing, SIZE_MAX packs
  // everything. Every rank of a group must use the same value. Tests lower it
  // to reach both paths with small buffers.
  size_t pack_below_bytes = kGlooPackBelowBytes;
};

}  // namespace hsdp::comm

#endif  // HSDP_GLOO_OPTIONS_H_
