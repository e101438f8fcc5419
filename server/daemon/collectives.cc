#include "server/daemon/collectives.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/daemon/stream_copy.h"

namespace ragshard::daemon {

float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return 0x7fc0;  // NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void Accumulate(const void* src, v1::DType dtype, size_t count, float* acc) {
  switch (dtype) {
    case v1::DTYPE_FP32: {
      const float* s = static_cast<const float*>(src);
      for (size_t i = 0; i < count; ++i) acc[i] += s[i];
      break;
    }
    case v1::DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) acc[i] += Bf16ToFloat(s[i]);
      break;
    }
    case v1::DTYPE_FP16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) acc[i] += Fp16ToFloat(s[i]);
      break;
    }
    default:
      break;
  }
}

void Convert(const void* src, v1::DType dtype, size_t count, float* out) {
  switch (dtype) {
    case v1::DTYPE_FP32: {
      const float* s = static_cast<const float*>(src);
      if (s != out) std::copy(s, s + count, out);
      break;
    }
    case v1::DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(s[i]);
      break;
    }
    case v1::DTYPE_FP16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) out[i] = Fp16ToFloat(s[i]);
      break;
    }
    default:
      break;
  }
}

void Add(const float* base, const void* src, v1::DType dtype, size_t count, float* out) {
  switch (dtype) {
    case v1::DTYPE_FP32: {
      const float* s = static_cast<const float*>(src);
      for (size_t i = 0; i < count; ++i) out[i] = base[i] + s[i];
      break;
    }
    case v1::DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) out[i] = base[i] + Bf16ToFloat(s[i]);
      break;
    }
    case v1::DTYPE_FP16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) out[i] = base[i] + Fp16ToFloat(s[i]);
      break;
    }
    default:
      break;
  }
}

namespace {

size_t ItemSize(v1::DType dtype) { return dtype == v1::DTYPE_FP32 ? 4 : 2; }

int Mod(int a, int n) { return ((a % n) + n) % n; }

// The all-reduce's all-gather half numbers its messages from here (MessageStamp's index; ring
// steps stay below it, as a comm has at most 2^14 members).
constexpr uint64_t kAllGatherHalfIndex = uint64_t{1} << 15;

}  // namespace

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
  const IdleWork idle = placed < block_bytes ? place : IdleWork();
  if (n == 1 || block_bytes == 0) return finish(absl::OkStatus());
  std::vector<uint64_t> reqs;
  if (block_bytes <= kDirectMaxBlockBytes) {
    // Direct: one round, every peer sends its block to every other peer.
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
    return finish(comm.WaitAll(reqs, deadline, idle));
  }
  // Ring: n - 1 steps; at step s, forward block (r - s) and receive block (r - s - 1).
  const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = Mod(r - s, n), recv_block = Mod(r - s - 1, n);
    reqs.clear();
    auto recv = comm.PostRecv(prev, tag_base + static_cast<uint64_t>(s),
                              buffer + static_cast<size_t>(recv_block) * block_bytes, block_bytes);
    if (!recv.ok()) return recv.status();
    reqs.push_back(*recv);
    const char* from =
        send_block == r ? own : buffer + static_cast<size_t>(send_block) * block_bytes;
    auto send = comm.PostSend(next, tag_base + static_cast<uint64_t>(s), from, block_bytes);
    if (!send.ok()) return send.status();
    reqs.push_back(*send);
    absl::Status st = comm.WaitAll(reqs, deadline, placed < block_bytes ? idle : IdleWork());
    if (!st.ok()) return st;
  }
  return finish(absl::OkStatus());
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
                           absl::Time deadline, uint64_t tag_base) {
  if (dtype != v1::DTYPE_FP32 && dtype != v1::DTYPE_BF16 && dtype != v1::DTYPE_FP16) {
    return absl::InvalidArgumentError("reduce_scatter: dtype must be fp32, bf16 or fp16");
  }
  const int n = comm.size(), r = comm.rank();
  const size_t item = ItemSize(dtype);
  const auto chunk_of = [&](const void* input, int c) {
    return static_cast<const char*>(input) + static_cast<size_t>(c) * count * item;
  };
  // acc = base + chunk c of every input (base nullptr: 0), in one pass over acc for the first
  // input and one per further input. acc may be base, or chunk c of an input (element by
  // element, each read before it is written).
  auto sum_chunk = [&](int c, const float* base, float* acc) {
    if (inputs.empty()) {
      if (base == nullptr) std::fill(acc, acc + count, 0.0f);
      if (base != nullptr && base != acc) std::copy(base, base + count, acc);
      return;
    }
    if (base == nullptr) {
      Convert(chunk_of(inputs[0], c), dtype, count, acc);
    } else {
      Add(base, chunk_of(inputs[0], c), dtype, count, acc);
    }
    for (size_t k = 1; k < inputs.size(); ++k) {
      Accumulate(chunk_of(inputs[k], c), dtype, count, acc);
    }
  };
  const float scale = op == ReduceOp::kAvg ? 1.0f / static_cast<float>(n) : 1.0f;
  auto finish = [&] {
    if (scale != 1.0f) {
      for (size_t i = 0; i < count; ++i) output[i] *= scale;
    }
  };
  if (n == 1) {
    sum_chunk(0, nullptr, output);
    finish();
    return absl::OkStatus();
  }
  // Ring with fp32 partial sums: at step s, send the partial of chunk (r - s - 1) and receive the
  // partial of chunk (r - s - 2), to which the local contribution is added before it moves on;
  // at the last step that sum is written straight into the output. The first partial is this
  // member's own chunk: sent from the input itself when it is one fp32 buffer.
  const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
  float* send_buf = scratch;
  float* recv_buf = scratch + count;
  const float* first = nullptr;
  if (inputs.size() == 1 && dtype == v1::DTYPE_FP32) {
    first = reinterpret_cast<const float*>(chunk_of(inputs[0], Mod(r - 1, n)));
  } else {
    sum_chunk(Mod(r - 1, n), nullptr, send_buf);
  }
  for (int s = 0; s < n - 1; ++s) {
    std::vector<uint64_t> reqs;
    auto recv =
        comm.PostRecv(prev, tag_base + static_cast<uint64_t>(s), recv_buf, count * sizeof(float));
    if (!recv.ok()) return recv.status();
    reqs.push_back(*recv);
    auto send = comm.PostSend(next, tag_base + static_cast<uint64_t>(s),
                              s == 0 && first != nullptr ? first : send_buf, count * sizeof(float));
    if (!send.ok()) return send.status();
    reqs.push_back(*send);
    absl::Status st = comm.WaitAll(reqs, deadline);
    if (!st.ok()) return st;
    if (s == n - 2) {
      // The partial received last is chunk r's without this member: complete it into `output`.
      sum_chunk(r, recv_buf, output);
    } else {
      sum_chunk(Mod(r - s - 2, n), recv_buf, recv_buf);
      std::swap(send_buf, recv_buf);
    }
  }
  finish();
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
