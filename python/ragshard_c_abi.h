// What every file of libragshard_c (the C ABI of ragshard_c.h) answers its caller with: the
// error a failed call leaves for rs_last_error, and the string a call hands out (valid until the
// thread's next such call). One definition of each, shared by ragshard_c.cc (clients and jobs)
// and ragshard_c_local.cc (the calls that need no planner or daemon).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/message.h"

namespace ragshard::c_abi {

// Records `message` as this thread's last error and returns `code`.
int Fail(int code, std::string message);
// The status's code, and "CODE: message" as the last error.
int Fail(const absl::Status& s);
// Hands `value` out through *out (this thread's last string) and returns 0.
int Out(std::string value, const char** out);
// The C string as a std::string; NULL as empty.
std::string Str(const char* s);
// The message as the Python side reads it (ProtoJson, fields by their proto names).
std::string ToJson(const google::protobuf::Message& m);
// This thread's last error.
const char* LastError();

}  // namespace ragshard::c_abi
