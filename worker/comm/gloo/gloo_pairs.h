// The TCP pairs of a Gloo context, as a GlooCommunicator needs them beyond
// what Gloo offers: which peer rank each remote address belongs to (Gloo names
// a lost peer only by its address, and errors should name a rank), and a way
// to shut every pair down that wakes a collective blocked on it (for Abort).
//
// Thread-safety: the functions keep no state. ShutdownGlooPairs may run while
// another thread is blocked in a collective on the same context; that is what
// it is for.
#ifndef HSDP_WORKER_COMM_GLOO_GLOO_PAIRS_H_
#define HSDP_WORKER_COMM_GLOO_GLOO_PAIRS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/store.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace hsdp::comm {

// After connecting, every rank publishes the addresses of its ends of the
// pairs (key "<prefix>/pair_addresses/<rank>", one line per peer rank) and
// reads which address each peer uses towards it. Returns that address per
// peer rank ("" for this rank). Collective: every rank of the context calls
// it.
absl::StatusOr<std::vector<std::string>> ExchangePairAddresses(
    Store& store, const std::string& prefix, gloo::Context& context,
    absl::Duration timeout);

// Which peer a Gloo error names: Gloo reports a lost connection with the TCP
// address of the peer's end; `peer_addresses[p]` is the address peer p
// published for its end of our pair ("" for this rank). Matches the exact
// address, else the host when exactly one peer lives there; -1 if unknown.
int FindPeerInGlooError(const std::string& text,
                        const std::vector<std::string>& peer_addresses);

// Shuts down (both ways) the TCP socket of every pair of `context`, so Gloo's
// own connection-lost path fails every pending operation of the pair, waking
// a blocked waiter; peers read EOF and fail at once. A pair whose socket is
// not found (no /proc, or Gloo closed it after an error) is closed instead:
// that still tells the peer, and a local wait on it ends at its timeout.
// `peer_addresses` as ExchangePairAddresses returned it. Returns the peer
// ranks whose pair was closed rather than shut down.
std::vector<int> ShutdownGlooPairs(
    gloo::Context& context, const std::vector<std::string>& peer_addresses);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_GLOO_GLOO_PAIRS_H_
