#include "server/daemon/comm.h"

#include "absl/strings/str_cat.h"

namespace ragshard::daemon {
namespace {

const char* KindName(uint32_t kind) {
  // By MessageStamp::Kind.
  static const char* const kNames[] = {
      "a collective",    "all-gather",         "reduce-scatter",       "all-reduce",
      "gather-to-owner", "scatter-from-owner", "an unknown operation", "a control message"};
  return kNames[kind & 7];
}

}  // namespace

std::string DescribeTag(uint64_t tag) {
  const MessageStamp s = MessageStamp::FromTag(tag);
  return absl::StrCat(KindName(s.kind), " of unit ", s.unit, " (operation ", s.seq, ", message ",
                      s.index, ")");
}

absl::Status MismatchError(int self, int peer, uint64_t sent_tag, size_t sent_bytes,
                           uint64_t want_tag, size_t want_bytes, const TagDescriber& describe) {
  const std::string mine = describe ? describe(want_tag) : DescribeTag(want_tag);
  if (sent_tag != want_tag) {
    const std::string theirs = describe ? describe(sent_tag) : DescribeTag(sent_tag);
    return absl::AbortedError(absl::StrCat(
        "the ranks disagree on an operation: node ", peer, " sent a message of ", theirs, " (",
        sent_bytes, " bytes) where node ", self, " runs ", mine, " (", want_bytes, " bytes)"));
  }
  return absl::AbortedError(absl::StrCat("the ranks disagree on a size: node ", peer, " sent ",
                                         sent_bytes, " bytes for ", mine, " where node ", self,
                                         " expects ", want_bytes));
}

}  // namespace ragshard::daemon
