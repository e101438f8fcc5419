// Which commit a report's figures come from (issue 51, item 6), for the C++ benchmarks that write
// a report: bench/provenance.py's rules. A run refuses a dirty tree unless given --allow-dirty,
// and writes under its report's title
//
//     commit: <40-hex HEAD> (clean)            or  commit: <40-hex HEAD> (dirty: <paths>)
//     date: <when the run started>
//
// Dirty: `git status --porcelain` lists the path (changed, staged, or untracked and not
// ignored); files git ignores do not count.
#pragma once

#include <string>
#include <vector>

namespace ragshard::bench {

// The flag's usage line.
inline constexpr char kAllowDirtyUsage[] =
    "  --allow-dirty  run on a tree with uncommitted changes; the report's header then says\n"
    "                 `commit: HEAD (dirty: ...)`\n";

// The repository the binary was built from (RAGSHARD_SOURCE_DIR) or, where that is no git
// work tree, the one holding `report_path`; "" when neither is.
std::string RepositoryRoot(const std::string& report_path);

// Removes --allow-dirty from argv (argc updated) and says whether it was there.
bool TakeAllowDirty(int* argc, char** argv);

// The header's Markdown lines ("commit: ...", "", "date: ..."), taken now (before the run writes
// anything); on a dirty tree without `allow_dirty`, or where git cannot name the commit, prints
// why to stderr (as `program`) and returns false: the caller exits 2.
bool RequireProvenance(const char* program, const std::string& report_path, bool allow_dirty,
                       std::vector<std::string>* header);

// "# Title\n" + the rest, with `header` right under the first "# " line (as provenance.stamp).
std::string Stamp(const std::string& markdown, const std::vector<std::string>& header);

}  // namespace ragshard::bench
