// Baseline policies, each following its real implementation's layout rules. See
// docs/baselines.md for the sources and for what is modelled and what is not.
#include <algorithm>
#include <deque>
#include <list>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "engine/planner.h"
#include "infra/status_macros.h"

namespace ragshard {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t x, int64_t m) { return CeilDiv(x, m) * m; }

absl::StatusOr<int64_t> CheckedLcm(int64_t a, int64_t b, absl::string_view what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a / std::gcd(a, b), b, &out)) {
    return absl::OutOfRangeError(absl::StrCat(what, ": lcm overflows int64"));
  }
  return out;
}

struct Tensor {
  const TensorSpec* spec;
  int64_t numel;
};

// (unit, dtype) groups in inventory order, as FSDP units are.
struct UnitGroup {
  std::string name;
  v1::DType dtype;
  std::vector<Tensor> tensors;
};

std::vector<UnitGroup> UnitGroups(const Inventory& inventory) {
  std::vector<UnitGroup> out;
  for (const UnitSpec& unit : inventory.units()) {
    std::vector<UnitGroup> local;
    for (const TensorSpec& spec : unit.tensors()) {
      auto it = std::find_if(local.begin(), local.end(),
                             [&](const UnitGroup& g) { return g.dtype == spec.dtype(); });
      if (it == local.end()) {
        local.push_back({unit.name(), spec.dtype(), {}});
        it = local.end() - 1;
      }
      it->tensors.push_back({&spec, *TensorNumel(spec)});
    }
    for (auto& g : local) out.push_back(std::move(g));
  }
  return out;
}

TensorLayout Flat(const Tensor& t, int64_t offset, int64_t shard) {
  return {&t.spec->name(), &t.spec->shape(), t.numel, offset, shard, 0};
}

// Each tensor of a group on its own, cut into W chunks of `chunk(t)` elements (the last ones
// padded); a step copies `copy(shard_bytes)` bytes per rank.
template <typename Chunk, typename Copy>
Layout EqualChunks(const std::vector<UnitGroup>& groups, int64_t w, Chunk chunk, Copy copy) {
  Layout layout{w, {}};
  for (const UnitGroup& g : groups) {
    GroupLayout gl{g.name, g.dtype, 0, {}, 0};
    for (const Tensor& t : g.tensors) {
      const int64_t c = chunk(t);
      gl.tensors.push_back(Flat(t, 0, c));
      gl.per_rank_elems += c;
    }
    gl.copy_bytes_per_step = copy(gl.per_rank_elems * DTypeSize(g.dtype));
    layout.groups.push_back(std::move(gl));
  }
  return layout;
}

// FSDP2 (torch.distributed._composable.fsdp): each parameter is chunked on dim 0 with
// torch.chunk, so rank r holds rows [r*c, min((r+1)*c, d0)) with c = ceil(d0 / W), padded to c
// rows. Copies per step and rank: all-gather copy-in (the padded shards into the all-gather
// input) and copy-out (split_with_sizes_copy into the unsharded parameters) in forward and again
// in backward (reshard_after_forward=True), and the reduce-scatter copy-in (_chunk_cat of the
// unsharded gradients into the reduce-scatter input). The reduce-scatter output is viewed as
// the sharded gradients (as_strided), so there is no copy-out there.
Layout Fsdp2(const std::vector<UnitGroup>& groups, int64_t w) {
  return EqualChunks(
      groups, w,
      [w](const Tensor& t) {
        const int64_t d0 = t.spec->shape(0);
        return CeilDiv(d0, w) * (t.numel / d0);
      },
      [w](int64_t shard_bytes) { return 2 * (shard_bytes + w * shard_bytes) + w * shard_bytes; });
}

