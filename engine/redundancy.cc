#include "engine/redundancy.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ragshard {

int64_t Redundancy::min_nodes() const {
  switch (kind) {
    case Kind::kParity:
      return k + 1;
    case Kind::kReplica:
    case Kind::kHsdp:
      return 2;
    case Kind::kNone:
      break;
  }
  return 1;
}

std::string Redundancy::name() const {
  switch (kind) {
    case Kind::kParity:
      return absl::StrCat("parity:", k);
    case Kind::kReplica:
      return "replica";
    case Kind::kHsdp:
      return "hsdp";
    case Kind::kNone:
      break;
  }
  return "none";
}

absl::StatusOr<Redundancy> ParseRedundancy(absl::string_view field, absl::string_view value) {
  Redundancy r;
  if (value.empty() || value == "none") return r;
  if (value == "replica") {
    r.kind = Redundancy::Kind::kReplica;
    return r;
  }
  if (value == "hsdp") {
    r.kind = Redundancy::Kind::kHsdp;
    return r;
  }
  constexpr absl::string_view kParity = "parity:";
  int k = 0;
  // SimpleAtoi accepts a sign and spaces; K is digits only.
  if (absl::StartsWith(value, kParity)) {
    const absl::string_view digits = value.substr(kParity.size());
    const bool plain = !digits.empty() && digits.size() <= 2 &&
                       digits.find_first_not_of("0123456789") == absl::string_view::npos;
    if (plain && absl::SimpleAtoi(digits, &k) && k >= 1 && k <= kMaxParityK) {
      r.kind = Redundancy::Kind::kParity;
      r.k = k;
      return r;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": '", value, "' is not a redundancy: use none, replica, hsdp or parity:K (K in [1, ",
      kMaxParityK, "])"));
}

absl::Status CheckRedundancyNodes(const Redundancy& r, int64_t nodes) {
  const std::string on =
      absl::StrCat("but the job's ranks are on ", nodes, " node", nodes == 1 ? "" : "s");
  switch (r.kind) {
    case Redundancy::Kind::kNone:
      return absl::OkStatus();
    case Redundancy::Kind::kReplica:
    case Redundancy::Kind::kHsdp: {
      if (nodes >= 2) return absl::OkStatus();
      const bool replica = r.kind == Redundancy::Kind::kReplica;
      return absl::FailedPreconditionError(absl::StrCat(
          replica ? "redundancy replica needs at least 2 nodes (each node's state copied on "
                    "another), "
                  : "redundancy hsdp needs the HSDP replicas on at least 2 nodes, ",
          on));
    }
    case Redundancy::Kind::kParity:
      break;
  }
  const int64_t group = r.k + 1;
  if (nodes >= group && nodes % group == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("redundancy parity:", r.k,
                                                    " needs a multiple of K + 1 = ", group,
                                                    " nodes (groups of ", group, "), ", on));
}

absl::Status CheckHsdpLayout(int64_t shard, const std::vector<std::string>& rank_nodes) {
  const int64_t world = static_cast<int64_t>(rank_nodes.size());
  if (shard <= 0 || world % shard != 0) {
    return absl::FailedPreconditionError(absl::StrCat("redundancy hsdp: a shard group of ", shard,
                                                      " ranks does not divide the ", world,
                                                      " ranks"));
  }
  for (int64_t q = 0; q < world; ++q) {
    bool covered = false;
    for (int64_t other = (q + shard) % world; other != q && !covered;
         other = (other + shard) % world) {
      covered = rank_nodes[other] != rank_nodes[q];
    }
    if (!covered) {
      return absl::FailedPreconditionError(absl::StrCat(
          "redundancy hsdp: rank ", q, " on node '", rank_nodes[q],
          "' has no HSDP replica on another node (shard groups of ", shard, " ranks over ", world,
          " ranks): losing that node would lose its shards; place the replica groups on "
          "different nodes, or give another redundancy"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ragshard
