// A blocking HTTP/1.0 client for tests of the coordinator's metrics port: one
// request per connection to 127.0.0.1, the whole response read back.
#ifndef HSDP_TESTS_COORDINATOR_HTTP_TEST_CLIENT_H_
#define HSDP_TESTS_COORDINATOR_HTTP_TEST_CLIENT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hsdp::testing {

struct HttpResult {
  // 0 when the connection failed or the response was unreadable.
  int status = 0;
  // Lower-case names.
  std::map<std::string, std::string> headers;
  std::string body;
  // Status line, headers and body as received.
  std::string raw;
};

inline HttpResult HttpRequestTo(
    int port, const std::string& method, const std::string& path,
    const std::map<std::string, std::string>& headers = {},
    const std::string& body = "") {
  HttpResult result;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return result;
  }
  std::string request = absl::StrCat(method, " ", path,
                                     " HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                                     "Connection: close\r\n");
  for (const auto& [name, value] : headers) {
    absl::StrAppend(&request, name, ": ", value, "\r\n");
  }
  if (!body.empty() || method == "POST") {
    absl::StrAppend(&request, "Content-Length: ", body.size(), "\r\n");
  }
  absl::StrAppend(&request, "\r\n", body);
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = write(fd, request.data() + sent, request.size() - sent);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;)
    result.raw.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t head_end = result.raw.find("\r\n\r\n");
  if (head_end == std::string::npos) return result;
  result.body = result.raw.substr(head_end + 4);
  bool first = true;
  for (absl::string_view line : absl::StrSplit(
           absl::string_view(result.raw).substr(0, head_end), "\r\n")) {
    if (first) {
      first = false;
      // "HTTP/1.1 200 OK"
      std::pair<absl::string_view, absl::string_view> parts =
          absl::StrSplit(line, absl::MaxSplits(' ', 1));
      result.status = std::atoi(std::string(parts.second).c_str());
      continue;
    }
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(line, absl::MaxSplits(':', 1));
    result.headers[absl::AsciiStrToLower(kv.first)] =
        std::string(absl::StripAsciiWhitespace(kv.second));
  }
  return result;
}

inline std::string HttpGet(int port, const std::string& path) {
  return HttpRequestTo(port, "GET", path).raw;
}

}  // namespace hsdp::testing

#endif  // HSDP_TESTS_COORDINATOR_HTTP_TEST_CLIENT_H_
