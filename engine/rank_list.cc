#include "engine/rank_list.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ragshard {

std::string RankList(absl::Span<const int64_t> ranks) {
  constexpr size_t kShown = 8;
  std::vector<std::string> pieces;
  size_t shown = 0;
  for (size_t i = 0; i < ranks.size() && pieces.size() < kShown;) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j - i < 2) j = i;  // one piece per rank, but for runs of 3 or more
    pieces.push_back(j > i ? absl::StrCat(ranks[i], "-", ranks[j]) : absl::StrCat(ranks[i]));
    shown += j - i + 1;
    i = j + 1;
  }
  std::string out = absl::StrJoin(pieces, ", ");
  if (shown < ranks.size()) absl::StrAppend(&out, " and ", ranks.size() - shown, " more");
  return out;
}

}  // namespace ragshard
