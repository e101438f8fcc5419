// NodeRedundancy::Rebuild (redundancy.h) in its named steps, and its "hsdp" way.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "infra/status_macros.h"
#include "server/daemon/collectives.h"
#include "server/daemon/redundancy.h"

namespace ragshard::daemon {

// Each node's block: [replacement, its pool's free bytes] then per local rank [blob bytes (-1:
// not kept as it was at the step), has the step's parity, parity bytes, k source blob bytes, k
// source CRCs].
struct NodeRedundancy::Census {
  Census(int nodes, int locals, int k)
      : k(k),
        L(static_cast<size_t>(locals)),
        per_local(3 + 2 * static_cast<size_t>(k)),
        block(2 + L * per_local),
        blocks(static_cast<size_t>(nodes) * block, 0),
        blobs(L),
        replaced(static_cast<size_t>(nodes), false),
        blob(L, std::vector<int64_t>(static_cast<size_t>(nodes))),
        stripes(L) {}

  int64_t& at(int node, size_t l, size_t field) {
    return blocks[static_cast<size_t>(node) * block + 2 + l * per_local + field];
  }
  int64_t at(int node, size_t l, size_t field) const {
    return blocks[static_cast<size_t>(node) * block + 2 + l * per_local + field];
  }
  int64_t& head(int node, size_t field) {
    return blocks[static_cast<size_t>(node) * block + field];
  }
  int64_t head(int node, size_t field) const {
    return blocks[static_cast<size_t>(node) * block + field];
  }

  const int k;
  const size_t L, per_local, block;
  std::vector<int64_t> blocks;
  std::vector<std::vector<char>> blobs;  // this node's, by local rank (not on a replacement)
  std::vector<bool> replaced;            // by node
  std::vector<int> rebuilt_nodes;        // the replacements
  // By local rank, by node: the blob bytes at the step, and the stripes they make.
  std::vector<std::vector<int64_t>> blob;
  std::vector<std::vector<int64_t>> stripes;
};

struct NodeRedundancy::Incoming {
  int from;
  int slot;  // 0: the replacement's own parity; 1 + c: its chunk c
  size_t l;
  std::vector<char> bytes;
};

namespace {

// Which of `holder`'s parity sources chunk `chunk` of `node` is (their count where none).
size_t SourceIndex(const RedundancyScheme& scheme, int nodes, int holder, int node, int chunk) {
  const std::vector<ChunkRef> s = ParitySources(scheme, nodes, holder);
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i].node == node && s[i].chunk == chunk) return i;
  }
  return s.size();
}

}  // namespace

absl::StatusOr<int64_t> NodeRedundancy::Rebuild(Comm& comm, bool replacement,
                                                const std::vector<std::vector<StateSegment>>& state,
                                                int64_t step, const PlaceSegment& place,
                                                absl::Time deadline, uint64_t seq) {
  AbandonProtect();  // (a recovery's, on a new connection: the old one's protect is given up)
  if (scheme_.hsdp) {
    return RebuildFromReplicas(comm, replacement, state, step, place, deadline, seq);
  }
  Census census(nodes_, locals_, scheme_.k);
  RAGSHARD_RETURN_IF_ERROR(TakeCensus(comm, replacement, state, step, deadline, seq, &census));
  int64_t rebuilt = 0;
  if (!census.rebuilt_nodes.empty()) {
    // Every node decides the same from the same census: all fail alike, or none does.
    RAGSHARD_RETURN_IF_ERROR(CheckRebuildable(census, step));
    RAGSHARD_RETURN_IF_ERROR(SizeStripes(&census, step));
    RAGSHARD_ASSIGN_OR_RETURN(std::vector<Incoming> incoming,
                              ExchangeChunks(comm, census, step, deadline, seq));
    if (replacement) {
      RAGSHARD_ASSIGN_OR_RETURN(rebuilt, Reassemble(census, incoming, step, place));
    }
  }
  DropAllBut(step);
  CountParities();
  return rebuilt;
}

