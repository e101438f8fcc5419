// Test helpers: temporary directories and a ragshard-planner child process on 127.0.0.1:0
// whose bound address is read from its port file.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ragshard::testing {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ragshard_test.XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }
  // A file holding `body`, with permissions `mode` (token files must be 0600).
  std::string File(const std::string& name, const std::string& body, int mode = 0600) const {
    std::string p = path_ + "/" + name;
    std::ofstream(p) << body;
    chmod(p.c_str(), static_cast<mode_t>(mode));
    return p;
  }

 private:
  std::string path_;
};

inline std::string ReadAll(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// A child process; killed (SIGKILL) and reaped by the destructor if still running, and killed
// by the kernel when the thread that started it ends, so that a test that crashes or aborts
// leaves no server behind. (Start children from the test's own thread, not from a thread that
// ends before them.)
class Child {
 public:
  Child() = default;
  explicit Child(std::vector<std::string> argv, const std::string& log = "") {
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent ended before the line above
      if (!log.empty()) {
        FILE* f = std::fopen(log.c_str(), "a");
        if (f) {
          dup2(fileno(f), 1);
          dup2(fileno(f), 2);
        }
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  Child(Child&& o) noexcept : pid_(o.pid_), status_(o.status_) { o.pid_ = -1; }
  Child& operator=(Child&& o) noexcept {
    Kill(SIGKILL);
    pid_ = o.pid_;
    status_ = o.status_;
    o.pid_ = -1;
    return *this;
  }
  ~Child() { Kill(SIGKILL); }
  pid_t pid() const { return pid_; }
  // Sends `sig` and waits; returns the wait status.
  int Kill(int sig) {
    if (pid_ <= 0) return status_;
    ::kill(pid_, sig);
    return Wait();
  }
  // Waits for the child to exit; returns the wait status.
  int Wait() {
    if (pid_ <= 0) return status_;
    waitpid(pid_, &status_, 0);
    pid_ = -1;
    return status_;
  }
  // False once the child has exited (it is reaped then, and Wait() returns its status).
  bool Running() {
    if (pid_ <= 0) return false;
    if (waitpid(pid_, &status_, WNOHANG) == 0) return true;
    pid_ = -1;
    return false;
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
};

// Starts ragshard-planner and waits for its port file. `extra` are additional flags. Without a
// --token-file among them the planner keeps its own token in DATA_DIR/token (secure by default):
// RAGSHARD_TOKEN_FILE is then set to it for this process and its children (the clients, daemons
// and ranks a test starts), and unset otherwise.
struct PlannerProcess {
  Child child;
  std::string address;
  std::string token_file;  // DATA_DIR/token, or empty with --token-file

  static PlannerProcess Start(const std::string& binary, const std::string& data_dir,
                              const std::vector<std::string>& extra = {},
                              const std::string& listen = "127.0.0.1:0") {
    PlannerProcess p;
    const std::string port_file = data_dir + "/port";
    std::remove(port_file.c_str());
    std::vector<std::string> argv = {binary,   "--listen",    listen,   "--data-dir",
                                     data_dir, "--port-file", port_file};
    argv.insert(argv.end(), extra.begin(), extra.end());
    p.child = Child(argv, data_dir + "/planner.log");
    // Up to a minute (a loaded machine, a large store to load); done at the port file.
    for (int i = 0; i < 2400 && p.address.empty() && p.child.Running(); ++i) {
      std::string text = ReadAll(port_file);
      if (!text.empty() && text.back() == '\n') p.address = text.substr(0, text.size() - 1);
      if (p.address.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    const std::string token = data_dir + "/token";
    if (!p.address.empty() && std::ifstream(token).good() &&
        std::find(extra.begin(), extra.end(), "--token-file") == extra.end()) {
      p.token_file = token;
      ::setenv("RAGSHARD_TOKEN_FILE", token.c_str(), 1);
    } else {
      ::unsetenv("RAGSHARD_TOKEN_FILE");
    }
    return p;
  }
};

}  // namespace ragshard::testing
