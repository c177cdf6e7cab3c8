// Throwaway certificates for TLS tests, made with the openssl command line: a
// CA, a server certificate for 127.0.0.1 / localhost, a client certificate the
// CA signed, and a "rogue" client certificate from a second CA nobody trusts.
// EC P-256 keys, valid for one day.
#ifndef HSDP_TESTS_COMMON_TEST_CERTS_H_
#define HSDP_TESTS_COMMON_TEST_CERTS_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace hsdp::testing {

// PEM contents.
struct TestCerts {
  std::string ca;
  std::string server_cert;
  std::string server_key;
  std::string client_cert;
  std::string client_key;
  std::string rogue_cert;
  std::string rogue_key;
  // Where the files live (ca.pem, server.pem, ...), for binaries' flags.
  std::string dir;
};

namespace certs_internal {

inline absl::Status Run(const std::string& command) {
  const std::string quiet = absl::StrCat(command, " >/dev/null 2>&1");
  if (std::system(quiet.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("failed: ", command));
  }
  return absl::OkStatus();
}

inline absl::StatusOr<std::string> Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A CA named `name` in dir/<name>.pem + .key.
inline absl::Status MakeCa(const std::string& dir, const std::string& name) {
  return Run(absl::StrCat(
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
      "-nodes -days 1 -subj /CN=hsdp-test-",
      name, " -addext basicConstraints=critical,CA:TRUE",
      " -addext keyUsage=critical,keyCertSign,cRLSign -keyout ", dir, "/", name,
      ".key -out ", dir, "/", name, ".pem"));
}

// A leaf certificate dir/<name>.pem + .key signed by CA `ca`, with the
// extensions in `ext` (openssl extfile syntax).
inline absl::Status MakeLeaf(const std::string& dir, const std::string& name,
                             const std::string& ca, const std::string& ext) {
  const std::string ext_file = absl::StrCat(dir, "/", name, ".ext");
  std::ofstream(ext_file) << ext << "\n";
  if (absl::Status s = Run(absl::StrCat(
          "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
          "-nodes -subj /CN=",
          name, " -keyout ", dir, "/", name, ".key -out ", dir, "/", name,
          ".csr"));
      !s.ok()) {
    return s;
  }
  return Run(absl::StrCat("openssl x509 -req -days 1 -in ", dir, "/", name,
                          ".csr -CA ", dir, "/", ca, ".pem -CAkey ", dir, "/",
                          ca, ".key -CAcreateserial -extfile ", ext_file,
                          " -out ", dir, "/", name, ".pem"));
}

}  // namespace certs_internal

// Writes the certificates into `dir` (created) and returns them.
inline absl::StatusOr<TestCerts> MakeTestCerts(const std::string& dir) {
  namespace ci = certs_internal;
  std::filesystem::create_directories(dir);
  for (const char* ca : {"ca", "rogue-ca"}) {
    if (absl::Status s = ci::MakeCa(dir, ca); !s.ok()) return s;
  }
  const struct {
    const char* name;
    const char* ca;
    const char* ext;
  } leaves[] = {
      {"server", "ca",
       "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
       "extendedKeyUsage=serverAuth"},
      {"client", "ca", "extendedKeyUsage=clientAuth"},
      {"rogue", "rogue-ca", "extendedKeyUsage=clientAuth"},
  };
  for (const auto& leaf : leaves) {
    if (absl::Status s = ci::MakeLeaf(dir, leaf.name, leaf.ca, leaf.ext);
        !s.ok()) {
      return s;
    }
  }
  TestCerts certs;
  certs.dir = dir;
  const std::pair<std::string*, const char*> files[] = {
      {&certs.ca, "ca.pem"},
      {&certs.server_cert, "server.pem"},
      {&certs.server_key, "server.key"},
      {&certs.client_cert, "client.pem"},
      {&certs.client_key, "client.key"},
      {&certs.rogue_cert, "rogue.pem"},
      {&certs.rogue_key, "rogue.key"}};
  for (const auto& [pem, name] : files) {
    absl::StatusOr<std::string> contents =
        ci::Read(absl::StrCat(dir, "/", name));
    if (!contents.ok()) return contents.status();
    *pem = *std::move(contents);
  }
  return certs;
}

}  // namespace hsdp::testing

#endif  // HSDP_TESTS_COMMON_TEST_CERTS_H_
