// libragshard_c's calls that need no planner or daemon (ragshard_c.h): a plan computed in the
// process, the data plane's memory model, block quantization's kernels, the redundancy schemes
// and the pool's contract. The clients' and jobs' calls are in ragshard_c.cc.
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "client/block_quant.h"
#include "engine/data_plane_memory.h"
#include "engine/inventory.h"
#include "engine/planner.h"
#include "engine/redundancy.h"
#include "nlohmann/json.hpp"
#include "protocol/pool_contract.h"
#include "ragshard_c.h"
#include "ragshard_c_abi.h"

namespace ragshard {
namespace {

using c_abi::Fail;
using c_abi::Out;
using c_abi::Str;
using c_abi::ToJson;

// n_chunks BlockChunks from their int64 fields, in order.
std::vector<BlockChunk> ParseChunks(const int64_t* chunks, int64_t n_chunks) {
  std::vector<BlockChunk> parsed(static_cast<size_t>(n_chunks));
  for (int64_t i = 0; i < n_chunks; ++i) {
    const int64_t* f = chunks + i * kBlockChunkFields;
    parsed[i] = {f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
  }
  return parsed;
}

}  // namespace
}  // namespace ragshard

using namespace ragshard;  // NOLINT(google-build-using-namespace): the C ABI's definitions

extern "C" {

int rs_redundancy(const char* field, const char* text, int64_t nodes, const char** out) {
  auto r = ParseRedundancy(field, text);
  if (!r.ok()) return Fail(r.status());
  const absl::Status fits = nodes > 0 ? CheckRedundancyNodes(*r, nodes) : absl::OkStatus();
  nlohmann::json j = {{"name", r->name()},
                      {"whole_copies", r->whole_copies()},
                      {"min_nodes", r->min_nodes()},
                      {"group", r->kind == Redundancy::Kind::kParity ? r->k + 1 : 0},
                      {"nodes_error", std::string(fits.message())}};
  thread_local std::string json;
  json = j.dump();
  *out = json.c_str();
  return 0;
}

int rs_pool_contract(const char** out) {
  static const std::string* json = new std::string(pool::PoolContractJson());
  *out = json->c_str();
  return 0;
}

int rs_plan_local(const char* inventory_json, int64_t world, const char* policy,
                  int32_t align_bytes, const char** out) {
  auto inv = ParseInventoryJson(Str(inventory_json));
  if (!inv.ok()) return Fail(inv.status());
  auto p = ParsePolicy(Str(policy));
  if (!p.ok()) return Fail(RS_BAD_ARGUMENT, std::string(p.status().message()));
  PlanOptions o;
  o.policy = *p;
  o.world = world;
  o.align_bytes = align_bytes;
  auto plan = BuildPlan(*inv, o);
  if (!plan.ok()) return Fail(plan.status());
  return Out(ToJson(*plan), out);
}

void rs_data_plane_peak(const int64_t* shard_elems, const int64_t* group, const double* bytes,
                        const int64_t* grad_shard_elems, int64_t n, int64_t ranks, int shared,
                        int64_t prefetch, int64_t p_slots, int64_t g_slots, int64_t g_ring_nodes,
                        int64_t g_ring_slots, double out[5]) {
  std::vector<DataPlaneUnit> in;
  for (int64_t i = 0; i < n; ++i) {
    in.push_back({shard_elems[i], group[i], bytes[i], grad_shard_elems[i]});
  }
  const DataPlaneMemory m =
      DataPlanePeak(in, ranks, shared != 0, prefetch, p_slots, g_slots, g_ring_nodes, g_ring_slots);
  out[0] = m.shards;
  out[1] = m.grad_shards;
  out[2] = m.unsharded;
  out[3] = m.grads;
  out[4] = m.scratch;
}

int rs_dequantize_chunks(const uint8_t* codes, int64_t n_codes, const float* scales,
                         int64_t n_scales, const float* values, const int64_t* chunks,
                         int64_t n_chunks, float* out, int64_t n_out) {
  if (n_codes < 0 || n_scales < 0 || n_chunks < 0 || n_out < 0) {
    return Fail(absl::InvalidArgumentError("dequantize: a negative count"));
  }
  const absl::Status s = DequantizeChunks(
      absl::MakeConstSpan(codes, n_codes), absl::MakeConstSpan(scales, n_scales),
      absl::MakeConstSpan(values, 256), ParseChunks(chunks, n_chunks), absl::MakeSpan(out, n_out));
  return s.ok() ? 0 : Fail(s);
}

int rs_block_amax(const float* x, int64_t n, const int64_t* chunks, int64_t n_chunks, float* amax,
                  int64_t n_blocks) {
  if (n < 0 || n_chunks < 0 || n_blocks < 0) {
    return Fail(absl::InvalidArgumentError("quantize: a negative count"));
  }
  const absl::Status s = BlockAmax(absl::MakeConstSpan(x, n), ParseChunks(chunks, n_chunks),
                                   absl::MakeSpan(amax, n_blocks));
  return s.ok() ? 0 : Fail(s);
}

int rs_encode_chunks(const float* x, int64_t n, const float* scales, int64_t n_scales,
                     const int64_t* chunks, int64_t n_chunks, int fp8, uint8_t* codes,
                     int64_t n_codes) {
  if (n < 0 || n_scales < 0 || n_chunks < 0 || n_codes < 0) {
    return Fail(absl::InvalidArgumentError("quantize: a negative count"));
  }
  const absl::Status s =
      EncodeChunks(absl::MakeConstSpan(x, n), absl::MakeConstSpan(scales, n_scales),
                   ParseChunks(chunks, n_chunks), fp8 != 0 ? CodeKind::kFp8E4m3fn : CodeKind::kInt8,
                   absl::MakeSpan(codes, n_codes));
  return s.ok() ? 0 : Fail(s);
}

}  // extern "C"
