#include "server/daemon/collectives.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/daemon/stream_copy.h"

namespace ragshard::daemon {

namespace {

size_t ItemSize(v1::DType dtype) { return dtype == v1::DTYPE_FP32 ? 4 : 2; }

int Mod(int a, int n) { return ((a % n) + n) % n; }

// The all-reduce's all-gather half numbers its messages from here (MessageStamp's index; ring
// steps stay below it, as a comm has at most 2^14 members).
constexpr uint64_t kAllGatherHalfIndex = uint64_t{1} << 15;

// A ring step's message in pieces: piece j of step s is message index s * pieces + j. Callers
// keep (steps) * pieces within 2^14, so that the all-reduce's second half stays apart.
uint64_t RingIndex(int s, size_t j, size_t pieces) { return static_cast<uint64_t>(s) * pieces + j; }

// Pieces start on multiples of 16 fp32 elements (64 bytes, a cache line).
constexpr size_t kPieceAlignElems = 16;

// [0, total) cut into `count` pieces whose starts are multiples of `align`.
class Pieces {
 public:
  Pieces(size_t total, size_t count, size_t align) : total_(total), count_(count), align_(align) {}
  size_t count() const { return count_; }
  size_t lo(size_t j) const { return j == 0 ? 0 : total_ * j / count_ / align_ * align_; }
  size_t hi(size_t j) const { return j + 1 == count_ ? total_ : lo(j + 1); }
  size_t bytes(size_t j) const { return hi(j) - lo(j); }  // in units of the total

 private:
  size_t total_, count_, align_;
};

}  // namespace

size_t PiecesFor(size_t step_bytes, int members) {
  if (members < 2) return 1;
  const size_t by_size = std::clamp<size_t>(step_bytes / kMinPieceBytes, 1, kMaxPieces);
  const size_t by_index = std::max<size_t>(1, (size_t{1} << 14) / static_cast<size_t>(members - 1));
  return std::min(by_size, by_index);
}

absl::Status AllGather(Comm& comm, char* buffer, size_t block_bytes, absl::Time deadline,
                       uint64_t tag_base) {
  return AllGather(comm, buffer + static_cast<size_t>(comm.rank()) * block_bytes, buffer,
                   block_bytes, deadline, tag_base);
}

absl::Status AllGather(Comm& comm, const char* own, char* buffer, size_t block_bytes,
                       absl::Time deadline, uint64_t tag_base) {
  const int n = comm.size(), r = comm.rank();
  // The own block's placement, in steps the waits below run while the transfers leave this
  // thread idle; what they leave is copied at the end.
  char* const slot = buffer + static_cast<size_t>(r) * block_bytes;
  size_t placed = own == slot ? block_bytes : 0;
  const IdleWork place = [&] {
    const size_t step = std::min(kPlacementStepBytes, block_bytes - placed);
    StreamCopy(slot + placed, own + placed, step);
    placed += step;
    return placed < block_bytes;
  };
  auto finish = [&](absl::Status st) {
    if (st.ok()) {
      while (placed < block_bytes) place();
    }
    return st;
  };
  auto idle = [&] { return placed < block_bytes ? place : IdleWork(); };
  if (n == 1 || block_bytes == 0) return finish(absl::OkStatus());
  std::vector<uint64_t> sends;
  if (block_bytes <= kDirectMaxBlockBytes) {
    // Direct: one round, every peer sends its block to every other peer.
    std::vector<uint64_t> reqs;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      auto recv =
          comm.PostRecv(p, tag_base, buffer + static_cast<size_t>(p) * block_bytes, block_bytes);
      if (!recv.ok()) return recv.status();
      reqs.push_back(*recv);
    }
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      auto send = comm.PostSend(p, tag_base, own, block_bytes);
      if (!send.ok()) return send.status();
      reqs.push_back(*send);
    }
    return finish(comm.WaitAll(reqs, deadline, idle()));
  }
  // Ring: n - 1 steps; at step s, forward block (r - s) and receive block (r - s - 1). Each
  // block travels in pieces, and a piece is forwarded as soon as it has arrived, so that a
  // block's steps overlap instead of following one another (with two members there is one step,
  // and one piece).
  const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
  const Pieces pieces(block_bytes, n > 2 ? PiecesFor(block_bytes, n) : 1, 64);
  auto at = [&](int block, size_t j) {
    return buffer + static_cast<size_t>(block) * block_bytes + pieces.lo(j);
  };
  // Every receive is posted up front: each lands where it stays.
  std::vector<uint64_t> recvs;
  for (int s = 0; s < n - 1; ++s) {
    for (size_t j = 0; j < pieces.count(); ++j) {
      auto recv = comm.PostRecv(prev, tag_base + RingIndex(s, j, pieces.count()),
                                at(Mod(r - s - 1, n), j), pieces.bytes(j));
      if (!recv.ok()) return recv.status();
      recvs.push_back(*recv);
    }
  }
  for (size_t j = 0; j < pieces.count(); ++j) {
    auto send = comm.PostSend(next, tag_base + RingIndex(0, j, pieces.count()), own + pieces.lo(j),
                              pieces.bytes(j));
    if (!send.ok()) return send.status();
    sends.push_back(*send);
  }
  for (int s = 0; s < n - 1; ++s) {
    for (size_t j = 0; j < pieces.count(); ++j) {
      absl::Status st = comm.WaitAll({recvs[s * pieces.count() + j]}, deadline, idle());
      if (!st.ok()) return st;
      if (s == n - 2) continue;
      auto send = comm.PostSend(next, tag_base + RingIndex(s + 1, j, pieces.count()),
                                at(Mod(r - s - 1, n), j), pieces.bytes(j));
      if (!send.ok()) return send.status();
      sends.push_back(*send);
    }
  }
  return finish(comm.WaitAll(sends, deadline, idle()));
}

