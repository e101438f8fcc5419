#include "server/daemon/op_target.h"

#include "absl/strings/str_cat.h"

namespace ragshard::daemon {

absl::StatusOr<OpRequest> MakeOpRequest(int kind, int unit, int reduce, int64_t keep_ranks,
                                        bool accumulate, int64_t timeout_ms) {
  if (!v1::OpKind_IsValid(kind) || kind == v1::OP_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind: ", kind, " is not an operation (ragshard.v1.OpKind)"));
  }
  if (!v1::ReduceKind_IsValid(reduce)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce: ", reduce, " is not a ragshard.v1.ReduceKind"));
  }
  OpRequest r;
  r.kind = static_cast<v1::OpKind>(kind);
  r.unit = unit;
  r.reduce = static_cast<v1::ReduceKind>(reduce);
  r.keep_ranks = keep_ranks;
  r.accumulate = accumulate;
  r.timeout_ms = timeout_ms;
  return r;
}

absl::StatusOr<OpRequest> MakeOpRequest(const v1::StartRequest& req) {
  return MakeOpRequest(req.kind(), req.unit_index(), req.reduce(), req.keep_ranks(),
                       req.accumulate(), req.timeout_ms());
}

}  // namespace ragshard::daemon
