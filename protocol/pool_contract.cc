#include "protocol/pool_contract.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ragshard::pool {

bool InRankMemory(const std::string& name) {
  return absl::StartsWith(name, kOptimizer) || absl::StartsWith(name, kJournalUndo);
}

std::string ShardName(int64_t unit) { return absl::StrCat(kShard, unit); }

std::string CopyName(int64_t step, const std::string& rest) {
  return absl::StrCat(kCopy, step, "/", rest);
}

std::string PoolContractJson() {
  // Every name is a plain identifier-and-slash string: no escaping needed.
  return absl::StrCat(
      "{\"prefixes\": {\"shard\": \"", kShard, "\", \"journal\": \"", kJournal,
      "\", \"optimizer\": \"", kOptimizer, "\", \"shrink\": \"", kShrink, "\", \"copy\": \"", kCopy,
      "\"}, \"names\": {\"journal_meta\": \"", kJournalMeta, "\", \"journal_manifest\": \"",
      kJournalManifest, "\", \"journal_held\": \"", kJournalHeld, "\", \"journal_undo\": \"",
      kJournalUndo, "\", \"shrink_taken\": \"", kShrinkTaken, "\", \"shrink_recut\": \"",
      kShrinkRecut, "\", \"shrink_in_place\": \"", kShrinkInPlace, "\", \"shrink_steps\": \"",
      kShrinkSteps, "\", \"copy_directory\": \"", kCopyDirectory,
      "\", \"copy_directory_bytes\": \"", kCopyDirectoryBytes,
      "\"}, \"journal_meta\": {\"fields\": ", kJournalMetaFields,
      ", \"committed\": ", kJournalCommitted, ", \"begun\": ", kJournalBegun,
      ", \"base\": ", kJournalBase, ", \"base_before\": ", kJournalBaseBefore, "}}");
}

}  // namespace ragshard::pool