// DeepSpeed ZeRO-3 (runtime/zero/partition_parameters.py): every parameter is flattened and
// padded to a multiple of W; rank r holds elements [r*c, (r+1)*c) with c = ceil(numel / W).
// Per step the coalesced all-gather copies the partitions in and the gathered parameters out
// (forward and backward), and the reduce-scatter copies the gradients into the padded
// partitioned buffer and the reduced partition out.
Layout Zero3(const std::vector<UnitGroup>& groups, int64_t w) {
  return EqualChunks(
      groups, w, [w](const Tensor& t) { return CeilDiv(t.numel, w); },
      [w](int64_t shard_bytes) {
        return 2 * (shard_bytes + w * shard_bytes) + (w * shard_bytes + shard_bytes);
      });
}

// FSDP1 FlatParameter (use_orig_params=True): the unit's parameters are concatenated with each
// start aligned to 16 bytes, the total padded to a multiple of W and chunked equally. The
// all-gather writes the flat parameter and the reduce-scatter reads the flat gradient in place.
Layout Fsdp1(const std::vector<UnitGroup>& groups, int64_t w) {
  Layout layout{w, {}};
  for (const UnitGroup& g : groups) {
    GroupLayout gl{g.name, g.dtype, 0, {}, 0};
    const int64_t align = AlignElems(16, g.dtype);
    std::vector<int64_t> offsets;
    int64_t cur = 0;
    for (const Tensor& t : g.tensors) {
      cur = RoundUp(cur, align);
      offsets.push_back(cur);
      cur += t.numel;
    }
    gl.per_rank_elems = CeilDiv(cur, w);
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      gl.tensors.push_back(Flat(g.tensors[i], offsets[i], gl.per_rank_elems));
    }
    layout.groups.push_back(std::move(gl));
  }
  return layout;
}

// Megatron-LM distributed optimizer (core/distributed/param_and_grad_buffer.py): one buffer per
// dtype over the whole model, parameters in reverse order, each start padded to 64 elements, a
// bucket closed once it holds at least bucket_size elements (max(40M, 1M * W)), and each bucket
// end padded to lcm(W, 128). Each bucket is sharded equally over the ranks; collectives work in
// place on the buffer.
absl::StatusOr<Layout> MegatronDO(const Inventory& inventory, int64_t w) {
  Layout layout{w, {}};
  std::vector<v1::DType> dtypes;
  for (const UnitSpec& unit : inventory.units()) {
    for (const TensorSpec& spec : unit.tensors()) {
      if (std::find(dtypes.begin(), dtypes.end(), spec.dtype()) == dtypes.end()) {
        dtypes.push_back(spec.dtype());
      }
    }
  }
  RAGSHARD_ASSIGN_OR_RETURN(const int64_t end_pad, CheckedLcm(w, 128, "megatron-do bucket end"));
  const int64_t bucket_size = std::max<int64_t>(40'000'000, 1'000'000 * w);
  for (v1::DType dt : dtypes) {
    std::vector<Tensor> params;
    for (int u = inventory.units_size() - 1; u >= 0; --u) {
      const UnitSpec& unit = inventory.units(u);
      for (int t = unit.tensors_size() - 1; t >= 0; --t) {
        if (unit.tensors(t).dtype() == dt) {
          params.push_back({&unit.tensors(t), *TensorNumel(unit.tensors(t))});
        }
      }
    }
    int64_t bucket_start = 0, cur = 0;
    std::vector<std::pair<const Tensor*, int64_t>> members;
    auto close = [&](int64_t end) {
      const int64_t padded = RoundUp(end - bucket_start, end_pad);
      GroupLayout gl{
          absl::StrCat("bucket.", DTypeName(dt), ".", layout.groups.size()), dt, padded / w, {}, 0};
      for (const auto& [t, off] : members)
        gl.tensors.push_back(Flat(*t, off - bucket_start, padded / w));
      layout.groups.push_back(std::move(gl));
      members.clear();
      bucket_start = bucket_start + padded;
      cur = bucket_start;
    };
    for (const Tensor& t : params) {
      cur = RoundUp(cur, 64);
      members.push_back({&t, cur});
      cur += t.numel;
      if (cur - bucket_start >= bucket_size) close(cur);
    }
    if (!members.empty()) close(cur);
  }
  return layout;
}