absl::Status NodeRedundancy::TakeCensus(Comm& comm, bool replacement,
                                        const std::vector<std::vector<StateSegment>>& state,
                                        int64_t step, absl::Time deadline, uint64_t seq,
                                        Census* census) const {
  Census& c = *census;
  const PoolStats pool = pool_->Stats();
  c.head(node_, 0) = replacement ? 1 : 0;
  c.head(node_, 1) = pool.capacity - pool.used;
  for (size_t l = 0; !replacement && l < c.L; ++l) {
    auto mine = AsProtected(static_cast<int>(l), state[l], step);
    if (mine.ok()) {
      RAGSHARD_ASSIGN_OR_RETURN(c.blobs[l], MakeBlob(*mine, &c.at(node_, l, 0)));
    } else {
      c.at(node_, l, 0) = -1;  // every node fails, naming it, if a replacement needs it
    }
    const Slot* slot = FindSlot(static_cast<int>(l), step);
    if (slot == nullptr) continue;
    c.at(node_, l, 1) = 1;
    c.at(node_, l, 2) = slot->bytes;
    for (size_t i = 0; i < slot->source_blob.size() && i < static_cast<size_t>(c.k); ++i) {
      c.at(node_, l, 3 + i) = slot->source_blob[i];
      c.at(node_, l, 3 + c.k + i) = slot->source_crc[i];
    }
  }
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(c.blocks.data()),
                                     c.block * sizeof(int64_t), deadline,
                                     RedundancyStamp(seq, 2, 0)));
  for (int n = 0; n < nodes_; ++n) {
    c.replaced[n] = c.head(n, 0) == 1;
    if (c.replaced[n]) c.rebuilt_nodes.push_back(n);
  }
  return absl::OkStatus();
}

absl::Status NodeRedundancy::CheckRebuildable(const Census& c, int64_t step) const {
  auto name = [&](int n) { return absl::StrCat("'", node_names_[n], "'"); };
  // The node a parity's other sources' chunks come from must have kept its blob of the step.
  auto kept = [&](int src, const std::string& what) -> absl::Status {
    for (size_t l = 0; l < c.L; ++l) {
      if (c.at(src, l, 0) < 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("node ", name(src), " has not kept local rank ", l,
                         "'s state as it was at step ", step, ": ", what, " cannot be rebuilt"));
      }
    }
    return absl::OkStatus();
  };
  for (int x : c.rebuilt_nodes) {
    for (int chunk = 0; chunk < c.k; ++chunk) {
      const int h = ParityHolder(scheme_, nodes_, x, chunk);
      const std::string what = absl::StrCat("chunk ", chunk, " of node ", name(x));
      if (c.replaced[h]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "nodes ", name(x), " and ", name(h), " were both lost: chunk ", chunk, " of node ",
            name(x), "'s state has its parity on ", name(h), ", so neither can be rebuilt"));
      }
      for (const ChunkRef& src : ParitySources(scheme_, nodes_, h)) {
        if (src.node == x) continue;
        if (c.replaced[src.node]) {
          return absl::FailedPreconditionError(absl::StrCat(
              "nodes ", name(x), " and ", name(src.node),
              " of one parity group were both lost: ", what, "'s state cannot be rebuilt"));
        }
        RAGSHARD_RETURN_IF_ERROR(kept(src.node, what));
      }
      for (size_t l = 0; l < c.L; ++l) {
        if (c.at(h, l, 1) == 0) {
          return absl::FailedPreconditionError(
              absl::StrCat("node ", name(h), " holds no parity of step ", step, " for local rank ",
                           l, " of node ", name(x), ": chunk ", chunk, " cannot be rebuilt"));
        }
      }
    }
    for (const ChunkRef& src : ParitySources(scheme_, nodes_, x)) {
      if (c.replaced[src.node]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "nodes ", name(x), " and ", name(src.node), " were both lost: the parity node ",
            name(x), " kept for ", name(src.node), " cannot be rebuilt"));
      }
      RAGSHARD_RETURN_IF_ERROR(kept(src.node, absl::StrCat("the parity node ", name(x), " kept")));
    }
  }
  return absl::OkStatus();
}

