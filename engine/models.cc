#include "engine/models.h"

#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace ragshard {
namespace {

struct Variant {
  bool grouped = false;
  bool fused = false;
};

class Builder {
 public:
  explicit Builder(const Variant& v) : v_(v) {}

  void Unit(const std::string& name) {
    unit_ = inv_.add_units();
    unit_->set_name(name);
  }
  void Add(const std::string& name, const std::vector<int64_t>& shape, bool matrix = false) {
    TensorSpec* t = unit_->add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_dtype(v1::DTYPE_BF16);
    t->set_optimizer(matrix && shape.size() >= 2 ? v1::OPTIMIZER_MATRIX
                                                 : v1::OPTIMIZER_ELEMENTWISE);
  }
  void AttnGqa(const std::string& p, int64_t h, int64_t nh, int64_t nkv, int64_t hd) {
    if (v_.fused) {
      Add(p + "qkv_proj.weight", {(nh + 2 * nkv) * hd, h}, true);
    } else {
      Add(p + "q_proj.weight", {nh * hd, h}, true);
      Add(p + "k_proj.weight", {nkv * hd, h}, true);
      Add(p + "v_proj.weight", {nkv * hd, h}, true);
    }
    Add(p + "o_proj.weight", {h, nh * hd}, true);
  }
  void SwiGlu(const std::string& p, int64_t h, int64_t i) {
    if (v_.fused) {
      Add(p + "gate_up_proj.weight", {2 * i, h}, true);
    } else {
      Add(p + "gate_proj.weight", {i, h}, true);
      Add(p + "up_proj.weight", {i, h}, true);
    }
    Add(p + "down_proj.weight", {h, i}, true);
  }
  // E experts of swiglu(I), names experts.<e>.<w1|w2|w3 or gate/up/down>.
  void Experts(const std::string& p, int64_t e, int64_t h, int64_t i, bool mixtral_names) {
    if (v_.grouped) {
      Add(p + "experts.gate_up_proj", {e, 2 * i, h}, true);
      Add(p + "experts.down_proj", {e, h, i}, true);
      return;
    }
    for (int64_t x = 0; x < e; ++x) {
      std::string q = absl::StrCat(p, "experts.", x, ".");
      if (mixtral_names) {
        Add(q + "w1.weight", {i, h}, true);
        Add(q + "w2.weight", {h, i}, true);
        Add(q + "w3.weight", {i, h}, true);
      } else {
        SwiGlu(q, h, i);
      }
    }
  }
  void Norms(const std::string& p, int64_t h) {
    Add(p + "input_layernorm.weight", {h});
    Add(p + "post_attention_layernorm.weight", {h});
  }
  Inventory Take() { return std::move(inv_); }

