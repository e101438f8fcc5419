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

// The blob of `segments`; `blob_bytes` gets its size.
std::vector<char> MakeBlob(const std::vector<StateSegment>& segments, int64_t* blob_bytes) {
  const std::string dir = Directory(segments);
  int64_t size = static_cast<int64_t>(dir.size());
  for (const StateSegment& s : segments) size += s.bytes;
  *blob_bytes = size;
  std::vector<char> blob(static_cast<size_t>(size), '\0');
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
    const char* blob, int64_t blob_bytes) {
  const std::string magic = kDirectoryMagic;
  if (blob_bytes < static_cast<int64_t>(magic.size()) ||
      std::memcmp(blob, magic.data(), magic.size()) != 0) {
    return absl::DataLossError("the rebuilt state does not start with its directory");
  }
  const char* text = blob + magic.size();
  const char* end = std::find(text, blob + blob_bytes, '\0');
  if (end == blob + blob_bytes) {
    return absl::DataLossError("the rebuilt state's directory has no end");
  }
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> out;
  int64_t at = (static_cast<int64_t>(end - blob) + 63) / 64 * 64;
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
  s.hsdp = redundancy.kind == Redundancy::Kind::kHsdp;
  s.k = s.replica || s.hsdp ? 1 : redundancy.k;
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

std::vector<int64_t> StripeBytes(const RedundancyScheme& scheme, const std::vector<int64_t>& blob) {
  const int nodes = static_cast<int>(blob.size());
  std::vector<int64_t> out(blob.size(), 0);
  if (scheme.replica) {
    for (int h = 0; h < nodes; ++h) out[h] = blob[(h + nodes - 1) % nodes];
    return out;
  }
  const int g = scheme.k + 1;
  for (int base = 0; base + g <= nodes; base += g) {
    int64_t sum = 0;
    int64_t most = 0;
    for (int q = base; q < base + g; ++q) sum += blob[q], most = std::max(most, blob[q]);
    // Whether stripes max(0, p - blob[h]) cover every node's blob with its K chunks.
    auto covers = [&](int64_t p) {
      for (int q = base; q < base + g; ++q) {
        int64_t have = 0;
        for (int h = base; h < base + g; ++h) {
          if (h != q) have += std::max<int64_t>(0, p - blob[h]);
        }
        if (have < blob[q]) return false;
      }
      return true;
    };
    int64_t lo = 0;
    int64_t hi = most + sum;  // covers: each of K stripes is at least sum / K there
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (covers(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    for (int h = base; h < base + g; ++h) out[h] = std::max<int64_t>(0, lo - blob[h]);
  }
  return out;
}

ChunkSpan ChunkOf(const RedundancyScheme& scheme, const std::vector<int64_t>& stripes,
                  const std::vector<int64_t>& blob, int node, int chunk) {
  const int nodes = static_cast<int>(blob.size());
  if (scheme.replica) return {0, blob[node]};
  int64_t offset = 0;
  for (int c = 0; c < chunk; ++c) offset += stripes[ParityHolder(scheme, nodes, node, c)];
  const int64_t stripe = stripes[ParityHolder(scheme, nodes, node, chunk)];
  offset = std::min(offset, blob[node]);
  return {offset, std::min(blob[node] - offset, stripe)};
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
  auto keep = [step](const Slot& x) {
    if (!x.lease.valid() || x.step < 0) return 0;
    return x.step == step - 1 ? 3 : x.step == step ? 2 : 1;
  };
  const int a = keep(s[0]);
  const int b = keep(s[1]);
  if (a != b) return a < b ? s[0] : s[1];
  return s[0].step <= s[1].step ? s[0] : s[1];
}

void NodeRedundancy::DropAllBut(int64_t step) {
  for (size_t l = 0; l < slots_.size(); ++l) {
    const Slot* keep = FindSlot(static_cast<int>(l), step);
    for (Slot& x : slots_[l]) {
      if (&x == keep) continue;
      x.lease.Release();
      x.step = -1;
      x.bytes = 0;
      x.source_blob.clear();
      x.source_crc.clear();
    }
  }
}

const NodeRedundancy::Slot* NodeRedundancy::FindSlot(int local, int64_t step) const {
  const Slot* newest = nullptr;
  for (const Slot& s : slots_[static_cast<size_t>(local)]) {
    if (s.step == step && s.lease.valid() && (newest == nullptr || s.made > newest->made)) {
      newest = &s;
    }
  }
  return newest;
}

absl::Status NodeRedundancy::Fill(Slot* slot, int64_t bytes) {
  slot->step = -1;
  if (!slot->lease.valid() || slot->lease.size() < bytes) {
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

absl::StatusOr<NodeRedundancy::Copy> NodeRedundancy::CopyHeld(int local, int64_t step,
                                                              bool check) const {
  const std::vector<ChunkRef> sources = ParitySources(scheme_, nodes_, node_);
  if (scheme_.hsdp || sources.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", node_names_[static_cast<size_t>(node_)],
                     "'s parities are XORs of several nodes' chunks (parity:", scheme_.k,
                     "); only replica (or parity:1) holds another node's state whole"));
  }
  const Slot* slot = FindSlot(local, step);
  if (slot == nullptr || slot->source_blob.size() != 1) {
    return absl::NotFoundError(absl::StrCat("node ", node_names_[static_cast<size_t>(node_)],
                                            " holds no copy of local rank ", local,
                                            "'s state at step ", step));
  }
  const std::string& from = node_names_[static_cast<size_t>(sources[0].node)];
  const int64_t bytes = slot->source_blob[0];
  const uint32_t have = bytes <= slot->bytes && check ? Crc(slot->lease.data(), bytes) : 0;
  if (bytes > slot->bytes || (check && have != slot->source_crc[0])) {
    return absl::DataLossError(absl::StrFormat(
        "chunk 0 of local rank %d's state of node %s, as node %s holds it at step %d (%d bytes), "
        "does not match its checksum: CRC-32 %08x, recorded %08x",
        local, from, node_names_[static_cast<size_t>(node_)], step, bytes, have,
        slot->source_crc[0]));
  }
  RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(slot->lease.data(), bytes));
  Copy out{sources[0].node, from, {}};
  for (const auto& [name, where] : segments) {
    out.segments.push_back({name, slot->lease.data() + where.first, where.second});
  }
  return out;
}

void NodeRedundancy::FlipParityByteForTest(int local, int64_t step, int64_t at) {
  const Slot* s = FindSlot(local, step);
  if (s != nullptr && at < s->bytes) s->lease.data()[at] ^= 0x5a;
}

int64_t NodeRedundancy::parity_bytes() const { return parity_bytes_.load(); }

std::vector<int64_t> NodeRedundancy::parity_steps() const {
  std::vector<int64_t> out;
  for (const std::atomic<int64_t>& s : parity_steps_) {
    const int64_t step = s.load();
    if (step >= 0) out.push_back(step);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void NodeRedundancy::CountParities() {
  int64_t total = 0;
  for (const auto& pair : slots_) {
    for (const Slot& s : pair) total += s.lease.valid() ? s.lease.size() : 0;
  }
  parity_bytes_.store(total);
  // The steps every local rank has a parity of.
  for (size_t i = 0; i < parity_steps_.size(); ++i) {
    const int64_t step = slots_.empty() || !slots_[0][i].lease.valid() ? -1 : slots_[0][i].step;
    bool all = step >= 0 && (i == 0 || step != slots_[0][0].step);
    for (int l = 0; all && l < locals_; ++l) all = FindSlot(l, step) != nullptr;
    parity_steps_[i].store(all ? step : -1);
  }
}

absl::Status NodeRedundancy::Protect(Comm& comm,
                                     const std::vector<std::vector<StateSegment>>& state,
                                     int64_t step, absl::Time deadline, uint64_t seq) {
  if (scheme_.hsdp) return absl::OkStatus();  // the replicas are the redundancy
  absl::Status done = ProtectBlobs(comm, state, step, deadline, seq);
  CountParities();
  return done;
}

absl::Status NodeRedundancy::ProtectBlobs(Comm& comm,
                                          const std::vector<std::vector<StateSegment>>& state,
                                          int64_t step, absl::Time deadline, uint64_t seq) {
  const int k = scheme_.k;
  const size_t L = static_cast<size_t>(locals_);
  std::vector<std::vector<char>> blobs(L);
  std::vector<int64_t> sizes(static_cast<size_t>(nodes_) * L, 0);
  for (size_t l = 0; l < L; ++l) blobs[l] = MakeBlob(state[l], &sizes[node_ * L + l]);
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(sizes.data()),
                                     L * sizeof(int64_t), deadline, Stamp(seq, 0, 0)));
  for (size_t l = 0; l < L; ++l) Record(static_cast<int>(l), state[l], step);
  int64_t mine = 0;
  for (size_t l = 0; l < L; ++l) mine += sizes[node_ * L + l];
  protected_bytes_.store(mine);
  // Per local rank: every node's blob bytes, and the stripes they make.
  std::vector<std::vector<int64_t>> blob(L, std::vector<int64_t>(static_cast<size_t>(nodes_)));
  std::vector<std::vector<int64_t>> stripes(L);
  for (size_t l = 0; l < L; ++l) {
    for (int n = 0; n < nodes_; ++n) blob[l][n] = sizes[n * L + l];
    stripes[l] = StripeBytes(scheme_, blob[l]);
  }
  std::vector<uint64_t> requests;  // the receives, then the sends (waited for in that order)
  std::vector<uint64_t> sends;
  for (int c = 0; c < k; ++c) {
    const int holder = ParityHolder(scheme_, nodes_, node_, c);
    for (size_t l = 0; l < L; ++l) {
      const ChunkSpan span = ChunkOf(scheme_, stripes[l], blob[l], node_, c);
      if (span.bytes == 0) continue;
      RAGSHARD_ASSIGN_OR_RETURN(
          uint64_t r, comm.PostSend(holder, Stamp(seq, 1, l), blobs[l].data() + span.offset,
                                    static_cast<size_t>(span.bytes)));
      sends.push_back(r);
    }
  }
  const std::vector<ChunkRef> sources = ParitySources(scheme_, nodes_, node_);
  std::vector<std::vector<std::vector<char>>> got(sources.size(),
                                                  std::vector<std::vector<char>>(L));
  for (size_t i = 0; i < sources.size(); ++i) {
    for (size_t l = 0; l < L; ++l) {
      const ChunkSpan span =
          ChunkOf(scheme_, stripes[l], blob[l], sources[i].node, sources[i].chunk);
      got[i][l].resize(static_cast<size_t>(span.bytes));
      if (span.bytes == 0) continue;
      RAGSHARD_ASSIGN_OR_RETURN(uint64_t r, comm.PostRecv(sources[i].node, Stamp(seq, 1, l),
                                                          got[i][l].data(), got[i][l].size()));
      requests.push_back(r);
    }
  }
  requests.insert(requests.end(), sends.begin(), sends.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(requests, deadline));
  const uint64_t made = ++made_;
  for (size_t l = 0; l < L; ++l) {
    Slot& slot = SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(Fill(&slot, stripes[l][node_]));
    for (size_t i = 0; i < sources.size(); ++i) {
      const std::vector<char>& chunk = got[i][l];
      XorInto(slot.lease.data(), chunk.data(), static_cast<int64_t>(chunk.size()));
      slot.source_blob.push_back(blob[l][sources[i].node]);
      slot.source_crc.push_back(Crc(chunk.data(), static_cast<int64_t>(chunk.size())));
    }
    slot.step = step;
    slot.made = made;
  }
  CountParities();
  if (before_barrier_) RAGSHARD_RETURN_IF_ERROR(before_barrier_());
  // Every node has its parity of `step` before any drops that of the step before: a node lost
  // from here on leaves the others holding one step's parity in common (redundancy.h).
  std::vector<int64_t> arrived(static_cast<size_t>(nodes_), 0);
  arrived[static_cast<size_t>(node_)] = step;
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(arrived.data()), sizeof(int64_t),
                                     deadline, Stamp(seq, 4, 0)));
  DropAllBut(step);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> NodeRedundancy::Rebuild(Comm& comm, bool replacement,
                                                const std::vector<std::vector<StateSegment>>& state,
                                                int64_t step, const PlaceSegment& place,
                                                absl::Time deadline, uint64_t seq) {
  if (scheme_.hsdp)
    return RebuildFromReplicas(comm, replacement, state, step, place, deadline, seq);
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
        blobs[l] = MakeBlob(*mine, &at(node_, l, 0));
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
  if (rebuilt_nodes.empty()) {
    DropAllBut(step);
    CountParities();
    return 0;
  }
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
  auto source_index = [&](int holder, int node, int chunk) {
    const std::vector<ChunkRef> s = ParitySources(scheme_, nodes_, holder);
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i].node == node && s[i].chunk == chunk) return i;
    }
    return s.size();
  };
  // Every node's blob bytes at the step, by local rank: the survivors' own, a replaced node's as
  // the holder of its chunk 0 recorded it; and the stripes they make, which each holder's parity
  // must have.
  std::vector<std::vector<int64_t>> blob(L, std::vector<int64_t>(static_cast<size_t>(nodes_)));
  std::vector<std::vector<int64_t>> stripes(L);
  for (size_t l = 0; l < L; ++l) {
    for (int n = 0; n < nodes_; ++n) {
      const int h0 = ParityHolder(scheme_, nodes_, n, 0);
      blob[l][n] = replaced[n] ? at(h0, l, 3 + source_index(h0, n, 0)) : at(n, l, 0);
    }
    stripes[l] = StripeBytes(scheme_, blob[l]);
    for (int x : rebuilt_nodes) {
      for (int c = 0; c < k; ++c) {
        const int n = ParityHolder(scheme_, nodes_, x, c);
        if (at(n, l, 2) != stripes[l][n]) {
          return absl::DataLossError(absl::StrCat(
              "node ", name(n), "'s parity of step ", step, " for local rank ", l, " has ",
              at(n, l, 2), " bytes; the blobs it covers make its stripe ", stripes[l][n]));
        }
      }
    }
  }
  for (int x : rebuilt_nodes) {
    // What the replacement's pool must take: each rank's blob and its own parity. A smaller
    // pool than the lost one's is refused up front, naming the bytes, on every node alike.
    int64_t need = 0;
    for (size_t l = 0; l < L; ++l) need += blob[l][x] + stripes[l][x];
    const int64_t free_bytes = blocks[static_cast<size_t>(x) * block + 1];
    if (need > free_bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("the replacement daemon of node ", name(x), " has ", free_bytes,
                       " bytes free in its pool; the lost node's ranks' state and parity need ",
                       need, ": start it with a larger --pool-bytes"));
    }
  }
  // The messages: to replacement x, index (1 + c) * L + l for what rebuilds its chunk c, and l
  // for a source of its own parity. Empty chunks are not sent.
  struct Incoming {
    int from;
    int slot;  // 0: x's own parity; 1 + c: x's chunk c
    size_t l;
    std::vector<char> bytes;
  };
  std::vector<Incoming> incoming;
  std::vector<uint64_t> requests;  // the sends; the receives go first when waiting
  for (int x : rebuilt_nodes) {
    for (int c = 0; c <= k; ++c) {
      // slot 0 (c == k here): x's own parity; otherwise x's chunk c.
      const bool own = c == k;
      const int slot = own ? 0 : 1 + c;
      const int h = own ? x : ParityHolder(scheme_, nodes_, x, c);
      for (size_t l = 0; l < L; ++l) {
        const uint64_t tag = Stamp(seq, 3, static_cast<uint64_t>(slot) * L + l);
        if (!own && stripes[l][h] > 0) {
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
          const ChunkSpan span = ChunkOf(scheme_, stripes[l], blob[l], src.node, src.chunk);
          if (span.bytes == 0) continue;
          if (node_ == src.node) {
            RAGSHARD_ASSIGN_OR_RETURN(uint64_t r,
                                      comm.PostSend(x, tag, blobs[l].data() + span.offset,
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
        uint64_t r, comm.PostRecv(in.from, Stamp(seq, 3, static_cast<uint64_t>(in.slot) * L + in.l),
                                  in.bytes.data(), in.bytes.size()));
    receives.push_back(r);
  }
  receives.insert(receives.end(), requests.begin(), requests.end());
  RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(receives, deadline));
  if (!replacement) {
    DropAllBut(step);
    CountParities();
    return 0;
  }

  int64_t rebuilt = 0;
  for (size_t l = 0; l < L; ++l) {
    // The blob, chunk by chunk: its holder's parity XOR the other sources' chunks of the stripe
    // (beyond the chunk's end, all of them XOR to zeros); each chunk's CRC as its holder
    // recorded it.
    const int64_t blob_bytes = blob[l][node_];
    std::vector<char> mine(static_cast<size_t>(blob_bytes), '\0');
    for (int c = 0; c < k; ++c) {
      const ChunkSpan span = ChunkOf(scheme_, stripes[l], blob[l], node_, c);
      for (const Incoming& in : incoming) {
        if (in.l != l || in.slot != 1 + c) continue;
        XorInto(mine.data() + span.offset, in.bytes.data(),
                std::min<int64_t>(span.bytes, static_cast<int64_t>(in.bytes.size())));
      }
      const int h = ParityHolder(scheme_, nodes_, node_, c);
      const size_t i = source_index(h, node_, c);
      const uint32_t want = static_cast<uint32_t>(at(h, l, 3 + k + i));
      const uint32_t have = Crc(mine.data() + span.offset, span.bytes);
      if (have != want) {
        return absl::DataLossError(absl::StrFormat(
            "rebuilt chunk %d of local rank %d's state on node %s (bytes [%d, %d) of %d) does not "
            "match its checksum: CRC-32 %08x, node %s recorded %08x at step %d",
            c, l, name(node_), span.offset, span.offset + span.bytes, blob_bytes, have, name(h),
            want, step));
      }
    }
    RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(mine.data(), blob_bytes));
    std::vector<StateSegment> placed;
    for (const auto& [segment, where] : segments) {
      RAGSHARD_ASSIGN_OR_RETURN(char* to, place(static_cast<int>(l), segment, where.second));
      if (where.second > 0) {
        std::memcpy(to, mine.data() + where.first, static_cast<size_t>(where.second));
      }
      placed.push_back({segment, to, where.second});
    }
    Record(static_cast<int>(l), placed, step);
    rebuilt += blob_bytes;
    // This node's own parity, from its sources' chunks as they are now.
    Slot& slot = SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(Fill(&slot, stripes[l][node_]));
    for (const ChunkRef& src : ParitySources(scheme_, nodes_, node_)) {
      const Incoming* from = nullptr;
      for (const Incoming& in : incoming) {
        if (in.l == l && in.slot == 0 && in.from == src.node) from = &in;
      }
      const int64_t bytes = from == nullptr ? 0 : static_cast<int64_t>(from->bytes.size());
      if (from != nullptr) XorInto(slot.lease.data(), from->bytes.data(), bytes);
      slot.source_blob.push_back(blob[l][src.node]);
      slot.source_crc.push_back(Crc(from == nullptr ? "" : from->bytes.data(), bytes));
    }
    slot.step = step;
    slot.made = ++made_;
    rebuilt += stripes[l][node_];
  }
  DropAllBut(step);
  CountParities();
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
    blobs[l] = MakeBlob(state[l], &mine[2 + 2 * l]);
    mine[3 + 2 * l] = Crc(blobs[l].data(), static_cast<int64_t>(blobs[l].size()));
  }
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(blocks.data()),
                                     block * sizeof(int64_t), deadline, Stamp(seq, 2, 0)));
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
    const uint64_t tag = Stamp(seq, 3, static_cast<uint64_t>(c.to_local));
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
    const uint32_t have = Crc(blob.data(), bytes);
    if (have != want) {
      return absl::DataLossError(absl::StrFormat(
          "the state of local rank %d copied from node %s's local rank %d (%d bytes) does not "
          "match its checksum: CRC-32 %08x, the sender's %08x, at step %d",
          c.to_local, name(c.from), c.from_local, bytes, have, want, step));
    }
    RAGSHARD_ASSIGN_OR_RETURN(auto segments, ReadDirectory(blob.data(), bytes));
    for (const auto& [segment, where] : segments) {
      RAGSHARD_ASSIGN_OR_RETURN(char* to, place(c.to_local, segment, where.second));
      if (where.second > 0) {
        std::memcpy(to, blob.data() + where.first, static_cast<size_t>(where.second));
      }
    }
    rebuilt += bytes;
  }
  return rebuilt;
}

}  // namespace ragshard::daemon
