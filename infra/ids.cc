#include "infra/ids.h"

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

bool IdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '/' || c == '-';
}

}  // namespace

absl::Status ValidateId(absl::string_view field, const std::string& value, int64_t max_len) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
  };
  if (value.empty()) return bad("empty");
  if (static_cast<int64_t>(value.size()) > max_len) {
    return bad(absl::StrCat("longer than ", max_len, " characters"));
  }
  for (char c : value) {
    if (!IdChar(c)) {
      return bad(absl::StrCat("character 0x", absl::Hex(static_cast<unsigned char>(c)),
                              " not allowed (allowed: letters, digits and _ . : / -)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ragshard