absl::Status ReduceScatter(Comm& comm, const void* input, v1::DType dtype, size_t count,
                           float* output, ReduceOp op, float* scratch, absl::Time deadline,
                           uint64_t tag_base) {
  const void* inputs[] = {input};
  return ReduceScatter(comm, absl::MakeConstSpan(inputs), dtype, count, output, op, scratch,
                       deadline, tag_base);
}

absl::Status ReduceScatter(Comm& comm, absl::Span<const void* const> inputs, v1::DType dtype,
                           size_t count, float* output, ReduceOp op, float* scratch,
                           absl::Time deadline, uint64_t tag_base, const ChunkRuns* runs) {
  if (dtype != v1::DTYPE_FP32 && dtype != v1::DTYPE_BF16 && dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: dtype must be fp32, bf16 or fp16");
  }
  const int n = comm.size(), r = comm.rank();
  if (runs != nullptr &&
      (runs->runs * runs->run_elems != count || runs->offsets.size() != runs->runs * n)) {
    return absl::InvalidArgumentError("reduce_scatter: the chunk runs do not cover the chunks");
  }
  const size_t item = ItemSize(dtype);
  // Element e of chunk c of every input: at c * count + e, or inside the chunk's runs.
  const auto input_offset = [&](int c, size_t e) {
    if (runs == nullptr) return static_cast<size_t>(c) * count + e;
    const size_t t = e / runs->run_elems;
    return runs->offsets[static_cast<size_t>(c) * runs->runs + t] + e % runs->run_elems;
  };
  // Elements [lo, hi) of chunk c are contiguous in the inputs up to the next run boundary.
  const auto contiguous_to = [&](size_t lo, size_t hi) {
    if (runs == nullptr) return hi;
    return std::min(hi, (lo / runs->run_elems + 1) * runs->run_elems);
  };
  // acc[lo, hi) = base[lo, hi) + elements [lo, hi) of chunk c of every input (base nullptr: 0),
  // in one pass over acc for the first input and one per further input. acc may be base, or
  // chunk c of an input (element by element, each read before it is written).
  auto sum_chunk = [&](int c, size_t lo, size_t hi, const float* base, float* acc) {
    if (inputs.empty()) {
      if (base == nullptr) std::fill(acc + lo, acc + hi, 0.0f);
      if (base != nullptr && base != acc) std::copy(base + lo, base + hi, acc + lo);
      return;
    }
    for (size_t a = lo; a < hi;) {
      const size_t b = contiguous_to(a, hi), m = b - a;
      const size_t at = input_offset(c, a) * item;
      if (base == nullptr) {
        Convert(static_cast<const char*>(inputs[0]) + at, dtype, m, acc + a);
      } else {
        Add(base + a, static_cast<const char*>(inputs[0]) + at, dtype, m, acc + a);
      }
      for (size_t k = 1; k < inputs.size(); ++k) {
        Accumulate(static_cast<const char*>(inputs[k]) + at, dtype, m, acc + a);
      }
      a = b;
    }
  };
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(n) : 1.0f;
  auto finish = [&] {
    if (scale != 1.0f) {
      for (size_t i = 0; i < count; ++i) output[i] *= scale;
    }
  };
  if (n == 1) {
    sum_chunk(0, 0, count, nullptr, output);
    finish();
    return absl::OkStatus();
  }
  // Ring with fp32 partial sums: at step s, send the partial of chunk (r - s - 1) and receive the
  // partial of chunk (r - s - 2), to which the local contribution is added before it moves on;
  // at the last step that sum is written straight into the output. The first partial is this
  // member's own chunk: sent from the input itself when it is one fp32 buffer.
  //
  // Pipelined: every step's partial travels in pieces. A piece is reduced as soon as it has
  // arrived, while the next ones are in transit, and forwarded at once, so the reduction
  // overlaps the transfers; the first partial (with several inputs, the node's ranks' sum) is
  // formed piece by piece, each sent as soon as it is summed.
  //
  // Buffers: step s receives into bufs[s % 2]; the partial it forwards is that buffer, reduced
  // in place, and the first partial (when formed) is bufs[1]. So step s + 1 receives into the
  // buffer step s - 1's sends read from: its receives are posted once those sends are done.
  const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
  const Pieces pieces(count, PiecesFor(count * sizeof(float), n), kPieceAlignElems);
  const size_t np = pieces.count();
  float* const bufs[2] = {scratch, scratch + count};
  const bool direct = inputs.size() == 1 && dtype == v1::DTYPE_FP32 && runs == nullptr;
  std::vector<uint64_t> sends, next_sends, recvs(np);
  auto send_piece = [&](int s, size_t j, const float* from) -> absl::Status {
    auto send = comm.PostSend(next, tag_base + RingIndex(s, j, np), from + pieces.lo(j),
                              pieces.bytes(j) * sizeof(float));
    if (!send.ok()) return send.status();
    next_sends.push_back(*send);
    return absl::OkStatus();
  };
  for (int s = 0; s < n - 1; ++s) {
    float* const rbuf = bufs[s % 2];
    if (s > 0) {
      // rbuf was read by the previous step's sends (or, at s = 1, the first partial's).
      absl::Status st = comm.WaitAll(sends, deadline);
      if (!st.ok()) return st;
    }
    sends = std::move(next_sends);
    next_sends.clear();
    for (size_t j = 0; j < np; ++j) {
      auto recv = comm.PostRecv(prev, tag_base + RingIndex(s, j, np), rbuf + pieces.lo(j),
                                pieces.bytes(j) * sizeof(float));
      if (!recv.ok()) return recv.status();
      recvs[j] = *recv;
    }
    if (s == 0) {
      const int c = Mod(r - 1, n);
      const float* first =
          direct ? static_cast<const float*>(inputs[0]) + input_offset(c, 0) : bufs[1];
      for (size_t j = 0; j < np; ++j) {
        if (!direct) sum_chunk(c, pieces.lo(j), pieces.hi(j), nullptr, bufs[1]);
        if (absl::Status st = send_piece(0, j, first); !st.ok()) return st;
      }
      sends = std::move(next_sends);
      next_sends.clear();
    }
    for (size_t j = 0; j < np; ++j) {
      absl::Status st = comm.WaitAll({recvs[j]}, deadline);
      if (!st.ok()) return st;
      if (s == n - 2) {
        // The partial received last is chunk r's without this member: complete it into
        // `output`.
        sum_chunk(r, pieces.lo(j), pieces.hi(j), rbuf, output);
      } else {
        sum_chunk(Mod(r - s - 2, n), pieces.lo(j), pieces.hi(j), rbuf, rbuf);
        if (absl::Status st2 = send_piece(s + 1, j, rbuf); !st2.ok()) return st2;
      }
    }
  }
  sends.insert(sends.end(), next_sends.begin(), next_sends.end());
  if (absl::Status st = comm.WaitAll(sends, deadline); !st.ok()) return st;
  finish();
  return absl::OkStatus();
}

