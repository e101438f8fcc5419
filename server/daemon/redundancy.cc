#include "server/daemon/redundancy.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "infra/status_macros.h"
#include "server/daemon/collectives.h"

namespace ragshard::daemon {

namespace {

constexpr char kDirectoryMagic[] = "ragshard-state 1\n";

// The stamps of a redundancy operation's messages: unit field 0xFF00 + phase (no unit of a plan
// reaches it in practice; the sequence number tells operations apart anyway).
uint64_t Stamp(uint64_t seq, uint64_t phase, uint64_t index) {
  MessageStamp s;
  s.seq = seq;
  s.unit = 0xFF00 + phase;
  s.kind = MessageStamp::kNone;
  s.index = index;
  return s.Tag();
}

void XorInto(char* dst, const char* src, int64_t bytes) {
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t a = 0;
    uint64_t b = 0;
    std::memcpy(&a, dst + i, 8);
    std::memcpy(&b, src + i, 8);
    a ^= b;
    std::memcpy(dst + i, &a, 8);
  }
  for (; i < bytes; ++i) dst[i] = static_cast<char>(dst[i] ^ src[i]);
}

uint32_t Crc(const char* data, int64_t bytes) {
  return static_cast<uint32_t>(crc32_z(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data),
                                       static_cast<z_size_t>(bytes)));
}

// The directory that opens a blob: the magic line, "<bytes> <name>" per segment, an empty line,
// zero-padded to 64 bytes.
std::string Directory(const std::vector<StateSegment>& segments) {
  std::string d = kDirectoryMagic;
  for (const StateSegment& s : segments) absl::StrAppend(&d, s.bytes, " ", s.name, "\n");
  d += "\n";
  d.resize((d.size() + 63) / 64 * 64, '\0');
  return d;
}

// The blob of `segments`, zero-padded to k chunks; `blob_bytes` gets its unpadded size.
std::vector<char> MakeBlob(const std::vector<StateSegment>& segments, int k, int64_t* blob_bytes) {
  const std::string dir = Directory(segments);
  int64_t size = static_cast<int64_t>(dir.size());
  for (const StateSegment& s : segments) size += s.bytes;
  *blob_bytes = size;
  std::vector<char> blob(static_cast<size_t>(ChunkBytes(size, k) * k), '\0');
  std::memcpy(blob.data(), dir.data(), dir.size());
  int64_t at = static_cast<int64_t>(dir.size());
  for (const StateSegment& s : segments) {
    if (s.bytes > 0) std::memcpy(blob.data() + at, s.data, static_cast<size_t>(s.bytes));
    at += s.bytes;
  }
  return blob;
}

// The segments a rebuilt blob names, with where their bytes start.
absl::StatusOr<std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>> ReadDirectory(
    const std::vector<char>& blob, int64_t blob_bytes) {
  const std::string magic = kDirectoryMagic;
  if (blob_bytes < static_cast<int64_t>(magic.size()) ||
      std::memcmp(blob.data(), magic.data(), magic.size()) != 0) {
    return absl::DataLossError("the rebuilt state does not start with its directory");
  }
  const char* text = blob.data() + magic.size();
  const char* end = std::find(text, blob.data() + blob_bytes, '\0');
  if (end == blob.data() + blob_bytes) {
    return absl::DataLossError("the rebuilt state's directory has no end");
  }
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> out;
  int64_t at = (static_cast<int64_t>(end - blob.data()) + 63) / 64 * 64;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text, end - text), '\n')) {
    if (line.empty()) continue;
    std::pair<absl::string_view, absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(' ', 1));
    int64_t bytes = 0;
    if (!absl::SimpleAtoi(f.first, &bytes) || bytes < 0 || at + bytes > blob_bytes) {
      return absl::DataLossError(absl::StrCat("the rebuilt state's directory line '", line,
                                              "' does not fit its ", blob_bytes, " bytes"));
    }
    out.push_back({std::string(f.second), {at, bytes}});
    at += bytes;
  }
  return out;
}

}  // namespace