absl::Status NodeRedundancy::SizeStripes(Census* census, int64_t step) const {
  Census& c = *census;
  auto name = [&](int n) { return absl::StrCat("'", node_names_[n], "'"); };
  // A survivor's blob bytes are its own; a replaced node's, as the holder of its chunk 0
  // recorded them.
  for (size_t l = 0; l < c.L; ++l) {
    for (int n = 0; n < nodes_; ++n) {
      const int h0 = ParityHolder(scheme_, nodes_, n, 0);
      c.blob[l][n] =
          c.replaced[n] ? c.at(h0, l, 3 + SourceIndex(scheme_, nodes_, h0, n, 0)) : c.at(n, l, 0);
    }
    c.stripes[l] = StripeBytes(scheme_, c.blob[l]);
    for (int x : c.rebuilt_nodes) {
      for (int chunk = 0; chunk < c.k; ++chunk) {
        const int n = ParityHolder(scheme_, nodes_, x, chunk);
        if (c.at(n, l, 2) != c.stripes[l][n]) {
          return absl::DataLossError(absl::StrCat(
              "node ", name(n), "'s parity of step ", step, " for local rank ", l, " has ",
              c.at(n, l, 2), " bytes; the blobs it covers make its stripe ", c.stripes[l][n]));
        }
      }
    }
  }
  for (int x : c.rebuilt_nodes) {
    // What the replacement's pool must take: each rank's blob and its own parity. A smaller
    // pool than the lost one's is refused up front, naming the bytes, on every node alike.
    int64_t need = 0;
    for (size_t l = 0; l < c.L; ++l) need += c.blob[l][x] + c.stripes[l][x];
    if (need > c.head(x, 1)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the replacement daemon of node ", name(x), " has ", c.head(x, 1),
                       " bytes free in its pool; the lost node's ranks' state and parity need ",
                       need, ": start it with a larger --pool-bytes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NodeRedundancy::Incoming>> NodeRedundancy::ExchangeChunks(
    Comm& comm, const Census& c, int64_t step, absl::Time deadline, uint64_t seq) const {
  // To replacement x, message index (1 + chunk) * L + l for what rebuilds its chunk, and l for a
  // source of its own parity. Empty chunks are not sent.
  const size_t L = c.L;
  std::vector<Incoming> incoming;
  std::vector<uint64_t> requests;  // the sends; the receives go first when waiting
  for (int x : c.rebuilt_nodes) {
    for (int chunk = 0; chunk <= c.k; ++chunk) {
      const bool own = chunk == c.k;  // x's own parity; otherwise x's chunk
      const int slot = own ? 0 : 1 + chunk;
      const int h = own ? x : ParityHolder(scheme_, nodes_, x, chunk);
      for (size_t l = 0; l < L; ++l) {
        const uint64_t tag = RedundancyStamp(seq, 3, static_cast<uint64_t>(slot) * L + l);
        if (!own && c.stripes[l][h] > 0) {
          if (node_ == h) {
            const Slot* p = FindSlot(static_cast<int>(l), step);
            RAGSHARD_ASSIGN_OR_RETURN(
                uint64_t r, comm.PostSend(x, tag, p->lease.data(), static_cast<size_t>(p->bytes)));
            requests.push_back(r);
          } else if (node_ == x) {
            incoming.push_back({h, slot, l, std::vector<char>(static_cast<size_t>(c.at(h, l, 2)))});
          }
        }
        for (const ChunkRef& src : ParitySources(scheme_, nodes_, h)) {
          if (src.node == x) continue;
          const ChunkSpan span = ChunkOf(scheme_, c.stripes[l], c.blob[l], src.node, src.chunk);
          if (span.bytes == 0) continue;
          if (node_ == src.node) {
            RAGSHARD_ASSIGN_OR_RETURN(uint64_t r,
                                      comm.PostSend(x, tag, c.blobs[l].data() + span.offset,
                                                    static_cast<size_t>(span.bytes)));
            requests.push_back(r);
          } else if (node_ == x) {
            incoming.push_back(
                {src.node, slot, l, std::vector<char>(static_cast<size_t>(span.bytes))});
          }
        }
      }
    }
  }
  std::vector<uint64_t> receives;
  for (Incoming& in : incoming) {
    RAGSHARD_ASSIGN_OR_RETURN(
        uint64_t r,
        comm.PostRecv(in.from, RedundancyStamp(seq, 3, static_cast<uint64_t>(in.slot) * L + in.l),
                      in.bytes.data(), in.bytes.size()));
    receives.push_back(r);
  }
  receives.insert(receives.end(), requests.begin(), requests.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(receives, deadline));
  return incoming;
}

absl::StatusOr<int64_t> NodeRedundancy::Reassemble(const Census& c,
                                                   const std::vector<Incoming>& incoming,
                                                   int64_t step, const PlaceSegment& place) {
  auto name = [&](int n) { return absl::StrCat("'", node_names_[n], "'"); };
  int64_t rebuilt = 0;
  for (size_t l = 0; l < c.L; ++l) {
    // The blob, chunk by chunk: its holder's parity XOR the other sources' chunks of the stripe
    // (beyond the chunk's end, all of them XOR to zeros); each chunk's CRC as its holder
    // recorded it.
    const int64_t blob_bytes = c.blob[l][node_];
    std::vector<char> mine(static_cast<size_t>(blob_bytes), '\0');
    for (int chunk = 0; chunk < c.k; ++chunk) {
      const ChunkSpan span = ChunkOf(scheme_, c.stripes[l], c.blob[l], node_, chunk);
      for (const Incoming& in : incoming) {
        if (in.l != l || in.slot != 1 + chunk) continue;
        XorInto(mine.data() + span.offset, in.bytes.data(),
                std::min<int64_t>(span.bytes, static_cast<int64_t>(in.bytes.size())));
      }
      const int h = ParityHolder(scheme_, nodes_, node_, chunk);
      const size_t i = SourceIndex(scheme_, nodes_, h, node_, chunk);
      const uint32_t want = static_cast<uint32_t>(c.at(h, l, 3 + c.k + i));
      const uint32_t have = Crc32(mine.data() + span.offset, span.bytes);
      if (have != want) {
        return absl::DataLossError(absl::StrFormat(
            "rebuilt chunk %d of local rank %d's state on node %s (bytes [%d, %d) of %d) does not "
            "match its checksum: CRC-32 %08x, node %s recorded %08x at step %d",
            chunk, l, name(node_), span.offset, span.offset + span.bytes, blob_bytes, have, name(h),
            want, step));
      }
    }
    RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(mine.data(), blob_bytes));
    std::vector<StateSegment> placed;
    for (const auto& [segment, where] : segments) {
      RAGSHARD_ASSIGN_OR_RETURN(StateSegment to, place(static_cast<int>(l), segment, where.second));
      RAGSHARD_RETURN_IF_ERROR(WriteSegment(to, mine.data() + where.first));
      placed.push_back(std::move(to));
    }
    Record(static_cast<int>(l), placed, step);
    rebuilt += blob_bytes;
    // This node's own parity, from its sources' chunks as they are now.
    Slot& slot = SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(Fill(&slot, c.stripes[l][node_]));
    for (const ChunkRef& src : ParitySources(scheme_, nodes_, node_)) {
      const Incoming* from = nullptr;
      for (const Incoming& in : incoming) {
        if (in.l == l && in.slot == 0 && in.from == src.node) from = &in;
      }
      const int64_t bytes = from == nullptr ? 0 : static_cast<int64_t>(from->bytes.size());
      if (from != nullptr) XorInto(slot.lease.data(), from->bytes.data(), bytes);
      slot.source_blob.push_back(c.blob[l][src.node]);
      slot.source_crc.push_back(Crc32(from == nullptr ? "" : from->bytes.data(), bytes));
    }
    slot.step = step;
    slot.made = ++made_;
    rebuilt += c.stripes[l][node_];
  }
  return rebuilt;
}

absl::StatusOr<int64_t> NodeRedundancy::RebuildFromReplicas(
    Comm& comm, bool replacement, const std::vector<std::vector<StateSegment>>& state, int64_t step,
    const PlaceSegment& place, absl::Time deadline, uint64_t seq) {
  const size_t L = static_cast<size_t>(locals_);
  // Each node's block: [replacement, its pool's free bytes] then per local rank [blob bytes, its
  // CRC-32].
  const size_t block = 2 + 2 * L;
  std::vector<int64_t> blocks(static_cast<size_t>(nodes_) * block, 0);
  std::vector<std::vector<char>> blobs(L);
  const PoolStats pool = pool_->Stats();
  int64_t* mine = &blocks[static_cast<size_t>(node_) * block];
  mine[0] = replacement ? 1 : 0;
  mine[1] = pool.capacity - pool.used;
  for (size_t l = 0; !replacement && l < L; ++l) {
    RAGSHARD_ASSIGN_OR_RETURN(blobs[l], MakeBlob(state[l], &mine[2 + 2 * l]));
    mine[3 + 2 * l] = Crc32(blobs[l].data(), static_cast<int64_t>(blobs[l].size()));
  }
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(blocks.data()),
                                     block * sizeof(int64_t), deadline,
                                     RedundancyStamp(seq, 2, 0)));
  auto field = [&](int n, size_t f) { return blocks[static_cast<size_t>(n) * block + f]; };
  std::vector<bool> replaced(static_cast<size_t>(nodes_));
  std::vector<int> rebuilt_nodes;
  for (int n = 0; n < nodes_; ++n) {
    replaced[n] = field(n, 0) == 1;
    if (replaced[n]) rebuilt_nodes.push_back(n);
  }
  if (rebuilt_nodes.empty()) return 0;
  auto name = [&](int n) { return absl::StrCat("'", node_names_[n], "'"); };
  // The replica each replaced rank copies: the next rank of its shard position (q + shard,
  // q + 2 shard, ...) on a node that kept its state. Every node picks the same.
  const int64_t world = static_cast<int64_t>(nodes_) * locals_;
  const int64_t shard = scheme_.shard_ranks;
  struct Copy {
    int to, to_local, from, from_local;
  };
  std::vector<Copy> copies;
  for (int x : rebuilt_nodes) {
    int64_t need = 0;
    for (int l = 0; l < locals_; ++l) {
      const int64_t q = static_cast<int64_t>(x) * locals_ + l;
      int64_t other = shard > 0 && world % shard == 0 ? (q + shard) % world : q;
      while (other != q && replaced[other / locals_]) other = (other + shard) % world;
      if (other == q) {
        std::vector<std::string> lost;
        lost.reserve(rebuilt_nodes.size());
        for (int n : rebuilt_nodes) lost.push_back(name(n));
        return absl::FailedPreconditionError(
            absl::StrCat("every HSDP replica of rank ", q, "'s shards was lost (nodes ",
                         absl::StrJoin(lost, ", "), " replaced; shard groups of ", shard,
                         " ranks over ", world, "): node ", name(x), " cannot be rebuilt"));
      }
      const int from = static_cast<int>(other / locals_);
      const int from_local = static_cast<int>(other % locals_);
      copies.push_back({x, l, from, from_local});
      need += field(from, 2 + 2 * static_cast<size_t>(from_local));
    }
    if (need > field(x, 1)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the replacement daemon of node ", name(x), " has ", field(x, 1),
                       " bytes free in its pool; the lost node's ranks' state needs ", need,
                       ": start it with a larger --pool-bytes"));
    }
  }
  std::vector<std::vector<char>> got(L);
  std::vector<uint64_t> receives;
  std::vector<uint64_t> sends;
  for (const Copy& c : copies) {
    const uint64_t tag = RedundancyStamp(seq, 3, static_cast<uint64_t>(c.to_local));
    const int64_t bytes = field(c.from, 2 + 2 * static_cast<size_t>(c.from_local));
    if (node_ == c.from) {
      RAGSHARD_ASSIGN_OR_RETURN(uint64_t r, comm.PostSend(c.to, tag, blobs[c.from_local].data(),
                                                          static_cast<size_t>(bytes)));
      sends.push_back(r);
    } else if (node_ == c.to) {
      got[c.to_local].resize(static_cast<size_t>(bytes));
      RAGSHARD_ASSIGN_OR_RETURN(
          uint64_t r, comm.PostRecv(c.from, tag, got[c.to_local].data(), got[c.to_local].size()));
      receives.push_back(r);
    }
  }
  receives.insert(receives.end(), sends.begin(), sends.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(receives, deadline));
  if (!replacement) return 0;
  int64_t rebuilt = 0;
  for (const Copy& c : copies) {
    if (c.to != node_) continue;
    const std::vector<char>& blob = got[c.to_local];
    const int64_t bytes = static_cast<int64_t>(blob.size());
    const uint32_t want =
        static_cast<uint32_t>(field(c.from, 3 + 2 * static_cast<size_t>(c.from_local)));
    const uint32_t have = Crc32(blob.data(), bytes);
    if (have != want) {
      return absl::DataLossError(absl::StrFormat(
          "the state of local rank %d copied from node %s's local rank %d (%d bytes) does not "
          "match its checksum: CRC-32 %08x, the sender's %08x, at step %d",
          c.to_local, name(c.from), c.from_local, bytes, have, want, step));
    }
    RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(blob.data(), bytes));
    for (const auto& [segment, where] : segments) {
      RAGSHARD_ASSIGN_OR_RETURN(StateSegment to, place(c.to_local, segment, where.second));
      RAGSHARD_RETURN_IF_ERROR(WriteSegment(to, blob.data() + where.first));
    }
    rebuilt += bytes;
  }
  return rebuilt;
}

}  // namespace ragshard::daemon