absl::Status AllGatherRuns(Comm& comm, char* buffer, const std::vector<ByteRuns>& runs,
                           absl::Time deadline, uint64_t tag_base) {
  const int n = comm.size(), r = comm.rank();
  if (runs.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError("all_gather: one list of runs per member is needed");
  }
  size_t most = 0;
  for (const ByteRuns& m : runs) most = std::max(most, m.size());
  if (n == 1) return absl::OkStatus();
  if (most * static_cast<size_t>(n - 1) > (size_t{1} << 14)) {
    return absl::InvalidArgumentError("all_gather: too many runs for the message indices");
  }
  // Ring: at step s, forward member (r - s)'s runs and receive member (r - s - 1)'s; run t of
  // step s is message s * most + t.
  const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    std::vector<uint64_t> reqs;
    for (size_t t = 0; t < runs[Mod(r - s - 1, n)].size(); ++t) {
      const auto& [at, bytes] = runs[Mod(r - s - 1, n)][t];
      auto recv = comm.PostRecv(prev, tag_base + RingIndex(s, t, most), buffer + at, bytes);
      if (!recv.ok()) return recv.status();
      reqs.push_back(*recv);
    }
    for (size_t t = 0; t < runs[Mod(r - s, n)].size(); ++t) {
      const auto& [at, bytes] = runs[Mod(r - s, n)][t];
      auto send = comm.PostSend(next, tag_base + RingIndex(s, t, most), buffer + at, bytes);
      if (!send.ok()) return send.status();
      reqs.push_back(*send);
    }
    if (absl::Status st = comm.WaitAll(reqs, deadline); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status AllReduceInPlace(Comm& comm, float* data, size_t count, ReduceOp op, float* scratch,
                              absl::Time deadline, uint64_t tag_base) {
  const int n = comm.size();
  if (n == 1) return absl::OkStatus();
  if (count % static_cast<size_t>(n) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_reduce: ", count, " elements do not split into ", n, " chunks"));
  }
  const size_t chunk = count / static_cast<size_t>(n);
  // The reduce-scatter reads chunk rank() for the last time before it writes its output, so the
  // output may be that chunk itself.
  float* mine = data + chunk * static_cast<size_t>(comm.rank());
  absl::Status st =
      ReduceScatter(comm, data, v1::DTYPE_FP32, chunk, mine, op, scratch, deadline, tag_base);
  if (!st.ok()) return st;
  return AllGather(comm, reinterpret_cast<char*>(data), chunk * sizeof(float), deadline,
                   tag_base + kAllGatherHalfIndex);
}

absl::Status AllReduce(Comm& comm, float* data, size_t count, ReduceOp op, absl::Time deadline,
                       uint64_t tag_base) {
  const int n = comm.size();
  if (n == 1) return absl::OkStatus();
  const size_t chunk = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  std::vector<float> padded(chunk * static_cast<size_t>(n), 0.0f);
  std::copy(data, data + count, padded.begin());
  std::vector<float> scratch(2 * chunk);
  absl::Status st =
      AllReduceInPlace(comm, padded.data(), padded.size(), op, scratch.data(), deadline, tag_base);
  if (!st.ok()) return st;
  std::copy(padded.begin(), padded.begin() + static_cast<std::ptrdiff_t>(count), data);
  return absl::OkStatus();
}

}  // namespace ragshard::daemon
