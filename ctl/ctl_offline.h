// ragshardctl's offline planning commands: `plan` (one policy's plan of a model) and `compare`
// (every policy side by side). They need no server.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "CLI/CLI.hpp"

namespace ragshard {

// Where the inventory comes from, and how it is planned.
struct Source {
  std::string model;
  std::string inventory;
  int64_t world = 0;
  std::string granule;
  int64_t align_bytes = 16;
};
void AddSourceFlags(CLI::App* cmd, Source* src);

// Each returns the exit code (ctl/ctl_format.h), with one-line errors on `err`.
int RunPlan(const Source& src, const std::string& policy, bool as_json, int64_t max_segments,
            std::ostream& out, std::ostream& err);
int RunCompare(const Source& src, bool as_json, std::ostream& out, std::ostream& err);

}  // namespace ragshard
