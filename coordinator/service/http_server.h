// A small HTTP/1.1 server for the coordinator's metrics port: Prometheus'
// /metrics and the dashboard. It runs on civetweb, the server prometheus-cpp's
// own exposer embeds, so the port behaves as it did when only /metrics was
// served. Routes are exact paths; handlers are plain functions from a buffered
// request to a buffered response (every body here is small).
#ifndef HSDP_COORDINATOR_SERVICE_HTTP_SERVER_H_
#define HSDP_COORDINATOR_SERVICE_HTTP_SERVER_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

class CivetServer;

namespace hsdp::coordinator {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // URL-decoded, without the query
  std::string query;   // after '?', as sent (not decoded); "" when absent
  std::string body;
  // The Authorization header's value; "" when absent.
  std::string authorization;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  // Extra headers, e.g. {"Cache-Control", "no-store"}.
  std::vector<std::pair<std::string, std::string>> headers;
};

// Must be thread-safe: the server calls handlers from several threads at once.
using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

// The value of `name` in a query string "a=1&b=2", or "" (no decoding: the
// values used here are numbers).
std::string QueryParam(const std::string& query, const std::string& name);

// Thread-safe: Handle() may be called while the server runs (a path without a
// handler yet answers 404); handlers run on the server's threads. Destruction
// stops the server and waits for running handlers to return, so whatever the
// handlers use must outlive the server.
class HttpServer {
 public:
  struct Options {
    // HOST:PORT; port 0 picks a free port (see port()). IPv6: "[::]:9090".
    std::string listen;
    // Concurrent requests served (a scrape and a few dashboard polls).
    int num_threads = 4;
    // Larger request bodies are refused with 413 before being read.
    size_t max_body_bytes = 64 * 1024;
  };

  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const Options& options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port.
  int port() const { return port_; }

  // Serves `method` requests for exactly `path` (and "path/..." is 404). Other
  // methods on a known path answer 405 with an Allow header. Registering the
  // same method and path twice replaces the handler.
  void Handle(const std::string& method, const std::string& path,
              HttpHandler handler) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Route;

  explicit HttpServer(size_t max_body_bytes);

  const size_t max_body_bytes_;
  int port_ = 0;
  // Where a connection reaches the listener (loopback for a wildcard address):
  // stopping civetweb waits for its accept loop's 2-second poll unless a
  // connection wakes it.
  std::string wake_host_;
  absl::Mutex mu_;
  // Owned here; civetweb keeps raw pointers. Declared before server_ so the
  // server (and its threads) stop before the routes go away.
  std::map<std::string, std::unique_ptr<Route>> routes_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<CivetServer> server_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_HTTP_SERVER_H_
