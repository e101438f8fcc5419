#include "server/daemon/redundancy.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "infra/status_macros.h"
#include "server/daemon/collectives.h"

namespace ragshard::daemon {

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

// What a protect under way keeps between its windows: the state it reads (the blob views
// refer to it), the flows it sends and receives, the new parities, its staging and where it is.
struct NodeRedundancy::Pending {
  struct Flow {
    int peer = 0;
    size_t l = 0;
    ChunkSpan span;
  };
  std::vector<std::vector<StateSegment>> state;
  std::vector<BlobView> views;
  std::vector<std::vector<int64_t>> blob;  // per local rank: every node's blob bytes
  std::vector<ChunkRef> sources;
  std::vector<Flow> out, in;
  bool direct = false;        // one source: its chunk is received into the parity in place
  std::vector<Slot*> slots;   // each local rank's new parity
  Lease stage;                // a window per flow for each window in flight
  std::vector<uint32_t> crc;  // of each incoming flow so far
  int64_t step = 0, longest = 0, window = 0;
  int64_t at = 0;                  // the next window to post
  std::vector<int64_t> flying;     // the windows in flight, in order
  std::vector<uint64_t> requests;  // theirs: the receives, then the sends
  absl::Time posted;               // when they were posted
  uint64_t seq = 0, laps = 2;
};

NodeRedundancy::~NodeRedundancy() = default;

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

absl::Status NodeRedundancy::Fill(Slot* slot, int64_t bytes, int64_t zero_from) {
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
  zero_from = std::clamp<int64_t>(zero_from, 0, bytes);
  std::memset(slot->lease.data() + zero_from, 0, static_cast<size_t>(bytes - zero_from));
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
  const uint32_t have = bytes <= slot->bytes && check ? Crc32(slot->lease.data(), bytes) : 0;
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

absl::Status NodeRedundancy::Protect(Comm& comm, std::vector<std::vector<StateSegment>> state,
                                     int64_t step, absl::Time deadline, uint64_t seq) {
  RAGSHARD_RETURN_IF_ERROR(StartProtect(comm, std::move(state), step, deadline, seq));
  return FinishProtect(comm, deadline);
}

absl::Status NodeRedundancy::StartProtect(Comm& comm, std::vector<std::vector<StateSegment>> state,
                                          int64_t step, absl::Time deadline, uint64_t seq) {
  RAGSHARD_RETURN_IF_ERROR(FinishProtect(comm, deadline));
  if (scheme_.hsdp) return absl::OkStatus();  // the replicas are the redundancy
  absl::Status planned = PlanProtect(comm, std::move(state), step, deadline, seq);
  if (!planned.ok()) {
    AbandonProtect();
    CountParities();
  }
  return planned;
}

absl::Status NodeRedundancy::FinishProtect(Comm& comm, absl::Time deadline) {
  if (pending_ == nullptr) return absl::OkStatus();
  absl::Status done = EndProtect(comm, deadline);
  AbandonProtect();  // (its staging back to the pool, whole or not)
  CountParities();
  return done;
}

void NodeRedundancy::AbandonProtect() {
  if (pending_ == nullptr) return;
  // A parity not made whole keeps step -1 (Fill): no step counts it, and the next protect's
  // SlotFor takes it first.
  pending_.reset();
}

absl::Status NodeRedundancy::PlanProtect(Comm& comm, std::vector<std::vector<StateSegment>> state,
                                         int64_t step, absl::Time deadline, uint64_t seq) {
  const int k = scheme_.k;
  const size_t L = static_cast<size_t>(locals_);
  pending_ = std::make_unique<Pending>();
  Pending& p = *pending_;
  p.state = std::move(state);
  p.step = step;
  p.seq = seq;
  p.views.reserve(L);
  std::vector<int64_t> sizes(static_cast<size_t>(nodes_) * L, 0);
  for (size_t l = 0; l < L; ++l) {
    p.views.emplace_back(p.state[l]);
    sizes[node_ * L + l] = p.views[l].bytes();
  }
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(sizes.data()),
                                     L * sizeof(int64_t), deadline, RedundancyStamp(seq, 0, 0)));
  for (size_t l = 0; l < L; ++l) Record(static_cast<int>(l), p.state[l], step);
  int64_t mine = 0;
  for (size_t l = 0; l < L; ++l) mine += sizes[node_ * L + l];
  protected_bytes_.store(mine);
  // Per local rank: every node's blob bytes, and the stripes they make.
  p.blob.assign(L, std::vector<int64_t>(static_cast<size_t>(nodes_)));
  std::vector<std::vector<int64_t>> stripes(L);
  for (size_t l = 0; l < L; ++l) {
    for (int n = 0; n < nodes_; ++n) p.blob[l][n] = sizes[n * L + l];
    stripes[l] = StripeBytes(scheme_, p.blob[l]);
  }
  // What this node sends (its chunk c of each local rank's blob to chunk c's holder) and
  // receives (each source's chunk, XORed into this node's parity), window by window.
  for (int c = 0; c < k; ++c) {
    for (size_t l = 0; l < L; ++l) {
      p.out.push_back({ParityHolder(scheme_, nodes_, node_, c), l,
                       ChunkOf(scheme_, stripes[l], p.blob[l], node_, c)});
    }
  }
  p.sources = ParitySources(scheme_, nodes_, node_);
  for (const ChunkRef& src : p.sources) {
    for (size_t l = 0; l < L; ++l) {
      p.in.push_back({src.node, l, ChunkOf(scheme_, stripes[l], p.blob[l], src.node, src.chunk)});
    }
  }
  for (const std::vector<Pending::Flow>* flows : {&p.out, &p.in}) {
    for (const Pending::Flow& f : *flows) p.longest = std::max(p.longest, f.span.bytes);
  }
  // A parity of one source (replica, parity:1) is that source's chunk: received in place.
  p.direct = p.sources.size() == 1;
  p.slots.resize(L);
  for (size_t l = 0; l < L; ++l) {
    p.slots[l] = &SlotFor(static_cast<int>(l), step);
    RAGSHARD_RETURN_IF_ERROR(
        Fill(p.slots[l], stripes[l][node_], p.direct ? p.in[l].span.bytes : 0));
  }
  // The staging: one window per flow (none for the receives in place), leased from the pool
  // (its figures count it) for the protect's length only, whatever the state's size.
  p.window = std::min(p.longest, kProtectWindowBytes);
  const int64_t staging = p.window * kWindowsPerOperation *
                          static_cast<int64_t>(p.out.size() + (p.direct ? 0 : p.in.size()));
  if (staging > 0) {
    auto lease = pool_->Allocate(staging);
    if (!lease.ok()) {
      return absl::Status(
          lease.status().code(),
          absl::StrCat("the protect's staging of ", staging, " bytes (", p.out.size() + p.in.size(),
                       " windows of ", p.window, "; redundancy): ", lease.status().message()));
    }
    p.stage = std::move(*lease);
  }
  p.crc.assign(p.in.size(), Crc32(nullptr, 0));
  // Message indices tell a window's flows apart, and a window from the others in flight (a
  // node is at most two groups of windows ahead of its peers, whose receives its sends wait for).
  p.laps = std::max<uint64_t>(3 * kWindowsPerOperation,
                              MessageStamp::kMaxDataIndex / std::max<size_t>(L, 1));
  return absl::OkStatus();
}

