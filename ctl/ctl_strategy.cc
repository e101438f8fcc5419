#include "ctl/ctl_strategy.h"

#include <zlib.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ctl/strategy_render.h"
#include "engine/cluster.h"
#include "engine/inventory.h"
#include "engine/models.h"
#include "engine/strategy_search.h"

namespace ragshard {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

int Bad(std::ostream& err, const std::string& msg) {
  err << "error: " << msg << "\n";
  return kExitBadInput;
}

void AddCommonFlags(CLI::App* cmd, StrategyFlags* f) {
  auto* model = cmd->add_option("--model", f->model,
                                "zoo model (llama-7b, deepseek-v3, ...; NAME:grouped, NAME:fused)");
  auto* inv = cmd->add_option("--inventory", f->inventory, "inventory JSON file (dense model)");
  model->excludes(inv);
  cmd->add_option("--cluster", f->cluster, "cluster profile JSON (profiles/*.json)")->required();
  cmd->add_option("--world", f->world,
                  "devices in all (a multiple of the profile's devices per node); default: the "
                  "profile's nodes x devices");
  cmd->add_option("--granule", f->granule, "granule of 2-D+ tensors: element, rows:K or whole");
  cmd->add_option("--align-bytes", f->align_bytes, "alignment in bytes (16)");
  cmd->add_option("--memory-budget", f->memory_budget,
                  "bytes per device (suffixes KiB MiB GiB KB MB GB); default: device memory");
  cmd->add_option("--optimizer", f->optimizer, "adam or muon");
  cmd->add_option("--tokens-per-step", f->tokens_per_step, "global batch in tokens (4194304)");
  cmd->add_option("--micro-batch-tokens", f->micro_batch_tokens,
                  "tokens per device per micro-batch, for activation memory (4096)");
  cmd->add_option("--mfu", f->mfu, "model FLOPs utilisation; default: the profile's");
  cmd->add_option("--flops-per-token", f->flops_per_token,
                  "training FLOPs per token; default: 6 x active non-embedding parameters");
  cmd->add_flag("--json", f->json, "print JSON");
}

struct Loaded {
  std::unique_ptr<StrategyModel> model;
};

// Builds the model from the flags; returns an exit code on failure.
std::optional<int> Load(const StrategyFlags& f, bool search, Loaded* out, std::ostream& err) {
  if (f.model.empty() == f.inventory.empty())
    return Bad(err, "give one of --model and --inventory");
  auto inv = f.model.empty() ? LoadInventoryFile(f.inventory) : GenerateModel(f.model);
  if (!inv.ok()) {
    return Bad(
        err, absl::StrCat(f.model.empty() ? "--inventory " : "--model: ", inv.status().message()));
  }
  if (!f.granule.empty()) {
    auto g = ParseGranule(f.granule);
    if (!g.ok()) return Bad(err, absl::StrCat("--", g.status().message()));
    ApplyGranule(&*inv, *g);
  }
  auto profile = LoadClusterProfile(f.cluster);
  if (!profile.ok()) return Bad(err, absl::StrCat("--cluster: ", profile.status().message()));
  if (f.world != 0) {
    auto sized = WithWorld(*profile, f.world);
    if (!sized.ok()) return Bad(err, absl::StrCat("--world: ", sized.status().message()));
    profile = std::move(sized);
  }
  CostOptions o;
  auto opt = ParseOptimizerKind(f.optimizer);
  if (!opt.ok()) return Bad(err, absl::StrCat("--optimizer: ", opt.status().message()));
  o.optimizer = *opt;
  if (!f.memory_budget.empty() && !ParseByteSize(f.memory_budget, &o.memory_budget_bytes)) {
    return Bad(err, absl::StrCat("--memory-budget: '", f.memory_budget,
                                 "' is not a positive byte count (e.g. 85899345920 or 80GiB)"));
  }
  if (f.align_bytes < 1 || f.align_bytes > 4096) {
    return Bad(err, absl::StrCat("--align-bytes: must be in [1, 4096], got ", f.align_bytes));
  }
  if (f.top < 1) return Bad(err, "--top: must be at least 1");
  if (f.max_padding_pct < 0) return Bad(err, "--max-padding-pct: must not be negative");
  o.align_bytes = static_cast<int32_t>(f.align_bytes);
  o.tokens_per_step = f.tokens_per_step;
  o.micro_batch_tokens = f.micro_batch_tokens;
  if (f.mfu < 0 || f.mfu > 1) return Bad(err, "--mfu: must be in (0, 1]");
  if (f.flops_per_token < 0) return Bad(err, "--flops-per-token: must not be negative");
  o.mfu = f.mfu;
  o.flops_per_token = f.flops_per_token;
  o.max_padding_pct = f.max_padding_pct;
  o.top_k = f.top;
  if (!f.layers_per_unit.empty()) o.layer_groupings = f.layers_per_unit;
  if (!search) o.layer_groupings = {1};
  auto model = StrategyModel::Create(*inv, DeriveModelShape(*inv, f.model), *profile, o);
  if (!model.ok()) return Bad(err, std::string(model.status().message()));
  out->model = std::move(*model);
  return std::nullopt;
}

// A Gantt chart of the timeline as an RGB PNG: the compute stream above, the communication
// stream below, one colour per kind of event, grey ticks every tenth of the step.
bool WritePng(const Evaluation& e, const std::string& path, std::string* error) {
  const int w = 1200, h = 140, row = 40, top1 = 20, top2 = 80;
  std::vector<uint8_t> px(static_cast<size_t>(w) * h * 3, 255);
  auto fill = [&](int x0, int x1, int y0, int y1, uint32_t rgb) {
    for (int y = std::max(y0, 0); y < std::min(y1, h); ++y) {
      for (int x = std::max(x0, 0); x < std::min(x1, w); ++x) {
        uint8_t* p = &px[(static_cast<size_t>(y) * w + x) * 3];
        p[0] = static_cast<uint8_t>(rgb >> 16);
        p[1] = static_cast<uint8_t>(rgb >> 8);
        p[2] = static_cast<uint8_t>(rgb);
      }
    }
  };
  const double span = std::max(e.step_seconds, 1e-12);
  for (int t = 0; t <= 10; ++t) fill(t * (w - 1) / 10, t * (w - 1) / 10 + 1, 0, h, 0xC0C0C0);
  for (const TimelineEvent& ev : e.timeline) {
    uint32_t c = 0x808080;
    const std::string k = ev.label.substr(0, ev.label.find(' '));
    if (k == "F") c = 0x2E7D32;
    if (k == "B") c = 0x1565C0;
    if (k == "NS") c = 0x6A1B9A;
    if (k == "AG") c = 0xF9A825;
    if (k == "RS") c = 0xD84315;
    if (k == "AR") c = 0x8D6E63;
    if (k == "OWN") c = 0x00838F;
    if (k == "UPD") c = 0xAD1457;
    const int x0 = static_cast<int>(ev.start / span * (w - 1));
    const int x1 = std::max(x0 + 1, static_cast<int>(std::ceil(ev.end / span * (w - 1))));
    const int y = ev.stream == "compute" ? top1 : top2;
    fill(x0, x1, y, y + row, c);
    fill(x0, x0 + 1, y, y + row, 0xFFFFFF);  // a thin gap between consecutive events
  }
  std::string raw;
  for (int y = 0; y < h; ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(&px[static_cast<size_t>(y) * w * 3]), w * 3);
  }
  uLongf zlen = compressBound(raw.size());
  std::string z(zlen, '\0');
  if (compress2(reinterpret_cast<Bytef*>(&z[0]), &zlen, reinterpret_cast<const Bytef*>(raw.data()),
                raw.size(), 9) != Z_OK) {
    *error = "compression failed";
    return false;
  }
  z.resize(zlen);
  std::string png("\x89PNG\r\n\x1a\n", 8);
  auto be32 = [](std::string* s, uint32_t v) {
    for (int i = 3; i >= 0; --i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  };
  auto chunk = [&](const char* type, const std::string& data) {
    be32(&png, static_cast<uint32_t>(data.size()));
    std::string body = std::string(type, 4) + data;
    png += body;
    be32(&png,
         static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size())));
  };
  std::string ihdr;
  be32(&ihdr, w);
  be32(&ihdr, h);
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, no interlace
  chunk("IHDR", ihdr);
  chunk("IDAT", z);
  chunk("IEND", "");
  std::ofstream f(path, std::ios::binary);
  if (!f || !f.write(png.data(), static_cast<std::streamsize>(png.size())) || !f.flush()) {
    *error = absl::StrCat("cannot write '", path, "'");
    return false;
  }
  return true;
}

}  // namespace

