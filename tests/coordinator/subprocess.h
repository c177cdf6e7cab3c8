// Spawns a real binary (hsdp-coordinator, hsdpctl) for end-to-end tests:
// fork/exec with stdout and stderr captured through pipes. Header-only so each
// e2e test binary just includes it.
#ifndef HSDP_TESTS_COORDINATOR_SUBPROCESS_H_
#define HSDP_TESTS_COORDINATOR_SUBPROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace hsdp::testing {

// Output and exit status of a finished process.
struct RunResult {
  int exit_code = -1;  // -1 when killed by a signal
  std::string out;
  std::string err;
};

// One child process. Not thread-safe; owned by one test thread.
class Subprocess {
 public:
  // env entries "NAME=VALUE" are added to (and override) the test's
  // environment.
  Subprocess(std::vector<std::string> argv, std::vector<std::string> env = {}) {
    int out_pipe[2], err_pipe[2];
    if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) std::abort();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out_pipe[1], 1);
      dup2(err_pipe[1], 2);
      close(out_pipe[0]);
      close(err_pipe[0]);
      for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);
    out_fd_ = out_pipe[0];
    err_fd_ = err_pipe[0];
    fcntl(out_fd_, F_SETFL, O_NONBLOCK);
    fcntl(err_fd_, F_SETFL, O_NONBLOCK);
  }
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
    close(out_fd_);
    close(err_fd_);
  }

  pid_t pid() const { return pid_; }

  // Reads stdout until a line starting with `prefix` appears; returns that line
  // (without the newline), or "" after `timeout` or when the process closes
  // stdout.
  std::string WaitForLine(
      const std::string& prefix,
      std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    size_t scanned = 0;
    while (true) {
      for (size_t nl; (nl = out_.find('\n', scanned)) != std::string::npos;
           scanned = nl + 1) {
        std::string line = out_.substr(scanned, nl - scanned);
        if (line.rfind(prefix, 0) == 0) return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
      poll(fds, 2, static_cast<int>(left.count()));
      const bool open = Drain(out_fd_, &out_);
      Drain(err_fd_, &err_);
      if (!open && out_.find('\n', scanned) == std::string::npos) return "";
    }
  }

  void Signal(int sig) { kill(pid_, sig); }

  // Waits for exit (reading all output). Returns the exit code, -1 if killed by
  // a signal.
  RunResult Wait() {
    while (true) {
      pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
      poll(fds, 2, 100);
      const bool out_open = Drain(out_fd_, &out_);
      const bool err_open = Drain(err_fd_, &err_);
      if (!out_open && !err_open) break;
    }
    int status = 0;
    waitpid(pid_, &status, 0);
    exited_ = true;
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = out_;
    r.err = err_;
    return r;
  }

  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

 private:
  // Appends what is readable now; false once the pipe is closed.
  static bool Drain(int fd, std::string* into) {
    char buf[4096];
    while (true) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n > 0) {
        into->append(buf, static_cast<size_t>(n));
        continue;
      }
      return n < 0 && (errno == EAGAIN || errno == EINTR);  // else EOF or error
    }
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  bool exited_ = false;
  std::string out_;
  std::string err_;
};

// Runs a command to completion.
inline RunResult RunCommand(std::vector<std::string> argv,
                            std::vector<std::string> env = {}) {
  Subprocess p(std::move(argv), std::move(env));
  return p.Wait();
}

// A scratch directory under $TEST_TMPDIR (or /tmp), removed with everything in
// it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern =
        std::string(base != nullptr ? base : "/tmp") + "/hsdp-test-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { RunCommand({"/bin/rm", "-rf", path_}); }
  const std::string& path() const { return path_; }
  // Writes `contents` to path()/name and returns the full path.
  std::string Write(const std::string& name,
                    const std::string& contents) const {
    const std::string file = path_ + "/" + name;
    FILE* f = fopen(file.c_str(), "w");
    if (f == nullptr) std::abort();
    fwrite(contents.data(), 1, contents.size(), f);
    fclose(f);
    return file;
  }

 private:
  std::string path_;
};

// A running hsdp-coordinator; address() is "127.0.0.1:PORT" once it printed
// "listening on".
class CoordinatorProcess {
 public:
  // `args` are appended to the binary and "--listen 127.0.0.1:0
  // --metrics-listen ''".
  CoordinatorProcess(const std::string& binary, std::vector<std::string> args,
                     std::vector<std::string> env = {})
      : process_(WithDefaults(binary, std::move(args)), std::move(env)) {
    const std::string line = process_.WaitForLine("listening on ");
    if (!line.empty())
      address_ = line.substr(std::string("listening on ").size());
  }
  const std::string& address() const { return address_; }
  Subprocess& process() { return process_; }

 private:
  static std::vector<std::string> WithDefaults(const std::string& binary,
                                               std::vector<std::string> args) {
    std::vector<std::string> argv = {binary, "--listen", "127.0.0.1:0",
                                     "--metrics-listen", ""};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  Subprocess process_;
  std::string address_;
};

}  // namespace hsdp::testing

#endif  // HSDP_TESTS_COORDINATOR_SUBPROCESS_H_
