#include "bench/provenance.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace ragshard::bench {
namespace {

constexpr size_t kShown = 3;  // dirty paths named in the header; the rest counted

// `git -C dir <args>`'s stdout; false unless it exited 0.
bool Git(const std::string& dir, const std::string& args, std::string* out) {
  std::string quoted = "'";
  for (char c : dir) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  const std::string cmd = absl::StrCat("git -C ", quoted, "' ", args, " 2>/dev/null");
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return false;
  out->clear();
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) out->append(buf, n);
  return pclose(f) == 0;
}

}  // namespace

std::string RepositoryRoot(const std::string& report_path) {
  std::string top;
#ifdef RAGSHARD_SOURCE_DIR
  if (Git(RAGSHARD_SOURCE_DIR, "rev-parse --show-toplevel", &top)) {
    return std::string(absl::StripAsciiWhitespace(top));
  }
#endif
  const auto dir = std::filesystem::absolute(report_path).parent_path();
  if (Git(dir.string(), "rev-parse --show-toplevel", &top)) {
    return std::string(absl::StripAsciiWhitespace(top));
  }
  return "";
}

bool TakeAllowDirty(int* argc, char** argv) {
  bool found = false;
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    if (std::string(argv[i]) == "--allow-dirty") {
      found = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  *argc = kept;
  return found;
}

bool RequireProvenance(const char* program, const std::string& report_path, bool allow_dirty,
                       std::vector<std::string>* header) {
  const std::string name = std::filesystem::path(program).filename().string();
  const std::string root = RepositoryRoot(report_path);
  std::string status, head;
  if (root.empty() || !Git(root, "status --porcelain=v1 -z", &status) ||
      !Git(root, "rev-parse HEAD", &head)) {
    std::cerr << name << ": git could not name the commit of "
              << (root.empty() ? report_path : root) << "\n";
    return false;
  }
  // The paths `git status` reports, ignored files left out.
  std::vector<std::string> items = absl::StrSplit(status, '\0'), paths;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].empty()) continue;
    paths.push_back(items[i].size() > 3 ? items[i].substr(3) : "");
    if (items[i][0] == 'R' || items[i][0] == 'C') ++i;  // a rename or copy: its source follows
  }
  if (!paths.empty() && !allow_dirty) {
    std::cerr << name
              << ": the tree has uncommitted changes, so the report could not name the commit "
                 "its figures come from:\n  "
              << absl::StrJoin(paths, "\n  ")
              << "\ncommit them, or run again with --allow-dirty (the header then says dirty)\n";
    return false;
  }
  std::string state = absl::StrCat(absl::StripAsciiWhitespace(head), " (clean)");
  if (!paths.empty()) {
    const std::vector<std::string> shown(paths.begin(),
                                         paths.begin() + std::min(paths.size(), kShown));
    state = absl::StrCat(
        absl::StripAsciiWhitespace(head), " (dirty: ", absl::StrJoin(shown, ", "),
        paths.size() > kShown ? absl::StrCat(" and ", paths.size() - kShown, " more") : "", ")");
  }
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[64];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", &utc);
  *header = {absl::StrCat("commit: ", state), "", absl::StrCat("date: ", date)};
  return true;
}

std::string Stamp(const std::string& markdown, const std::vector<std::string>& header) {
  std::vector<std::string> rows = absl::StrSplit(markdown, '\n'), out;
  size_t at = 0;
  while (at < rows.size() && rows[at].rfind("# ", 0) != 0) ++at;
  if (at == rows.size()) {
    out = header;
    out.push_back("");
    out.insert(out.end(), rows.begin(), rows.end());
    return absl::StrJoin(out, "\n");
  }
  size_t end = at + 1;
  while (end < rows.size() &&
         (absl::StripAsciiWhitespace(rows[end]).empty() || rows[end].rfind("commit: ", 0) == 0 ||
          rows[end].rfind("date: ", 0) == 0)) {
    ++end;
  }
  out.assign(rows.begin(), rows.begin() + at + 1);
  out.push_back("");
  out.insert(out.end(), header.begin(), header.end());
  out.push_back("");
  out.insert(out.end(), rows.begin() + end, rows.end());
  return absl::StrJoin(out, "\n");
}

}  // namespace ragshard::bench
