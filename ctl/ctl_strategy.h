// `ragshardctl advise` and `ragshardctl simulate`: the strategy search and the scale simulator
// of engine/strategy.h on the command line. Offline: they need no server.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace ragshard {

struct StrategyFlags {
  std::string model;
  std::string inventory;
  std::string cluster;
  int64_t world = 0;  // 0: the profile's
  std::string granule;
  int64_t align_bytes = 16;
  std::string memory_budget;  // bytes, or with a suffix: 80GiB, 64GB
  std::string optimizer = "adam";
  int64_t tokens_per_step = int64_t{4} << 20;
  int64_t micro_batch_tokens = 4096;
  double mfu = 0;
  double flops_per_token = 0;
  double max_padding_pct = 1.0;
  int top = 5;
  std::vector<int64_t> layers_per_unit;
  bool executable = false;
  bool json = false;
  int max_rejected = 20;
  // simulate
  std::string strategy;
  std::string png;
  int width = 100;
};

void AddAdviseFlags(CLI::App* cmd, StrategyFlags* f);
void AddSimulateFlags(CLI::App* cmd, StrategyFlags* f);
int RunAdvise(const StrategyFlags& f, std::ostream& out, std::ostream& err);
int RunSimulate(const StrategyFlags& f, std::ostream& out, std::ostream& err);

// "80GiB", "64GB", "1048576" -> bytes; errors name the value.
bool ParseByteSize(const std::string& text, int64_t* bytes);

}  // namespace ragshard