// Megatron-FSDP (megatron_fsdp/param_and_grad_buffer.py, build_data_parallel_buffer_index):
// per FSDP unit and dtype, chunk_size_factor = lcm of the parameters' row sizes
// (shape[1:].numel()). Parameters of at least that size are placed in order at multiples of it;
// one whose size is not a multiple gets its remainder paired with another such parameter's
// remainder, and parameters smaller than the factor fill the gaps left behind. The bucket is
// padded to a multiple of W * chunk_size_factor and sharded equally; collectives work in place.
absl::StatusOr<Layout> MegatronFsdp(const std::vector<UnitGroup>& groups, int64_t w) {
  Layout layout{w, {}};
  for (const UnitGroup& g : groups) {
    int64_t csf = 1;
    for (const Tensor& t : g.tensors) {
      RAGSHARD_ASSIGN_OR_RETURN(csf, CheckedLcm(csf, t.numel / t.spec->shape(0),
                                                absl::StrCat("megatron-fsdp unit '", g.name, "'")));
    }
    std::vector<int64_t> offsets(g.tensors.size(), 0);
    std::list<size_t> regular, fragments;
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      (g.tensors[i].numel < csf ? fragments : regular).push_back(i);
    }
    int64_t index = 0;
    while (!regular.empty()) {
      size_t i = regular.front();
      regular.pop_front();
      const int64_t n = g.tensors[i].numel;
      offsets[i] = index;
      if (n % csf == 0) {
        index += n;
        continue;
      }
      int64_t gap = index + n;
      index += (n / csf + 1) * csf;
      const int64_t remain = n % csf;
      int64_t space = csf - remain;
      for (auto it = regular.begin(); it != regular.end(); ++it) {
        const int64_t rn = g.tensors[*it].numel;
        if (rn % csf == 0) continue;
        const int64_t rhs_remain = rn % csf;
        if (remain + rhs_remain <= csf) {
          offsets[*it] = index - rhs_remain;
          space -= rhs_remain;
          index += rn / csf * csf;
          regular.erase(it);
          break;
        }
      }
      for (auto it = fragments.begin(); it != fragments.end();) {
        const int64_t fn = g.tensors[*it].numel;
        if (fn > space) {
          ++it;
          continue;
        }
        offsets[*it] = gap;
        space -= fn;
        gap += fn;
        it = fragments.erase(it);
      }
    }
    for (size_t i : fragments) {
      offsets[i] = index;
      index += g.tensors[i].numel;
    }
    int64_t quantum = 0;
    if (__builtin_mul_overflow(w, csf, &quantum)) {
      return absl::OutOfRangeError(
          absl::StrCat("megatron-fsdp unit '", g.name, "': W * chunk_size_factor overflows"));
    }
    const int64_t shard = RoundUp(index, quantum) / w;
    GroupLayout gl{g.name, g.dtype, shard, {}, 0};
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      gl.tensors.push_back(Flat(g.tensors[i], offsets[i], shard));
    }
    layout.groups.push_back(std::move(gl));
  }
  return layout;
}

}  // namespace

absl::StatusOr<Layout> BuildBaselineLayout(const Inventory& inventory, const PlanOptions& options) {
  RAGSHARD_RETURN_IF_ERROR(ValidatePlanOptions(options));
  const int64_t w = options.world;
  switch (options.policy) {
    case Policy::kFsdp2:
      return Fsdp2(UnitGroups(inventory), w);
    case Policy::kFsdp1:
      return Fsdp1(UnitGroups(inventory), w);
    case Policy::kZero3:
      return Zero3(UnitGroups(inventory), w);
    case Policy::kMegatronDO:
      return MegatronDO(inventory, w);
    case Policy::kMegatronFsdp:
      return MegatronFsdp(UnitGroups(inventory), w);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy '", PolicyName(options.policy), "' is not a baseline"));
  }
}

}  // namespace ragshard