absl::Status NodeRedundancy::AdvanceProtect(Comm& comm, int windows, absl::Duration patience) {
  if (pending_ == nullptr) return absl::OkStatus();
  Pending& p = *pending_;
  if (!p.flying.empty()) {
    RAGSHARD_ASSIGN_OR_RETURN(const bool landed, comm.Poll(p.requests, p.posted + patience));
    if (!landed) return absl::OkStatus();
    Land();
  }
  return PostWindows(comm, std::min(windows, kWindowsPerOperation));
}

bool NodeRedundancy::protect_in_flight() const {
  return pending_ != nullptr && (!pending_->flying.empty() || pending_->at < pending_->longest);
}

absl::Status NodeRedundancy::PostWindows(Comm& comm, int windows) {
  Pending& p = *pending_;
  const size_t L = static_cast<size_t>(locals_);
  const int64_t flows = static_cast<int64_t>(p.out.size() + (p.direct ? 0 : p.in.size()));
  std::vector<uint64_t> sends;
  for (int j = 0; j < windows && p.at < p.longest; ++j, p.at += p.window) {
    const int64_t at = p.at;
    const uint64_t index = static_cast<uint64_t>(at / p.window) % p.laps * L;
    char* const stage = p.stage.data() + j * flows * p.window;  // this window's staging
    for (size_t f = 0; f < p.out.size(); ++f) {
      const int64_t n = std::min(p.window, p.out[f].span.bytes - at);
      if (n <= 0) continue;
      const BlobView& view = p.views[p.out[f].l];
      const char* src = view.Contiguous(p.out[f].span.offset + at, n);
      if (src == nullptr) {
        char* buf = stage + static_cast<int64_t>(f) * p.window;
        RAGSHARD_RETURN_IF_ERROR(view.Read(p.out[f].span.offset + at, n, buf));
        src = buf;
      }
      RAGSHARD_ASSIGN_OR_RETURN(
          uint64_t r,
          comm.PostSend(p.out[f].peer, RedundancyStamp(p.seq, kProtectWindows, index + p.out[f].l),
                        src, static_cast<size_t>(n)));
      sends.push_back(r);
    }
    for (size_t f = 0; f < p.in.size(); ++f) {
      const int64_t n = std::min(p.window, p.in[f].span.bytes - at);
      if (n <= 0) continue;
      char* buf = p.direct ? p.slots[p.in[f].l]->lease.data() + at
                           : stage + static_cast<int64_t>(p.out.size() + f) * p.window;
      RAGSHARD_ASSIGN_OR_RETURN(
          uint64_t r,
          comm.PostRecv(p.in[f].peer, RedundancyStamp(p.seq, kProtectWindows, index + p.in[f].l),
                        buf, static_cast<size_t>(n)));
      p.requests.push_back(r);
    }
    p.flying.push_back(at);
  }
  p.requests.insert(p.requests.end(), sends.begin(), sends.end());
  p.posted = absl::Now();
  return absl::OkStatus();
}