 private:
  Variant v_;
  Inventory inv_;
  UnitSpec* unit_ = nullptr;
};

using Gen = std::function<void(Builder&)>;

Gen Llama(int64_t h, int64_t layers, int64_t nh, int64_t nkv, int64_t inter, int64_t vocab) {
  return [=](Builder& b) {
    b.Unit("embed");
    b.Add("model.embed_tokens.weight", {vocab, h});
    for (int64_t l = 0; l < layers; ++l) {
      std::string p = absl::StrCat("model.layers.", l, ".");
      b.Unit(absl::StrCat("layers.", l));
      b.Norms(p, h);
      b.AttnGqa(p + "self_attn.", h, nh, nkv, 128);
      b.SwiGlu(p + "mlp.", h, inter);
    }
    b.Unit("head");
    b.Add("model.norm.weight", {h});
    b.Add("lm_head.weight", {vocab, h});
  };
}

void Gpt3(Builder& b) {
  const int64_t h = 12288;
  b.Unit("embed");
  b.Add("transformer.wte.weight", {50257, h});
  b.Add("transformer.wpe.weight", {2048, h});
  for (int64_t l = 0; l < 96; ++l) {
    std::string p = absl::StrCat("transformer.h.", l, ".");
    b.Unit(absl::StrCat("layers.", l));
    b.Add(p + "ln_1.weight", {h});
    b.Add(p + "ln_1.bias", {h});
    b.Add(p + "attn.qkv.weight", {3 * h, h}, true);
    b.Add(p + "attn.qkv.bias", {3 * h});
    b.Add(p + "attn.proj.weight", {h, h}, true);
    b.Add(p + "attn.proj.bias", {h});
    b.Add(p + "ln_2.weight", {h});
    b.Add(p + "ln_2.bias", {h});
    b.Add(p + "mlp.fc1.weight", {4 * h, h}, true);
    b.Add(p + "mlp.fc1.bias", {4 * h});
    b.Add(p + "mlp.fc2.weight", {h, 4 * h}, true);
    b.Add(p + "mlp.fc2.bias", {h});
  }
  b.Unit("head");  // tied: the head reuses wte
  b.Add("transformer.ln_f.weight", {h});
  b.Add("transformer.ln_f.bias", {h});
}

// A decoder of mixture-of-experts layers with grouped-query attention (Mixtral, Qwen3-MoE).
struct MoeDecoder {
  int64_t vocab, hidden, layers, heads, kv_heads, head_dim, experts, expert_ffn;
  const char* moe;     // the layer's mixture-of-experts module, with its dot
  bool qk_norm;        // per-head RMSNorm of queries and keys
  bool mixtral_names;  // experts named w1/w2/w3 instead of gate/up/down_proj
};

void AddMoeDecoder(Builder& b, const MoeDecoder& m) {
  const int64_t h = m.hidden;
  b.Unit("embed");
  b.Add("model.embed_tokens.weight", {m.vocab, h});
  for (int64_t l = 0; l < m.layers; ++l) {
    std::string p = absl::StrCat("model.layers.", l, ".");
    b.Unit(absl::StrCat("layers.", l));
    b.Norms(p, h);
    b.AttnGqa(p + "self_attn.", h, m.heads, m.kv_heads, m.head_dim);
    if (m.qk_norm) {
      b.Add(p + "self_attn.q_norm.weight", {m.head_dim});
      b.Add(p + "self_attn.k_norm.weight", {m.head_dim});
    }
    b.Add(p + m.moe + "gate.weight", {m.experts, h}, true);
    b.Experts(p + m.moe, m.experts, h, m.expert_ffn, m.mixtral_names);
  }
  b.Unit("head");
  b.Add("model.norm.weight", {h});
  b.Add("lm_head.weight", {m.vocab, h});
}

void Mixtral(Builder& b) {
  AddMoeDecoder(b, {/*vocab=*/32000, /*hidden=*/4096, /*layers=*/32, /*heads=*/32,
                    /*kv_heads=*/8, /*head_dim=*/128, /*experts=*/8, /*expert_ffn=*/14336,
                    "block_sparse_moe.", /*qk_norm=*/false, /*mixtral_names=*/true});
}

void Qwen3Moe(Builder& b) {
  AddMoeDecoder(b, {/*vocab=*/151936, /*hidden=*/4096, /*layers=*/94, /*heads=*/64,
                    /*kv_heads=*/4, /*head_dim=*/128, /*experts=*/128, /*expert_ffn=*/1536, "mlp.",
                    /*qk_norm=*/true, /*mixtral_names=*/false});
}

void DeepSeekV3(Builder& b) {
  const int64_t h = 7168;
  b.Unit("embed");
  b.Add("model.embed_tokens.weight", {129280, h});
  for (int64_t l = 0; l < 61; ++l) {
    std::string p = absl::StrCat("model.layers.", l, ".");
    std::string a = p + "self_attn.";
    // A dense layer's MLP (three 18432 x 7168 matrices, each whole on one rank for Muon) is
    // a unit of its own, after its attention's: one unit holding both has a shard at least half
    // a matrix long, so at W = 1024 its unsharded buffers alone would exceed an 80 GiB device.
    b.Unit(l < 3 ? absl::StrCat("attn.", l) : absl::StrCat("layers.", l));
    b.Norms(p, h);
    b.Add(a + "q_a_proj.weight", {1536, h}, true);
    b.Add(a + "q_a_layernorm.weight", {1536});
    b.Add(a + "q_b_proj.weight", {24576, 1536}, true);
    b.Add(a + "kv_a_proj_with_mqa.weight", {576, h}, true);
    b.Add(a + "kv_a_layernorm.weight", {512});
    b.Add(a + "kv_b_proj.weight", {32768, 512}, true);
    b.Add(a + "o_proj.weight", {h, 16384}, true);
    if (l < 3) {
      b.Unit(absl::StrCat("layers.", l));
      b.SwiGlu(p + "mlp.", h, 18432);
    } else {
      b.Add(p + "mlp.gate.weight", {256, h}, true);
      b.Add(p + "mlp.gate.e_score_correction_bias", {256});
      b.Experts(p + "mlp.", 256, h, 2048, false);
      b.SwiGlu(p + "mlp.shared_experts.", h, 2048);
    }
  }
  b.Unit("head");
  b.Add("model.norm.weight", {h});
  b.Add("lm_head.weight", {129280, h});
}

struct ZooEntry {
  ModelInfo info;
  Gen gen;
};

const std::vector<ZooEntry>& Zoo() {
  static const std::vector<ZooEntry> zoo = {
      {{"llama3-8b", 8'030'261'248, 291}, Llama(4096, 32, 32, 8, 14336, 128256)},
      {{"llama3-70b", 70'553'706'496, 0}, Llama(8192, 80, 64, 8, 28672, 128256)},
      {{"llama3.1-405b", 405'853'388'800, 0}, Llama(16384, 126, 128, 8, 53248, 128256)},
      {{"gpt3-175b", 174'604'259'328, 0}, Gpt3},
      {{"mixtral-8x7b", 46'702'792'704, 0, 8, 2}, Mixtral},
      {{"qwen3-235b-a22b", 235'093'634'560, 0, 128, 8}, Qwen3Moe},
      {{"llama-7b", 6'738'415'616, 0}, Llama(4096, 32, 32, 32, 11008, 32000)},
      {{"llama-13b", 13'015'864'320, 0}, Llama(5120, 40, 40, 40, 13824, 32000)},
      {{"llama-30b", 32'528'943'616, 0}, Llama(6656, 60, 52, 52, 17920, 32000)},
      {{"deepseek-v3", 671'026'419'200, 0, 256, 8}, DeepSeekV3},
  };
  return zoo;
}

}  // namespace

const std::vector<ModelInfo>& ModelZoo() {
  static const std::vector<ModelInfo> infos = [] {
    std::vector<ModelInfo> v;
    for (const auto& e : Zoo()) v.push_back(e.info);
    return v;
  }();
  return infos;
}

const ModelInfo* FindModel(absl::string_view spec) {
  const absl::string_view base = spec.substr(0, spec.find(':'));
  for (const auto& e : Zoo()) {
    if (e.info.name == base) return &e.info;
  }
  return nullptr;
}

absl::StatusOr<Inventory> GenerateModel(absl::string_view spec) {
  std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  Variant variant;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "grouped") {
      variant.grouped = true;
    } else if (parts[i] == "fused") {
      variant.fused = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("model '", spec, "': unknown variant '",
                                                     parts[i], "' (expected grouped or fused)"));
    }
  }
  for (const auto& e : Zoo()) {
    if (e.info.name == parts[0]) {
      Builder b(variant);
      e.gen(b);
      return b.Take();
    }
  }
  std::vector<std::string> names;
  for (const auto& e : Zoo()) names.push_back(e.info.name);
  return absl::InvalidArgumentError(absl::StrCat("model: unknown model '", parts[0],
                                                 "' (known: ", absl::StrJoin(names, ", "), ")"));
}

}  // namespace ragshard
