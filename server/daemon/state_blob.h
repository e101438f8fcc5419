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

// One segment of a rank's protected state: "shard/<unit>" (a parameter shard) or a state
// buffer's name.
struct StateSegment {
  std::string name;
  char* data = nullptr;
  int64_t bytes = 0;
};

// The stamp of a redundancy operation's message: unit field 0xFF00 + phase (no unit of a plan
// reaches it in practice; the sequence number tells operations apart anyway).
uint64_t RedundancyStamp(uint64_t seq, uint64_t phase, uint64_t index);
// dst[i] ^= src[i] for i < bytes.
void XorInto(char* dst, const char* src, int64_t bytes);
// The CRC-32 of `bytes` bytes.
uint32_t Crc32(const char* data, int64_t bytes);

// The blob of `segments`: the directory (a magic line, "<bytes> <name>" per segment, an empty
// line, zero-padded to 64 bytes), then the segments; `blob_bytes` gets its size.
std::vector<char> MakeBlob(const std::vector<StateSegment>& segments, int64_t* blob_bytes);
// The segments a blob's directory names, with where their bytes start: (name, (offset, bytes)).
// DATA_LOSS where the directory is missing, has no end, or names bytes past the blob's end.
absl::StatusOr<std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>> ReadDirectory(
    const char* blob, int64_t blob_bytes);

}  // namespace ragshard::daemon
