#include "ragshard_c_abi.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "infra/proto_text.h"

namespace ragshard::c_abi {
namespace {

thread_local std::string last_error;
thread_local std::string last_string;

}  // namespace

int Fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

int Fail(const absl::Status& s) {
  return Fail(static_cast<int>(s.code()),
              absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message()));
}

int Out(std::string value, const char** out) {
  last_string = std::move(value);
  *out = last_string.c_str();
  return 0;
}

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

std::string ToJson(const google::protobuf::Message& m) { return ProtoJson(m, true, false); }

const char* LastError() { return last_error.c_str(); }

}  // namespace ragshard::c_abi
