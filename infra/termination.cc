#include "infra/termination.h"

#include <chrono>
#include <csignal>
#include <thread>

namespace ragshard {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

}  // namespace

void WaitForTerminationSignal() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (g_stop == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

}  // namespace ragshard