bool ParseByteSize(const std::string& text, int64_t* bytes) {
  static const std::vector<std::pair<std::string, double>> suffixes = {
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
      {"B", 1}};
  std::string num = text;
  double mult = 1;
  for (const auto& [s, m] : suffixes) {
    if (num.size() > s.size() && num.compare(num.size() - s.size(), s.size(), s) == 0) {
      num = num.substr(0, num.size() - s.size());
      mult = m;
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(num), &v) || !std::isfinite(v) || v <= 0 ||
      v * mult > 9e18) {
    return false;
  }
  *bytes = static_cast<int64_t>(v * mult);
  return *bytes > 0;
}

void AddAdviseFlags(CLI::App* cmd, StrategyFlags* f) {
  AddCommonFlags(cmd, f);
  cmd->add_option("--max-padding-pct", f->max_padding_pct,
                  "candidates padding more are rejected unless nothing else fits (1.0)");
  cmd->add_option("--top", f->top, "candidates to list (5)");
  cmd->add_option("--layers-per-unit", f->layers_per_unit,
                  "unit groupings to try, e.g. 1,2,4 (default 1 to 8)")
      ->delimiter(',');
  cmd->add_flag("--executable", f->executable,
                "accepted for older scripts: the data plane executes every strategy the search "
                "considers, so the answer is the same with or without it");
  cmd->add_option("--max-rejected", f->max_rejected, "rejected candidates to list (20)");
}