RedundancyScheme SchemeOf(const Redundancy& redundancy) {
  RedundancyScheme s;
  s.replica = redundancy.kind == Redundancy::Kind::kReplica;
  s.k = s.replica ? 1 : redundancy.k;
  return s;
}

std::vector<ChunkRef> ParitySources(const RedundancyScheme& scheme, int nodes, int holder) {
  if (scheme.replica) return {{(holder + nodes - 1) % nodes, 0}};
  const int g = scheme.k + 1;
  const int base = holder / g * g;
  const int s = holder - base;  // the stripe this holder keeps
  std::vector<ChunkRef> out;
  for (int q = 0; q < g; ++q) {
    if (q != s) out.push_back({base + q, s < q ? s : s - 1});
  }
  return out;
}

int ParityHolder(const RedundancyScheme& scheme, int nodes, int node, int chunk) {
  if (scheme.replica) return (node + 1) % nodes;
  const int g = scheme.k + 1;
  const int base = node / g * g;
  const int p = node - base;
  return base + (chunk < p ? chunk : chunk + 1);
}

int64_t ChunkBytes(int64_t blob_bytes, int k) {
  const int64_t c = (blob_bytes + k - 1) / k;
  return (c + 63) / 64 * 64;
}

NodeRedundancy::NodeRedundancy(RedundancyScheme scheme, int node,
                               std::vector<std::string> node_names, int locals, Pool* pool)
    : scheme_(scheme),
      node_(node),
      node_names_(std::move(node_names)),
      nodes_(static_cast<int>(node_names_.size())),
      locals_(locals),
      pool_(pool),
      slots_(static_cast<size_t>(locals)),
      own_(static_cast<size_t>(locals)) {}

void NodeRedundancy::Record(int local, const std::vector<StateSegment>& state, int64_t step) {
  std::array<Own, 2>& own = own_[static_cast<size_t>(local)];
  Own& o = own[0].step == step   ? own[0]
           : own[1].step == step ? own[1]
                                 : (own[0].step <= own[1].step ? own[0] : own[1]);
  o.step = step;
  o.segments.clear();
  for (const StateSegment& s : state) o.segments.push_back({s.name, s.bytes});
}

absl::StatusOr<std::vector<StateSegment>> NodeRedundancy::AsProtected(
    int local, const std::vector<StateSegment>& state, int64_t step) const {
  for (const Own& o : own_[static_cast<size_t>(local)]) {
    if (o.step != step) continue;
    std::vector<StateSegment> out;
    for (const std::pair<std::string, int64_t>& segment : o.segments) {
      const std::string& name = segment.first;
      const int64_t bytes = segment.second;
      auto it = std::find_if(state.begin(), state.end(),
                             [&name](const StateSegment& s) { return s.name == name; });
      if (it == state.end() || it->bytes != bytes) {
        return absl::FailedPreconditionError(
            absl::StrCat("local rank ", local, "'s state segment '", name, "' (", bytes,
                         " bytes at step ", step, ") is ", it == state.end() ? "gone" : "resized",
                         " on node '", node_names_[node_], "'"));
      }
      out.push_back(*it);
    }
    return out;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("node '", node_names_[node_], "' did not protect local rank ", local,
                   "'s state at step ", step, " (its last two protected steps are ",
                   own_[local][0].step, " and ", own_[local][1].step, ")"));
}

NodeRedundancy::Slot& NodeRedundancy::SlotFor(int local, int64_t step) {
  std::array<Slot, 2>& s = slots_[static_cast<size_t>(local)];
  if (s[0].step == step) return s[0];
  if (s[1].step == step) return s[1];
  return s[0].step <= s[1].step ? s[0] : s[1];
}

const NodeRedundancy::Slot* NodeRedundancy::FindSlot(int local, int64_t step) const {
  for (const Slot& s : slots_[static_cast<size_t>(local)]) {
    if (s.step == step && s.lease.valid()) return &s;
  }
  return nullptr;
}

