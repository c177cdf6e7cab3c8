#include "coordinator/service/http_server.h"

#include <CivetServer.h>
#include <civetweb.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace hsdp::coordinator {
namespace {

constexpr int kStatusNotFound = 404;
constexpr int kStatusMethodNotAllowed = 405;
constexpr int kStatusBadRequest = 400;
constexpr int kStatusPayloadTooLarge = 413;
constexpr size_t kReadChunkBytes = 4096;
constexpr auto kWakeInterval = std::chrono::milliseconds(20);

HttpResponse PlainError(int status, std::string message) {
  HttpResponse response;
  response.status = status;
  response.body = std::move(message) + "\n";
  return response;
}

void WriteResponse(mg_connection* conn, const HttpRequest& request,
                   const HttpResponse& response) {
  std::string head =
      absl::StrCat("HTTP/1.1 ", response.status, " ",
                   mg_get_response_code_text(conn, response.status),
                   "\r\nContent-Type: ", response.content_type,
                   "\r\nContent-Length: ", response.body.size(), "\r\n");
  for (const auto& [name, value] : response.headers) {
    absl::StrAppend(&head, name, ": ", value, "\r\n");
  }
  // civetweb closes every connection after one request (keep-alive is off).
  absl::StrAppend(&head, "Connection: close\r\n\r\n");
  mg_write(conn, head.data(), head.size());
  if (request.method != "HEAD" && !response.body.empty()) {
    mg_write(conn, response.body.data(), response.body.size());
  }
}

// The host part of "HOST:PORT" ("[::1]:80" -> "::1"), with a wildcard or
// missing host replaced by the loopback address of its family.
std::string ConnectableHost(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    return host == "::" ? "::1" : host;
  }
  return host.empty() || host == "0.0.0.0" ? "127.0.0.1" : host;
}

// Opens and closes one TCP connection to host:port, ignoring failures.
void Poke(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) !=
      0) {
    return;
  }
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

std::string QueryParam(const std::string& query, const std::string& name) {
  for (absl::string_view pair : absl::StrSplit(query, '&')) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(pair, absl::MaxSplits('=', 1));
    if (kv.first == name) return std::string(kv.second);
  }
  return "";
}

// One path: its handlers by method. Thread-safe (Dispatch runs on civetweb's
// threads while Add may be called from the owner's).
class HttpServer::Route final : public CivetHandler {
 public:
  Route(std::string path, size_t max_body_bytes)
      : path_(std::move(path)), max_body_bytes_(max_body_bytes) {}

  void Add(const std::string& method, HttpHandler handler)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    handlers_[method] = std::move(handler);
  }

  bool handleGet(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handlePost(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handleHead(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handlePut(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handleDelete(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handleOptions(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }
  bool handlePatch(CivetServer*, mg_connection* conn) override {
    return Dispatch(conn);
  }

 private:
  bool Dispatch(mg_connection* conn) ABSL_LOCKS_EXCLUDED(mu_) {
    const mg_request_info* info = mg_get_request_info(conn);
    HttpRequest request;
    request.method = info->request_method ? info->request_method : "";
    request.path = info->local_uri ? info->local_uri : "";
    request.query = info->query_string ? info->query_string : "";
    if (const char* auth = mg_get_header(conn, "Authorization")) {
      request.authorization = auth;
    }
    WriteResponse(conn, request, Serve(conn, info, request));
    return true;
  }

  HttpResponse Serve(mg_connection* conn, const mg_request_info* info,
                     HttpRequest& request) ABSL_LOCKS_EXCLUDED(mu_) {
    // civetweb also routes "path/anything" here.
    if (request.path != path_) {
      return PlainError(kStatusNotFound,
                        absl::StrCat(request.path, ": not found"));
    }
    HttpHandler handler;
    std::vector<std::string> allowed;
    {
      absl::MutexLock lock(&mu_);
      const std::string lookup =
          request.method == "HEAD" ? std::string("GET") : request.method;
      auto it = handlers_.find(lookup);
      if (it != handlers_.end()) handler = it->second;
      for (const auto& [method, unused] : handlers_) allowed.push_back(method);
    }
    if (!handler) {
      HttpResponse response = PlainError(
          kStatusMethodNotAllowed,
          absl::StrCat(request.method, " ", request.path, ": not allowed"));
      response.headers.emplace_back("Allow", absl::StrJoin(allowed, ", "));
      return response;
    }
    if (info->content_length > static_cast<long long>(max_body_bytes_)) {
      return PlainError(kStatusPayloadTooLarge,
                        absl::StrCat("request body: ", info->content_length,
                                     " bytes is more than ", max_body_bytes_));
    }
    char chunk[kReadChunkBytes];
    for (int n; (n = mg_read(conn, chunk, sizeof(chunk))) > 0;) {
      request.body.append(chunk, static_cast<size_t>(n));
      if (request.body.size() > max_body_bytes_) {
        return PlainError(kStatusPayloadTooLarge,
                          absl::StrCat("request body: more than ",
                                       max_body_bytes_, " bytes"));
      }
    }
    if (info->content_length > 0 &&
        request.body.size() != static_cast<size_t>(info->content_length)) {
      return PlainError(kStatusBadRequest, "request body: truncated");
    }
    return handler(request);
  }

  const std::string path_;
  const size_t max_body_bytes_;
  absl::Mutex mu_;
  std::map<std::string, HttpHandler> handlers_ ABSL_GUARDED_BY(mu_);
};

HttpServer::HttpServer(size_t max_body_bytes)
    : max_body_bytes_(max_body_bytes) {}

HttpServer::~HttpServer() {
  if (server_ == nullptr) return;
  // civetweb's accept loop notices the stop only when its poll returns: a
  // connection now and then makes that at once instead of after 2 s.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Poke(wake_host_, port_);
      std::this_thread::sleep_for(kWakeInterval);
    }
  });
  // Stop serving (joining civetweb's threads) before the routes are freed.
  server_.reset();
  stopped.store(true);
  waker.join();
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const Options& options) {
  std::unique_ptr<HttpServer> server(new HttpServer(options.max_body_bytes));
  const std::vector<std::string> civet_options = {
      "listening_ports", options.listen,  //
      "num_threads", std::to_string(options.num_threads)};
  try {
    server->server_ = std::make_unique<CivetServer>(civet_options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, ": ", e.what()));
  }
  const std::vector<int> ports = server->server_->getListeningPorts();
  if (ports.empty() || ports.front() <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, ": no port bound"));
  }
  server->port_ = ports.front();
  server->wake_host_ = ConnectableHost(options.listen);
  return server;
}

void HttpServer::Handle(const std::string& method, const std::string& path,
                        HttpHandler handler) {
  absl::MutexLock lock(&mu_);
  auto it = routes_.find(path);
  if (it == routes_.end()) {
    it = routes_.emplace(path, std::make_unique<Route>(path, max_body_bytes_))
             .first;
    it->second->Add(method, std::move(handler));
    server_->addHandler(path, it->second.get());
    return;
  }
  it->second->Add(method, std::move(handler));
}

}  // namespace hsdp::coordinator
