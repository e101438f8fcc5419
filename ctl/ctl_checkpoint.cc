#include "ctl/ctl_checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ctl/ctl_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "infra/proto_text.h"
#include "infra/rpc.h"

namespace ragshard {
namespace {

namespace fs = std::filesystem;
using google::protobuf::Struct;
using google::protobuf::Value;

constexpr char kFormat[] = "ragshard-checkpoint/1";
constexpr int kExitDamaged = 1;  // the checkpoint is damaged (else ctl/ctl_format.h)

// Bounds on what a metadata file may ask of the reader (Python writes 1 MiB chunks).
constexpr int64_t kMinChunk = 4096, kMaxChunk = int64_t{1} << 30;
constexpr uintmax_t kMaxMetadataBytes = uintmax_t{1} << 30;
// Element counts beyond this would overflow a byte size (and no file is that large).
constexpr double kMaxCount = 9.0e15;

// True for a name that stays inside its directory: not empty, no '/', not "." or "..".
bool PlainName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

// The checkpoint's directory: DIR itself, or the one DIR/latest names.
absl::StatusOr<fs::path> Resolve(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(dir.string(), ": no such checkpoint directory"));
  }
  if (fs::is_regular_file(dir / "metadata.json", ec)) return dir;
  const std::string base =
      dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  if (base.size() > 9 && base[0] == '.' && base.substr(base.size() - 8) == ".partial") {
    return absl::InvalidArgumentError(absl::StrCat(
        dir.string(), ": an incomplete checkpoint (its save did not finish: no metadata.json)"));
  }
  auto latest = ReadFileToString((dir / "latest").string());
  if (!latest.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir.string(), ": no complete checkpoint (no 'latest' file and no metadata.json)"));
  }
  std::string name = *latest;
  name.erase(
      std::find_if(name.rbegin(), name.rend(), [](char c) { return !std::isspace(c); }).base(),
      name.end());
  const fs::path path = dir / name;
  if (!PlainName(name) || !fs::is_regular_file(path / "metadata.json", ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": not a complete checkpoint (no metadata.json)"));
  }
  return path;
}

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

double Number(const Struct& s, const std::string& key) {
  const Value* v = Field(s, key);
  return v != nullptr && v->has_number_value() ? v->number_value() : 0.0;
}

std::string Text(const Struct& s, const std::string& key) {
  const Value* v = Field(s, key);
  return v != nullptr && v->has_string_value() ? v->string_value() : "";
}

int64_t ItemBytes(const std::string& dtype) {
  static const std::map<std::string, int64_t> kBytes = {{"fp32", 4},  {"bf16", 2},  {"fp16", 2},
                                                        {"int64", 8}, {"uint8", 1}, {"int8", 1}};
  auto it = kBytes.find(dtype);
  return it == kBytes.end() ? 0 : it->second;
}

struct TensorRow {
  std::string name, dtype, kinds;
  std::vector<int64_t> shape;
  int64_t numel = 1, bytes = 0, pieces = 0;
};

// Checks every piece of one record: its file holds its bytes, and each chunk its CRC-32.
class Checker {
 public:
  Checker(fs::path dir, int64_t chunk) : dir_(std::move(dir)), chunk_(chunk) {}

