// Protobuf messages as bytes and as JSON, written once for every user.
#pragma once

#include <string>

#include "google/protobuf/message.h"

namespace ragshard {

// The message's wire bytes with deterministic serialization (map entries sorted): equal
// messages give equal bytes, so they can be hashed, stored and compared byte for byte.
std::string DeterministicBytes(const google::protobuf::Message& m);

// The message as protobuf JSON with every field printed (defaults too); `proto_names` keeps the
// .proto's snake_case names (the Python package reads those), `indent` adds whitespace.
std::string ProtoJson(const google::protobuf::Message& m, bool proto_names, bool indent);

}  // namespace ragshard
