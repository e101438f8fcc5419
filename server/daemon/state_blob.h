// A rank's protected state as one blob (redundancy.h): a directory naming each segment and its
// size, then the segments; and what the redundancy's messages and checks are made of (their
// stamps, the XOR of chunks, their CRC-32).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ragshard::daemon {

// Memory a segment's bytes may be in other than this process's host memory: a GPU's (the CUDA
// backend's slab), which the daemon reaches only through copies. Every read and write of a
// segment goes through ReadSegment and WriteSegment, so the host backends and the CUDA one run
// the same protect and rebuild (docs/recovery.md, "On a GPU").
class SegmentMemory {
 public:
  virtual ~SegmentMemory() = default;
  // Copies `n` bytes at `from` (in this memory) to host memory `out`; complete on return.
  virtual absl::Status ToHost(char* out, const char* from, int64_t n) const = 0;
  // Copies `n` bytes of host memory `in` to `to` (in this memory); complete on return.
  virtual absl::Status FromHost(char* to, const char* in, int64_t n) const = 0;
};

// Host memory reached as a device's is, through copies: the device-shaped backend's ranks'
// memory, so that CI runs the path the CUDA backend takes.
class CopiedHostMemory final : public SegmentMemory {
 public:
  absl::Status ToHost(char* out, const char* from, int64_t n) const override;
  absl::Status FromHost(char* to, const char* in, int64_t n) const override;
};

// One segment of a rank's protected state: "shard/<unit>" (a parameter shard) or a state
// buffer's name. `memory`: where `data` points, nullptr for this process's host memory.
struct StateSegment {
  std::string name;
  char* data = nullptr;
  int64_t bytes = 0;
  const SegmentMemory* memory = nullptr;
};

// Copies the segment's bytes [from, from + n) to host memory `out`, or host memory `in` to them.
absl::Status ReadSegment(const StateSegment& s, int64_t from, int64_t n, char* out);
absl::Status WriteSegment(const StateSegment& s, const char* in);

// The stamp of a redundancy operation's message: unit field 0xFF00 + phase (no unit of a plan
// reaches it in practice; the sequence number tells operations apart anyway). The protect's
// windows (kProtectWindows) go in the background lane (comm.h): each node posts them at
// moments of its own, across the collectives.
constexpr uint64_t kProtectWindows = 1;
uint64_t RedundancyStamp(uint64_t seq, uint64_t phase, uint64_t index);
// dst[i] ^= src[i] for i < bytes.
void XorInto(char* dst, const char* src, int64_t bytes);
// The CRC-32 of `bytes` bytes.
uint32_t Crc32(const char* data, int64_t bytes);

// CRC-32 `crc` (of bytes before) extended over `bytes` more: Crc32Extend(Crc32(a), b) is the
// CRC-32 of a then b; Crc32Extend(Crc32(nullptr, 0), ...) starts one.
uint32_t Crc32Extend(uint32_t crc, const char* data, int64_t bytes);

// The blob of `segments` (the directory: a magic line, "<bytes> <name>" per segment, an empty
// line, zero-padded to 64 bytes; then the segments), read in pieces without making it whole
// (Protect's windows). Refers to `segments`, which must outlive it.
class BlobView {
 public:
  explicit BlobView(const std::vector<StateSegment>& segments);
  int64_t bytes() const { return bytes_; }
  // Copies the blob's bytes [from, from + n) into `out` (n >= 0, from + n <= bytes()); a
  // segment's memory's error.
  absl::Status Read(int64_t from, int64_t n, char* out) const;
  // Where the blob's bytes [from, from + n) lie in one piece of host memory (inside one segment
  // in host memory, or the directory), or nullptr where they span several or lie in a device's
  // memory: what a send can take without a copy.
  const char* Contiguous(int64_t from, int64_t n) const;

 private:
  const std::vector<StateSegment>& segments_;
  std::string directory_;
  std::vector<int64_t> starts_;  // where each segment starts in the blob
  int64_t bytes_ = 0;
};

// The blob of `segments`, whole; `blob_bytes` gets its size.
absl::StatusOr<std::vector<char>> MakeBlob(const std::vector<StateSegment>& segments,
                                           int64_t* blob_bytes);
// The segments a blob's directory names, with where their bytes start: (name, (offset, bytes)).
// DATA_LOSS where the directory is missing, has no end, or names bytes past the blob's end.
absl::StatusOr<std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>> ReadDirectory(
    const char* blob, int64_t blob_bytes);

}  // namespace ragshard::daemon