  void Piece(const std::string& tensor, const std::string& kind, int64_t item,
             const Struct& piece) {
    const std::string file = Text(piece, "file");
    const double count = Number(piece, "count"), off = Number(piece, "offset");
    const fs::path path = dir_ / file;
    const std::string where = absl::StrCat(path.string(), ": ");
    const std::string what = absl::StrCat("tensor '", tensor, "' (", kind, ")");
    if (!PlainName(file)) {
      errors_.push_back(absl::StrCat(dir_.string(), ": ", what, " names no valid file"));
      return;
    }
    if (!(count >= 0 && count <= kMaxCount / static_cast<double>(item)) ||
        !(off >= 0 && off <= kMaxCount)) {
      errors_.push_back(absl::StrCat(where, what, ": a piece with offset ", off, " and count ",
                                     count, " is out of range"));
      return;
    }
    const auto offset = static_cast<int64_t>(off);
    const int64_t size = static_cast<int64_t>(count) * item;
    std::error_code ec;
    const uintmax_t file_size = fs::file_size(path, ec);
    if (!ec && static_cast<uintmax_t>(offset + size) > file_size) {
      errors_.push_back(absl::StrCat(where, "truncated: ", what, " needs bytes [", offset, ", ",
                                     offset + size, "), the file ends at ", file_size));
      return;
    }
    std::ifstream& f = Open(path);
    if (!f.is_open()) {
      errors_.push_back(absl::StrCat(where, "missing: ", what, " is stored there"));
      return;
    }
    const Value* crcs = Field(piece, "crc32");
    const int64_t chunks = size == 0 ? 0 : (size + chunk_ - 1) / chunk_;
    if (crcs == nullptr || !crcs->has_list_value() || crcs->list_value().values_size() != chunks) {
      errors_.push_back(absl::StrCat(where, what, ": the metadata lists no CRC for every chunk"));
      return;
    }
    std::vector<char> buf;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n = std::min(chunk_, size - c * chunk_);
      buf.resize(static_cast<size_t>(n));
      f.clear();
      f.seekg(offset + c * chunk_);
      f.read(buf.data(), n);
      const int64_t got = f.gcount();
      bytes_ += got;
      if (got != n) {
        errors_.push_back(absl::StrCat(where, "truncated: ", what, " needs bytes [", offset, ", ",
                                       offset + size, "), the file ends at ",
                                       offset + c * chunk_ + got));
        return;
      }
      const uLong crc = crc32(0, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
      ++checked_;
      if (static_cast<double>(crc) !=
          crcs->list_value().values(static_cast<int>(c)).number_value()) {
        errors_.push_back(absl::StrCat(where, "corrupted: ", what, ", chunk ", c, " at byte ",
                                       offset + c * chunk_, " fails its CRC-32"));
        return;
      }
    }
  }

  const std::vector<std::string>& errors() const { return errors_; }
  int64_t checked() const { return checked_; }
  int64_t bytes() const { return bytes_; }

 private:
  std::ifstream& Open(const fs::path& p) {
    auto it = files_.find(p.string());
    if (it == files_.end())
      it = files_.emplace(p.string(), std::ifstream(p, std::ios::binary)).first;
    return it->second;
  }

  fs::path dir_;
  int64_t chunk_;
  std::map<std::string, std::ifstream> files_;
  std::vector<std::string> errors_;
  int64_t checked_ = 0, bytes_ = 0;
};

}  // namespace

