#include "infra/server_process.h"

#include "absl/synchronization/mutex.h"
#include "glog/logging.h"
#include "infra/open_files.h"

namespace ragshard {

void StartServerProcess(const char* argv0) {
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv0);
  // Debian's Abseil is built with mutex deadlock detection on, which records every lock order in
  // a graph: a tenth of the planner's CPU under 2,048 heartbeats a second. The tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  LOG(INFO) << "open-file limit " << RaiseOpenFileLimit();
}

}  // namespace ragshard