void AddSimulateFlags(CLI::App* cmd, StrategyFlags* f) {
  AddCommonFlags(cmd, f);
  cmd->add_option("--strategy", f->strategy, "k=K,shard=AxB or k=K,p=AxB,g=AxB,os=AxB")->required();
  cmd->add_option("--png", f->png, "write the step's timeline as a PNG Gantt chart");
  cmd->add_option("--width", f->width, "columns of the ASCII timeline (100)");
}

int RunAdvise(const StrategyFlags& f, std::ostream& out, std::ostream& err) {
  Loaded l;
  if (auto rc = Load(f, /*search=*/true, &l, err)) return *rc;
  auto advice = Advise(l.model.get());
  if (!advice.ok()) {
    err << "error: " << advice.status().message() << "\n";
    return advice.status().code() == absl::StatusCode::kFailedPrecondition ? kExitFailure
                                                                           : kExitBadInput;
  }
  out << (f.json ? AdviceJson(*advice, *l.model, f.max_rejected)
                 : AdviceTable(*advice, *l.model, f.max_rejected))
      << "\n";
  return kExitOk;
}

int RunSimulate(const StrategyFlags& f, std::ostream& out, std::ostream& err) {
  auto s = ParseStrategy(f.strategy);
  if (!s.ok()) return Bad(err, absl::StrCat("--strategy: ", s.status().message()));
  if (f.width < 10 || f.width > 1000) return Bad(err, "--width: must be in [10, 1000]");
  Loaded l;
  if (auto rc = Load(f, /*search=*/false, &l, err)) return *rc;
  auto e = l.model->Evaluate(*s, /*detail=*/true);
  if (!e.ok()) return Bad(err, absl::StrCat("--strategy: ", e.status().message()));
  if (e->memory.total() > static_cast<double>(l.model->budget_bytes())) {
    e->rejected = absl::StrCat("memory ", FormatBytes(e->memory.total()), " exceeds the budget ",
                               FormatBytes(static_cast<double>(l.model->budget_bytes())));
  }
  out << (f.json ? EvaluationJson(*e) : SimulationReport(*e, *l.model, f.width));
  if (!e->rejected.empty() && !f.json) out << "warning: " << e->rejected << "\n";
  if (!f.png.empty()) {
    std::string error;
    if (!WritePng(*e, f.png, &error)) {
      err << "error: --png: " << error << "\n";
      return kExitFailure;
    }
    if (!f.json) out << "wrote " << f.png << "\n";
  }
  return kExitOk;
}

}  // namespace ragshard