int RunCheckpointInspect(const std::string& dir, bool json, std::ostream& out, std::ostream& err) {
  auto path = Resolve(fs::path(dir));
  if (!path.ok()) {
    err << "error: " << path.status().message() << "\n";
    return kExitBadInput;
  }
  const fs::path meta_path = *path / "metadata.json";
  std::error_code ec;
  const uintmax_t meta_size = fs::file_size(meta_path, ec);
  if (ec || meta_size > kMaxMetadataBytes) {
    err << "error: " << meta_path.string() << ": "
        << (ec ? ec.message() : absl::StrCat("larger than ", kMaxMetadataBytes, " bytes")) << "\n";
    return kExitBadInput;
  }
  auto text = ReadFileToString(meta_path.string());
  Struct meta;
  if (!text.ok() || !google::protobuf::util::JsonStringToMessage(*text, &meta).ok() ||
      Text(meta, "format") != kFormat) {
    err << "error: " << meta_path.string() << ": not " << kFormat << " metadata\n";
    return kExitBadInput;
  }
  const int64_t chunk = static_cast<int64_t>(Number(meta, "chunk_bytes"));
  const Value* tensors = Field(meta, "tensors");
  const Value* plan = Field(meta, "plan");
  const Value* optimizer = Field(meta, "optimizer");
  if (chunk < kMinChunk || chunk > kMaxChunk || tensors == nullptr ||
      !tensors->has_struct_value() || plan == nullptr || !plan->has_struct_value()) {
    err << "error: " << meta_path.string() << ": no chunk_bytes (" << kMinChunk << " to "
        << kMaxChunk << "), tensors or plan\n";
    return kExitBadInput;
  }
  Checker check(*path, chunk);
  std::vector<TensorRow> rows;
  int64_t total = 0;
  for (const auto& [name, tv] : tensors->struct_value().fields()) {
    TensorRow row;
    row.name = name;
    const Struct& t = tv.struct_value();
    if (const Value* shape = Field(t, "shape"); shape != nullptr && shape->has_list_value()) {
      for (const Value& d : shape->list_value().values()) {
        row.shape.push_back(static_cast<int64_t>(d.number_value()));
        row.numel *= row.shape.back();
      }
    }
    std::vector<std::string> kinds;
    for (const auto& [kind, rv] : t.fields()) {
      if (kind == "shape" || !rv.has_struct_value()) continue;
      const Struct& rec = rv.struct_value();
      const std::string dtype = Text(rec, "dtype");
      const int64_t item = ItemBytes(dtype);
      if (item == 0) {
        err << "error: " << meta_path.string() << ": tensor '" << name << "' (" << kind
            << ") has unknown dtype '" << dtype << "'\n";
        return kExitBadInput;
      }
      if (kind == "param" || kind == "buffer") row.dtype = dtype;
      kinds.push_back(kind);
      const Value* pieces = Field(rec, "pieces");
      if (pieces == nullptr || !pieces->has_list_value()) continue;
      for (const Value& p : pieces->list_value().values()) {
        row.bytes += static_cast<int64_t>(Number(p.struct_value(), "count")) * item;
        ++row.pieces;
        check.Piece(name, kind, item, p.struct_value());
      }
    }
    row.kinds = absl::StrJoin(kinds, ",");
    total += row.bytes;
    rows.push_back(std::move(row));
  }
  const Struct& pl = plan->struct_value();
  const auto step = static_cast<int64_t>(Number(meta, "step"));
  const std::string opt = optimizer != nullptr && optimizer->has_struct_value()
                              ? Text(optimizer->struct_value(), "kind")
                              : "";
  const bool ok = check.errors().empty();
  if (json) {
    Struct o;
    auto& f = *o.mutable_fields();
    f["dir"].set_string_value(path->string());
    f["step"].set_number_value(static_cast<double>(step));
    f["world"].set_number_value(Number(pl, "world"));
    f["replicas"].set_number_value(Number(pl, "replicas"));
    f["policy"].set_string_value(Text(pl, "policy"));
    f["strategy"].set_string_value(Text(pl, "strategy"));
    f["param_dtype"].set_string_value(Text(pl, "param_dtype"));
    f["optimizer"].set_string_value(opt);
    f["bytes"].set_number_value(static_cast<double>(total));
    f["integrity"].set_string_value(ok ? "ok" : "failed");
    for (const std::string& e : check.errors()) {
      f["errors"].mutable_list_value()->add_values()->set_string_value(e);
    }
    auto* list = f["tensors"].mutable_list_value();
    for (const TensorRow& r : rows) {
      auto& t = *list->add_values()->mutable_struct_value()->mutable_fields();
      t["name"].set_string_value(r.name);
      for (int64_t d : r.shape) {
        t["shape"].mutable_list_value()->add_values()->set_number_value(static_cast<double>(d));
      }
      t["dtype"].set_string_value(r.dtype);
      t["numel"].set_number_value(static_cast<double>(r.numel));
      t["bytes"].set_number_value(static_cast<double>(r.bytes));
      t["kinds"].set_string_value(r.kinds);
      t["pieces"].set_number_value(static_cast<double>(r.pieces));
    }
    out << ProtoJson(o, true, true) << "\n";
  } else {
    out << "checkpoint " << path->string() << ": step " << step << ", " << rows.size()
        << " tensors, " << Human(total) << "B\n";
    out << absl::StrFormat(
        "saved under: world %d x replicas %d, policy %s%s, param dtype %s, "
        "optimizer %s\n",
        static_cast<int64_t>(Number(pl, "world")), static_cast<int64_t>(Number(pl, "replicas")),
        Text(pl, "policy").empty() ? "ragged" : Text(pl, "policy"),
        Text(pl, "strategy").empty() ? "" : " (" + Text(pl, "strategy") + ")",
        Text(pl, "param_dtype"), opt.empty() ? "none" : opt);
    out << absl::StrFormat("%-40s %-16s %-6s %12s %12s %7s %s\n", "TENSOR", "SHAPE", "DTYPE",
                           "ELEMENTS", "BYTES", "PIECES", "RECORDS");
    for (const TensorRow& r : rows) {
      out << absl::StrFormat("%-40s %-16s %-6s %12d %12s %7d %s\n", r.name,
                             "[" + absl::StrJoin(r.shape, ",") + "]", r.dtype, r.numel,
                             Human(r.bytes) + "B", r.pieces, r.kinds);
    }
    if (ok) {
      out << "integrity: OK (" << check.checked() << " chunks, " << Human(check.bytes()) << "B"
          << " checked)\n";
    } else {
      out << "integrity: FAILED\n";
    }
  }
  for (const std::string& e : check.errors()) err << "error: " << e << "\n";
  return ok ? kExitOk : kExitDamaged;
}

}  // namespace ragshard