absl::Status NodeRedundancy::Fill(Slot* slot, int64_t bytes) {
  slot->step = -1;
  if (slot->lease.size() < bytes) {
    slot->lease.Release();
    auto lease = pool_->Allocate(std::max<int64_t>(bytes, 64));
    if (!lease.ok()) {
      return absl::Status(
          lease.status().code(),
          absl::StrCat("the parity of ", bytes, " bytes (redundancy): ", lease.status().message()));
    }
    slot->lease = std::move(*lease);
  }
  slot->bytes = bytes;
  std::memset(slot->lease.data(), 0, static_cast<size_t>(bytes));
  slot->source_blob.clear();
  slot->source_crc.clear();
  return absl::OkStatus();
}

void NodeRedundancy::FlipParityByteForTest(int local, int64_t step, int64_t at) {
  const Slot* s = FindSlot(local, step);
  if (s != nullptr && at < s->bytes) s->lease.data()[at] ^= 0x5a;
}

int64_t NodeRedundancy::parity_bytes() const { return parity_bytes_.load(); }

void NodeRedundancy::CountParities() {
  int64_t total = 0;
  for (const auto& pair : slots_) {
    for (const Slot& s : pair) total += s.lease.valid() ? s.lease.size() : 0;
  }
  parity_bytes_.store(total);
}

absl::Status NodeRedundancy::Protect(Comm& comm,
                                     const std::vector<std::vector<StateSegment>>& state,
                                     int64_t step, absl::Time deadline, uint64_t seq) {
  const int k = scheme_.k;
  const size_t L = static_cast<size_t>(locals_);
  std::vector<std::vector<char>> blobs(L);
  std::vector<int64_t> sizes(static_cast<size_t>(nodes_) * L, 0);
  for (size_t l = 0; l < L; ++l) blobs[l] = MakeBlob(state[l], k, &sizes[node_ * L + l]);
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(sizes.data()),
                                     L * sizeof(int64_t), deadline, Stamp(seq, 0, 0)));
  for (size_t l = 0; l < L; ++l) Record(static_cast<int>(l), state[l], step);
  int64_t mine = 0;
  for (size_t l = 0; l < L; ++l) mine += sizes[node_ * L + l];
  protected_bytes_.store(mine);
  std::vector<uint64_t> requests;  // the receives, then the sends (waited for in that order)
  std::vector<uint64_t> sends;
  for (int c = 0; c < k; ++c) {
    const int holder = ParityHolder(scheme_, nodes_, node_, c);
    for (size_t l = 0; l < L; ++l) {
      const int64_t chunk = ChunkBytes(sizes[node_ * L + l], k);
      RAGSHARD_ASSIGN_OR_RETURN(uint64_t r,
                                comm.PostSend(holder, Stamp(seq, 1, l), blobs[l].data() + c * chunk,
                                              static_cast<size_t>(chunk)));
      sends.push_back(r);
    }
  }
  const std::vector<ChunkRef> sources = ParitySources(scheme_, nodes_, node_);
  std::vector<std::vector<std::vector<char>>> got(sources.size(),
                                                  std::vector<std::vector<char>>(L));
  for (size_t i = 0; i < sources.size(); ++i) {
    for (size_t l = 0; l < L; ++l) {
      got[i][l].resize(static_cast<size_t>(ChunkBytes(sizes[sources[i].node * L + l], k)));
      RAGSHARD_ASSIGN_OR_RETURN(uint64_t r, comm.PostRecv(sources[i].node, Stamp(seq, 1, l),
                                                          got[i][l].data(), got[i][l].size()));
      requests.push_back(r);
    }
  }
  requests.insert(requests.end(), sends.begin(), sends.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(requests, deadline));
  for (size_t l = 0; l < L; ++l) {
    int64_t longest = 0;
    for (size_t i = 0; i < sources.size(); ++i) {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(got[i][l].size()));
    }
    Slot& slot = SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(Fill(&slot, longest));
    for (size_t i = 0; i < sources.size(); ++i) {
      const std::vector<char>& chunk = got[i][l];
      XorInto(slot.lease.data(), chunk.data(), static_cast<int64_t>(chunk.size()));
      slot.source_blob.push_back(sizes[sources[i].node * L + l]);
      slot.source_crc.push_back(Crc(chunk.data(), static_cast<int64_t>(chunk.size())));
    }
    slot.step = step;
  }
  CountParities();
  return absl::OkStatus();
}

