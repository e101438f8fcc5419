#include "engine/plan_codec.h"

#include <zstd.h>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/proto_text.h"

namespace ragshard {

namespace {

// The most a plan may expand to: the gRPC message limit of the planner and the daemon.
constexpr int64_t kMaxPlanBytes = int64_t{1} << 30;

}  // namespace

std::string ZstdCompress(absl::string_view bytes, int level) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), level);
  // Compression into a buffer of ZSTD_compressBound bytes fails only without memory.
  CHECK(!ZSTD_isError(n)) << "zstd: " << ZSTD_getErrorName(n);
  out.resize(n);
  return out;
}

bool IsZstdFrame(absl::string_view bytes) {
  return bytes.size() >= 4 && static_cast<unsigned char>(bytes[0]) == 0x28 &&
         static_cast<unsigned char>(bytes[1]) == 0xB5 &&
         static_cast<unsigned char>(bytes[2]) == 0x2F &&
         static_cast<unsigned char>(bytes[3]) == 0xFD;
}

absl::StatusOr<std::string> ZstdDecompress(absl::string_view frame, int64_t max_bytes) {
  const uint64_t size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR) {
    return absl::DataLossError("not a zstd frame (bad magic number or header)");
  }
  if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
    return absl::DataLossError("the zstd frame does not state its content size");
  }
  if (size > static_cast<uint64_t>(max_bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the zstd frame states ", size, " bytes, more than the limit of ", max_bytes));
  }
  std::string out(static_cast<size_t>(size), '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), frame.data(), frame.size());
  if (ZSTD_isError(n)) {
    return absl::DataLossError(absl::StrCat("corrupt zstd frame: ", ZSTD_getErrorName(n)));
  }
  if (n != out.size()) {
    return absl::DataLossError(
        absl::StrCat("the zstd frame held ", n, " bytes, not the ", size, " it states"));
  }
  return out;
}

std::string CompressPlan(const v1::Plan& plan) { return ZstdCompress(DeterministicBytes(plan)); }

absl::StatusOr<v1::Plan> DecodePlan(absl::string_view bytes, absl::string_view what) {
  std::string plain;
  if (IsZstdFrame(bytes)) {
    auto d = ZstdDecompress(bytes, kMaxPlanBytes);
    if (!d.ok())
      return absl::Status(d.status().code(), absl::StrCat(what, ": ", d.status().message()));
    plain = std::move(*d);
    bytes = plain;
  }
  v1::Plan plan;
  if (!plan.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::DataLossError(absl::StrCat(what, ": not a valid plan"));
  }
  return plan;
}

}  // namespace ragshard
