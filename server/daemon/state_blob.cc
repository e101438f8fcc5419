#include "server/daemon/state_blob.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/daemon/comm.h"

namespace ragshard::daemon {
namespace {

constexpr char kDirectoryMagic[] = "ragshard-state 1\n";

// The directory that opens a blob: the magic line, "<bytes> <name>" per segment, an empty line,
// zero-padded to 64 bytes.
std::string Directory(const std::vector<StateSegment>& segments) {
  std::string d = kDirectoryMagic;
  for (const StateSegment& s : segments) absl::StrAppend(&d, s.bytes, " ", s.name, "\n");
  d += "\n";
  d.resize((d.size() + 63) / 64 * 64, '\0');
  return d;
}

}  // namespace

uint64_t RedundancyStamp(uint64_t seq, uint64_t phase, uint64_t index) {
  MessageStamp s;
  s.seq = seq;
  s.unit = 0xFF00 + phase;
  s.kind = MessageStamp::kNone;
  s.index = index;
  s.background = phase == kProtectWindows;
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

uint32_t Crc32(const char* data, int64_t bytes) { return Crc32Extend(0, data, bytes); }

uint32_t Crc32Extend(uint32_t crc, const char* data, int64_t bytes) {
  if (bytes <= 0) return crc;
  // ISA-L's gzip CRC is zlib's crc32 (same polynomial, inversions and chaining), vectorized.
  return crc32_gzip_refl(crc, reinterpret_cast<const unsigned char*>(data),
                         static_cast<uint64_t>(bytes));
}

BlobView::BlobView(const std::vector<StateSegment>& segments)
    : segments_(segments), directory_(Directory(segments)) {
  bytes_ = static_cast<int64_t>(directory_.size());
  for (const StateSegment& s : segments_) {
    starts_.push_back(bytes_);
    bytes_ += s.bytes;
  }
}

absl::Status CopiedHostMemory::ToHost(char* out, const char* from, int64_t n) const {
  std::memcpy(out, from, static_cast<size_t>(n));
  return absl::OkStatus();
}

absl::Status CopiedHostMemory::FromHost(char* to, const char* in, int64_t n) const {
  std::memcpy(to, in, static_cast<size_t>(n));
  return absl::OkStatus();
}

absl::Status ReadSegment(const StateSegment& s, int64_t from, int64_t n, char* out) {
  if (n <= 0) return absl::OkStatus();
  if (s.memory != nullptr) return s.memory->ToHost(out, s.data + from, n);
  std::memcpy(out, s.data + from, static_cast<size_t>(n));
  return absl::OkStatus();
}

absl::Status WriteSegment(const StateSegment& s, const char* in) {
  if (s.bytes <= 0) return absl::OkStatus();
  if (s.memory != nullptr) return s.memory->FromHost(s.data, in, s.bytes);
  std::memcpy(s.data, in, static_cast<size_t>(s.bytes));
  return absl::OkStatus();
}

absl::Status BlobView::Read(int64_t from, int64_t n, char* out) const {
  const int64_t end = from + n;
  const int64_t dir = static_cast<int64_t>(directory_.size());
  if (from < dir) {
    const int64_t take = std::min(end, dir) - from;
    std::memcpy(out, directory_.data() + from, static_cast<size_t>(take));
    out += take;
    from += take;
  }
  // The first segment that ends after `from`, then on until `end`.
  auto it = std::upper_bound(starts_.begin(), starts_.end(), from);
  size_t i = it == starts_.begin() ? 0 : static_cast<size_t>(it - starts_.begin()) - 1;
  for (; from < end && i < segments_.size(); ++i) {
    const int64_t lo = starts_[i];
    const int64_t hi = lo + segments_[i].bytes;
    if (hi <= from) continue;
    const int64_t take = std::min(end, hi) - from;
    if (absl::Status s = ReadSegment(segments_[i], from - lo, take, out); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("reading state segment '", segments_[i].name, "': ", s.message()));
    }
    out += take;
    from += take;
  }
  return absl::OkStatus();
}

const char* BlobView::Contiguous(int64_t from, int64_t n) const {
  const int64_t dir = static_cast<int64_t>(directory_.size());
  if (from + n <= dir) return directory_.data() + from;
  auto it = std::upper_bound(starts_.begin(), starts_.end(), from);
  if (from < dir || it == starts_.begin()) return nullptr;
  const size_t i = static_cast<size_t>(it - starts_.begin()) - 1;
  if (from + n > starts_[i] + segments_[i].bytes || segments_[i].memory != nullptr) return nullptr;
  return segments_[i].data + (from - starts_[i]);
}

absl::StatusOr<std::vector<char>> MakeBlob(const std::vector<StateSegment>& segments,
                                           int64_t* blob_bytes) {
  const BlobView view(segments);
  *blob_bytes = view.bytes();
  std::vector<char> blob(static_cast<size_t>(view.bytes()), '\0');
  if (absl::Status s = view.Read(0, view.bytes(), blob.data()); !s.ok()) return s;
  return blob;
}

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

}  // namespace ragshard::daemon