absl::StatusOr<int64_t> NodeRedundancy::Rebuild(Comm& comm, bool replacement,
                                                const std::vector<std::vector<StateSegment>>& state,
                                                int64_t step, const PlaceSegment& place,
                                                absl::Time deadline, uint64_t seq) {
  const int k = scheme_.k;
  const size_t L = static_cast<size_t>(locals_);
  // Each node's block: [replacement, its pool's free bytes] then per local rank [blob bytes, has
  // the step's parity, parity bytes, k source blob bytes, k source CRCs].
  const size_t per_local = 3 + 2 * static_cast<size_t>(k);
  const size_t block = 2 + L * per_local;
  std::vector<int64_t> blocks(static_cast<size_t>(nodes_) * block, 0);
  auto at = [&](int node, size_t l, size_t field) -> int64_t& {
    return blocks[static_cast<size_t>(node) * block + 2 + l * per_local + field];
  };
  std::vector<std::vector<char>> blobs(L);
  const PoolStats pool = pool_->Stats();
  blocks[static_cast<size_t>(node_) * block] = replacement ? 1 : 0;
  blocks[static_cast<size_t>(node_) * block + 1] = pool.capacity - pool.used;
  if (!replacement) {
    for (size_t l = 0; l < L; ++l) {
      auto mine = AsProtected(static_cast<int>(l), state[l], step);
      if (mine.ok()) {
        blobs[l] = MakeBlob(*mine, k, &at(node_, l, 0));
      } else {
        at(node_, l, 0) = -1;  // every node fails below, naming it, if a replacement needs it
      }
      const Slot* slot = FindSlot(static_cast<int>(l), step);
      if (slot == nullptr) continue;
      at(node_, l, 1) = 1;
      at(node_, l, 2) = slot->bytes;
      for (size_t i = 0; i < slot->source_blob.size() && i < static_cast<size_t>(k); ++i) {
        at(node_, l, 3 + i) = slot->source_blob[i];
        at(node_, l, 3 + k + i) = slot->source_crc[i];
      }
    }
  }
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(blocks.data()),
                                     block * sizeof(int64_t), deadline, Stamp(seq, 2, 0)));
  std::vector<bool> replaced(static_cast<size_t>(nodes_));
  std::vector<int> rebuilt_nodes;
  for (int n = 0; n < nodes_; ++n) {
    replaced[n] = blocks[static_cast<size_t>(n) * block] == 1;
    if (replaced[n]) rebuilt_nodes.push_back(n);
  }
  if (rebuilt_nodes.empty()) return 0;
  // Every node decides the same from the same blocks: all fail alike, or none does.
  auto name = [&](int n) { return absl::StrCat("'", node_names_[n], "'"); };
  for (int x : rebuilt_nodes) {
    for (int c = 0; c < k; ++c) {
      const int h = ParityHolder(scheme_, nodes_, x, c);
      if (replaced[h]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "nodes ", name(x), " and ", name(h), " were both lost: chunk ", c, " of node ", name(x),
            "'s state has its parity on ", name(h), ", so neither can be rebuilt"));
      }
      for (const ChunkRef& src : ParitySources(scheme_, nodes_, h)) {
        if (src.node != x && replaced[src.node]) {
          return absl::FailedPreconditionError(
              absl::StrCat("nodes ", name(x), " and ", name(src.node),
                           " of one parity group were both lost: "
                           "chunk ",
                           c, " of node ", name(x), "'s state cannot be rebuilt"));
        }
        for (size_t l = 0; src.node != x && l < L; ++l) {
          if (at(src.node, l, 0) < 0) {
            return absl::FailedPreconditionError(
                absl::StrCat("node ", name(src.node), " has not kept local rank ", l,
                             "'s state as it was at "
                             "step ",
                             step, ": chunk ", c, " of node ", name(x), " cannot be rebuilt"));
          }
        }
      }
      for (size_t l = 0; l < L; ++l) {
        if (at(h, l, 1) == 0) {
          return absl::FailedPreconditionError(
              absl::StrCat("node ", name(h), " holds no parity of step ", step, " for local rank ",
                           l, " of node ", name(x), ": chunk ", c, " cannot be rebuilt"));
        }
      }
    }
    for (const ChunkRef& src : ParitySources(scheme_, nodes_, x)) {
      if (replaced[src.node]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "nodes ", name(x), " and ", name(src.node), " were both lost: the parity node ",
            name(x), " kept for ", name(src.node), " cannot be rebuilt"));
      }
      for (size_t l = 0; l < L; ++l) {
        if (at(src.node, l, 0) < 0) {
          return absl::FailedPreconditionError(
              absl::StrCat("node ", name(src.node), " has not kept local rank ", l,
                           "'s state as it was at "
                           "step ",
                           step, ": the parity node ", name(x), " kept cannot be rebuilt"));
        }
      }
    }
  }
  for (int x : rebuilt_nodes) {
    // What the replacement's pool must take: each rank's blob and its own parity. A smaller
    // pool than the lost one's is refused up front, naming the bytes, on every node alike.
    int64_t need = 0;
    for (size_t l = 0; l < L; ++l) {
      const int h = ParityHolder(scheme_, nodes_, x, 0);
      const std::vector<ChunkRef> s = ParitySources(scheme_, nodes_, h);
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i].node == x && s[i].chunk == 0) need += at(h, l, 3 + i);
      }
      for (const ChunkRef& src : ParitySources(scheme_, nodes_, x)) {
        need += ChunkBytes(at(src.node, l, 0), k);
      }
    }
    const int64_t free_bytes = blocks[static_cast<size_t>(x) * block + 1];
    if (need > free_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("the replacement daemon of node ", name(x), " has ", free_bytes,
                       " bytes free in its pool; the lost node's ranks' state and parity need ",
                       need, ": start it with a larger --pool-bytes"));
    }
  }
  // The messages: to replacement x, index (1 + c) * L + l for what rebuilds its chunk c, and l
  // for a source of its own parity.
  struct Incoming {
    int from;
    int slot;  // 0: x's own parity; 1 + c: x's chunk c
    size_t l;
    std::vector<char> bytes;
  };
  std::vector<Incoming> incoming;
  std::vector<uint64_t> requests;  // the sends; the receives go first when waiting
  auto source_index = [&](int holder, int node, int chunk) {
    const std::vector<ChunkRef> s = ParitySources(scheme_, nodes_, holder);
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i].node == node && s[i].chunk == chunk) return i;
    }
    return s.size();
  };
  for (int x : rebuilt_nodes) {
    for (int c = 0; c <= k; ++c) {
      // slot 0 (c == k here): x's own parity; otherwise x's chunk c.
      const bool own = c == k;
      const int slot = own ? 0 : 1 + c;
      const int h = own ? x : ParityHolder(scheme_, nodes_, x, c);
      for (size_t l = 0; l < L; ++l) {
        const uint64_t tag = Stamp(seq, 3, static_cast<uint64_t>(slot) * L + l);
        if (!own) {
          if (node_ == h) {
            const Slot* p = FindSlot(static_cast<int>(l), step);
            RAGSHARD_ASSIGN_OR_RETURN(
                uint64_t r, comm.PostSend(x, tag, p->lease.data(), static_cast<size_t>(p->bytes)));
            requests.push_back(r);
          } else if (node_ == x) {
            incoming.push_back({h, slot, l, std::vector<char>(static_cast<size_t>(at(h, l, 2)))});
          }
        }
        for (const ChunkRef& src : ParitySources(scheme_, nodes_, h)) {
          if (src.node == x) continue;
          const int64_t chunk = ChunkBytes(at(src.node, l, 0), k);
          if (node_ == src.node) {
            RAGSHARD_ASSIGN_OR_RETURN(uint64_t r,
                                      comm.PostSend(x, tag, blobs[l].data() + src.chunk * chunk,
                                                    static_cast<size_t>(chunk)));
            requests.push_back(r);
          } else if (node_ == x) {
            incoming.push_back({src.node, slot, l, std::vector<char>(static_cast<size_t>(chunk))});
          }
        }
      }
    }
  }
  std::vector<uint64_t> receives;
  for (Incoming& in : incoming) {
    RAGSHARD_ASSIGN_OR_RETURN(
        uint64_t r, comm.PostRecv(in.from, Stamp(seq, 3, static_cast<uint64_t>(in.slot) * L + in.l),
                                  in.bytes.data(), in.bytes.size()));
    receives.push_back(r);
  }
  receives.insert(receives.end(), requests.begin(), requests.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(receives, deadline));
  if (!replacement) return 0;

  int64_t rebuilt = 0;
  for (size_t l = 0; l < L; ++l) {
    // The blob's size and each chunk's CRC, as its holders recorded them.
    const int h0 = ParityHolder(scheme_, nodes_, node_, 0);
    const int64_t blob_bytes = at(h0, l, 3 + source_index(h0, node_, 0));
    const int64_t chunk = ChunkBytes(blob_bytes, k);
    std::vector<char> blob(static_cast<size_t>(chunk * k), '\0');
    for (const Incoming& in : incoming) {
      if (in.l != l || in.slot == 0) continue;
      XorInto(blob.data() + (in.slot - 1) * chunk, in.bytes.data(),
              std::min<int64_t>(chunk, static_cast<int64_t>(in.bytes.size())));
    }
    for (int c = 0; c < k; ++c) {
      const int h = ParityHolder(scheme_, nodes_, node_, c);
      const size_t i = source_index(h, node_, c);
      const uint32_t want = static_cast<uint32_t>(at(h, l, 3 + k + i));
      const uint32_t have = Crc(blob.data() + c * chunk, chunk);
      if (have != want) {
        return absl::DataLossError(absl::StrFormat(
            "rebuilt chunk %d of local rank %d's state on node %s (bytes [%d, %d) of %d) does not "
            "match its checksum: CRC-32 %08x, node %s recorded %08x at step %d",
            c, l, name(node_), c * chunk, (c + 1) * chunk, blob_bytes, have, name(h), want, step));
      }
    }
    RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(blob, blob_bytes));
    std::vector<StateSegment> placed;
    for (const auto& [segment, where] : segments) {
      RAGSHARD_ASSIGN_OR_RETURN(char* to, place(static_cast<int>(l), segment, where.second));
      if (where.second > 0) {
        std::memcpy(to, blob.data() + where.first, static_cast<size_t>(where.second));
      }
      placed.push_back({segment, to, where.second});
    }
    Record(static_cast<int>(l), placed, step);
    rebuilt += blob_bytes;
    // This node's own parity, from its sources' chunks as they are now.
    int64_t longest = 0;
    for (const Incoming& in : incoming) {
      if (in.l == l && in.slot == 0) {
        longest = std::max<int64_t>(longest, static_cast<int64_t>(in.bytes.size()));
      }
    }
    Slot& slot = SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(Fill(&slot, longest));
    for (const ChunkRef& src : ParitySources(scheme_, nodes_, node_)) {
      for (const Incoming& in : incoming) {
        if (in.l != l || in.slot != 0 || in.from != src.node) continue;
        XorInto(slot.lease.data(), in.bytes.data(), static_cast<int64_t>(in.bytes.size()));
        slot.source_blob.push_back(at(src.node, l, 0));
        slot.source_crc.push_back(Crc(in.bytes.data(), static_cast<int64_t>(in.bytes.size())));
      }
    }
    slot.step = step;
    rebuilt += longest;
  }
  CountParities();
  return rebuilt;
}

}  // namespace ragshard::daemon
