#include "worker/comm/gloo/gloo_pairs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gloo/context.h"
#include "gloo/transport/address.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/address.h"

namespace hsdp::comm {
namespace {

// Abort() unblocks a collective stuck in Gloo by shutting down (both ways)
// the TCP sockets of this rank's pairs: the device thread then reads EOF, and
// Gloo's own connection-lost path fails every pending operation of the pair
// (waking the blocked waiter) and closes it; the peer reads EOF too and fails
// at once. Debian's Gloo (2022-05) offers no public abort that wakes a local
// waiter: Context::closeConnections() and Pair::close() close the sockets
// without failing the pending operations (a local wait runs into its
// timeout), UnboundBuffer::abortWaitRecv/abortWaitSend reach only buffers the
// caller created (Gloo's algorithms create theirs inside), and the path Gloo
// takes on an application timeout (tcp::Pair::signalExceptionExternal) is
// protected, in a header whose include (gloo/common/memory.h) is missing from
// the package. The sockets are found among /proc/self/fd by both ends'
// addresses, checked on a dup()ed descriptor, so a number reused meanwhile is
// never shut down by mistake.
using SocketEnds = std::pair<std::string, std::string>;

// Shuts down every socket whose (local, remote) address pair, in Gloo's
// Address::str() form, is in `ends`; returns those it shut down.
std::set<SocketEnds> ShutdownSockets(const std::set<SocketEnds>& ends) {
  std::set<SocketEnds> found;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return found;
  while (const dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir)) continue;
    const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) continue;
    // Both ends are read once and formatted from what was read: Gloo's
    // Address::fromPeerName() asks again and throws when the socket has lost
    // its peer in between (another rank of this process aborting, or Gloo
    // closing the pair), and nothing may throw out of an abort.
    struct stat st;
    sockaddr_storage local, remote;
    socklen_t local_len = sizeof(local), remote_len = sizeof(remote);
    if (fstat(own, &st) == 0 && S_ISSOCK(st.st_mode) &&
        getsockname(own, reinterpret_cast<sockaddr*>(&local), &local_len) ==
            0 &&
        (local.ss_family == AF_INET || local.ss_family == AF_INET6) &&
        getpeername(own, reinterpret_cast<sockaddr*>(&remote), &remote_len) ==
            0 &&
        remote.ss_family == local.ss_family) {
      SocketEnds key(gloo::transport::tcp::Address(local).str(),
                     gloo::transport::tcp::Address(remote).str());
      if (ends.count(key) > 0 && shutdown(own, SHUT_RDWR) == 0) {
        found.insert(std::move(key));
      }
    }
    close(own);
  }
  closedir(dir);
  return found;
}

// "[10.0.0.5]" of "[10.0.0.5]:4242" (Gloo's address format), "" if none.
std::string HostOf(const std::string& address) {
  const size_t end = address.find(']');
  return end == std::string::npos ? "" : address.substr(0, end + 1);
}

constexpr char kPairAddressesKey[] = "pair_addresses";

}  // namespace

// Gloo names a lost peer only by the TCP address of its end of the pair, so
// the ranks tell each other theirs.
absl::StatusOr<std::vector<std::string>> ExchangePairAddresses(
    Store& store, const std::string& prefix, gloo::Context& context,
    absl::Duration timeout) {
  std::vector<std::string> mine(context.size), theirs(context.size);
  if (context.size == 1) return theirs;
  for (int p = 0; p < context.size; ++p) {
    if (p != context.rank) mine[p] = context.getPair(p)->address().str();
  }
  auto key = [&prefix](int r) {
    return absl::StrCat(prefix, "/", kPairAddressesKey, "/", r);
  };
  absl::Status status = store.Set(key(context.rank), absl::StrJoin(mine, "\n"));
  if (!status.ok()) return status;
  for (int p = 0; p < context.size; ++p) {
    if (p == context.rank) continue;
    absl::StatusOr<std::string> value = store.Get(key(p), timeout);
    if (!value.ok()) return value.status();
    std::vector<std::string> lines = absl::StrSplit(*value, '\n');
    if (lines.size() != static_cast<size_t>(context.size)) {
      return absl::InternalError(
          absl::StrCat("malformed store value for ", key(p)));
    }
    theirs[p] = lines[context.rank];
  }
  return theirs;
}

int FindPeerInGlooError(const std::string& text,
                        const std::vector<std::string>& peer_addresses) {
  const int size = static_cast<int>(peer_addresses.size());
  for (int p = 0; p < size; ++p) {
    if (!peer_addresses[p].empty() &&
        absl::StrContains(text, peer_addresses[p])) {
      return p;
    }
  }
  // The accepting end of a pair knows the peer by its ephemeral port, which no
  // one published; the host alone still names the peer when it is unique.
  int found = -1;
  for (int p = 0; p < size; ++p) {
    const std::string host = HostOf(peer_addresses[p]);
    if (host.empty() || !absl::StrContains(text, host + ":")) continue;
    if (found >= 0) return -1;  // several peers on that host
    found = p;
  }
  return found;
}

// Abort() unblocks a collective stuck in Gloo this way because Debian's Gloo
// offers no public abort that wakes a local waiter (see ShutdownSockets).
std::vector<int> ShutdownGlooPairs(
    gloo::Context& context, const std::vector<std::string>& peer_addresses) {
  std::vector<SocketEnds> pair_ends(context.size);
  std::set<SocketEnds> ends;
  for (int p = 0; p < context.size; ++p) {
    if (p == context.rank || peer_addresses[p].empty()) continue;
    pair_ends[p] =
        SocketEnds(context.getPair(p)->address().str(), peer_addresses[p]);
    ends.insert(pair_ends[p]);
  }
  const std::set<SocketEnds> shut = ShutdownSockets(ends);
  std::vector<int> closed;
  for (int p = 0; p < context.size; ++p) {
    // A socket not found (no /proc, or Gloo closed it after an error):
    // closing the pair still tells the peer; a local wait on it, if any, then
    // ends at its timeout.
    if (p != context.rank && shut.count(pair_ends[p]) == 0) {
      context.getPair(p)->close();
      closed.push_back(p);
    }
  }
  return closed;
}

}  // namespace hsdp::comm