void NodeRedundancy::Land() {
  Pending& p = *pending_;
  p.requests.clear();
  const int64_t flows = static_cast<int64_t>(p.out.size() + (p.direct ? 0 : p.in.size()));
  for (size_t j = 0; j < p.flying.size(); ++j) {
    const int64_t at = p.flying[j];
    const char* const stage = p.stage.data() + static_cast<int64_t>(j) * flows * p.window;
    for (size_t f = 0; f < p.in.size(); ++f) {
      const int64_t n = std::min(p.window, p.in[f].span.bytes - at);
      if (n <= 0) continue;
      char* parity = p.slots[p.in[f].l]->lease.data() + at;
      const char* buf =
          p.direct ? parity : stage + static_cast<int64_t>(p.out.size() + f) * p.window;
      if (!p.direct) XorInto(parity, buf, n);
      p.crc[f] = Crc32Extend(p.crc[f], buf, n);
    }
  }
  p.flying.clear();
}

absl::Status NodeRedundancy::EndProtect(Comm& comm, absl::Time deadline) {
  Pending& p = *pending_;
  const size_t L = static_cast<size_t>(locals_);
  do {
    if (!p.flying.empty()) {
      RAGSHARD_RETURN_IF_ERROR(comm.WaitAll(p.requests, deadline));
      Land();
    }
    RAGSHARD_RETURN_IF_ERROR(PostWindows(comm, kWindowsPerOperation));
  } while (!p.flying.empty());
  p.stage.Release();
  const uint64_t made = ++made_;
  for (size_t l = 0; l < L; ++l) {
    Slot& slot = *p.slots[l];
    for (size_t i = 0; i < p.sources.size(); ++i) {
      slot.source_blob.push_back(p.blob[l][p.sources[i].node]);
      slot.source_crc.push_back(p.crc[i * L + l]);
    }
    slot.step = p.step;
    slot.made = made;
  }
  CountParities();
  if (before_barrier_) RAGSHARD_RETURN_IF_ERROR(before_barrier_());
  // Every node has its parity of the step before any drops that of the step before: a node lost
  // from here on leaves the others holding one step's parity in common (redundancy.h).
  std::vector<int64_t> arrived(static_cast<size_t>(nodes_), 0);
  arrived[static_cast<size_t>(node_)] = p.step;
  RAGSHARD_RETURN_IF_ERROR(AllGather(comm, reinterpret_cast<char*>(arrived.data()), sizeof(int64_t),
                                     deadline, RedundancyStamp(p.seq, 4, 0)));
  DropAllBut(p.step);
  return absl::OkStatus();
}

}  // namespace ragshard::daemon
