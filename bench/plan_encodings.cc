// The plan's encodings (docs/benchmarks/control_plane.md, "Compact plans"): plans a zoo model the
// way ragshard-planner plans control_plane_bench's job (policy ragged, align 16 bytes, job
// "bench", version 1) and prints, as one JSON object, the deterministic serialization's size and
// its zstd frame's (engine/plan_codec.h, the planner's level) for the plan and for copies of it
// rewritten in the encodings issue 51 names:
//
//   plain         the plan as the planner stores and sends it (compressed);
//   delta_offsets each tensor's offset less the end of the tensor before it in its unit (the
//                 first tensor's less 0): 0 (so absent) unless alignment padded the gap;
//   shape_refs    a tensor whose shape, granule and split (rank_elems) equal an earlier
//                 tensor's holds, instead of shape, numel, granule_elems and rank_elems, how
//                 many tensors back the latest such tensor is (field 15, outside the proto);
//   no_names      without the tensors' names (a daemon could not name them: it does not hold
//                 the inventory).
//
//   plan_encodings [--model deepseek-v3] [--granule rows:128] [--world 16384]
#include <chrono>
#include <iostream>
#include <map>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/models.h"
#include "engine/plan_codec.h"
#include "engine/planner.h"
#include "google/protobuf/unknown_field_set.h"
#include "nlohmann/json.hpp"

namespace ragshard {
namespace {

constexpr int kReferenceField = 15;  // not a TensorPlacement field

nlohmann::json Sizes(const v1::Plan& plan) {
  return {{"bytes", static_cast<int64_t>(plan.ByteSizeLong())},
          {"zstd_bytes", static_cast<int64_t>(CompressPlan(plan).size())}};
}

template <typename F>
void EachUnit(v1::Plan* plan, F f) {
  for (v1::UnitPlan& unit : *plan->mutable_units()) f(&unit);
  for (v1::FactorPlan& factor : *plan->mutable_factors()) {
    for (v1::UnitPlan& unit : *factor.mutable_units()) f(&unit);
  }
}

v1::Plan DeltaOffsets(v1::Plan plan) {
  EachUnit(&plan, [](v1::UnitPlan* unit) {
    int64_t end = 0;
    for (v1::TensorPlacement& t : *unit->mutable_tensors()) {
      const int64_t offset = t.offset();
      t.set_offset(offset - end);
      end = offset + t.numel();
    }
  });
  return plan;
}

v1::Plan ShapeRefs(v1::Plan plan, int64_t* references) {
  using Key = std::tuple<std::vector<int64_t>, int64_t, std::vector<int64_t>>;
  std::map<Key, int64_t> latest;  // key -> index of the latest tensor with it
  int64_t index = 0;
  *references = 0;
  EachUnit(&plan, [&](v1::UnitPlan* unit) {
    for (v1::TensorPlacement& t : *unit->mutable_tensors()) {
      Key key{{t.shape().begin(), t.shape().end()},
              t.granule_elems(),
              {t.rank_elems().begin(), t.rank_elems().end()}};
      auto [it, first] = latest.try_emplace(std::move(key), index);
      if (!first) {
        t.clear_shape();
        t.clear_numel();
        t.clear_granule_elems();
        t.clear_rank_elems();
        t.GetReflection()->MutableUnknownFields(&t)->AddVarint(
            kReferenceField, static_cast<uint64_t>(index - it->second));
        it->second = index;
        ++*references;
      }
      ++index;
    }
  });
  return plan;
}

v1::Plan NoNames(v1::Plan plan) {
  EachUnit(&plan, [](v1::UnitPlan* unit) {
    for (v1::TensorPlacement& t : *unit->mutable_tensors()) t.clear_name();
  });
  return plan;
}

int Main(int argc, char** argv) {
  CLI::App app("A plan's size in the encodings issue 51 names; prints JSON");
  std::string model = "deepseek-v3", granule = "rows:128";
  int64_t world = 16384;
  app.add_option("--model", model, "zoo model (engine/models.h)");
  app.add_option("--granule", granule, "granule of 2-D+ tensors: element, rows:K or whole");
  app.add_option("--world", world, "ranks")->check(CLI::Range(int64_t{1}, kMaxWorld));
  CLI11_PARSE(app, argc, argv);

  auto inv = GenerateModel(model);
  if (!inv.ok()) {
    std::cerr << "error: --model: " << inv.status() << "\n";
    return 2;
  }
  auto g = ParseGranule(granule);
  if (!g.ok()) {
    std::cerr << "error: --granule: " << g.status() << "\n";
    return 2;
  }
  ApplyGranule(&*inv, *g);
  PlanOptions o;  // what ragshard-planner uses for control_plane_bench's job
  o.policy = Policy::kRagged;
  o.world = world;
  o.align_bytes = 16;
  o.job_id = "bench";
  o.version = 1;
  auto plan = BuildPlan(*inv, o);
  if (!plan.ok()) {
    std::cerr << "error: " << plan.status() << "\n";
    return 1;
  }
  int64_t tensors = 0, references = 0;
  for (const auto& unit : plan->units()) tensors += unit.tensors_size();
  nlohmann::json out = {{"model", model},
                        {"granule", granule},
                        {"world", world},
                        {"tensors", tensors},
                        {"zstd_level", kPlanZstdLevel},
                        {"plain", Sizes(*plan)},
                        {"delta_offsets", Sizes(DeltaOffsets(*plan))}};
  out["shape_refs"] = Sizes(ShapeRefs(*plan, &references));
  out["shape_refs"]["references"] = references;
  out["no_names"] = Sizes(NoNames(*plan));
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace
}  // namespace ragshard

int main(int argc, char** argv) { return ragshard::Main(argc, argv); }
