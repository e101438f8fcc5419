// The AMSP sharding factors a plan executes, as every process computes them: where each rank's
// parameter (p), gradient (g) and optimizer-state (os) shards lie, and which ranks form each
// group. The planner writes them into the plan (v1::ShardingSpec), the daemon runs its
// collectives over them, and the client tells its rank its positions.
//
// A cluster of N nodes x D devices, ranks numbered node by node (rank = node * D + local). A
// factor of shape A x B is a group of A devices in each of B nodes: the nodes fall into blocks
// of B consecutive nodes and the local indices into blocks of A, and a group is one node block
// times one local block. p <= g <= os (each divides the next at both levels), so a p group lies
// inside one g group, which lies inside one os group.
//
// Positions nest (AMSP's rule: a rank's os range lies inside its g range, inside its p range):
//   pos_p  = (node mod B_p) * A_p + (local mod A_p)                       (node-major)
//   pos_g  = pos_p * (|g| / |p|)  + which p group of its g group it is in
//   pos_os = pos_g * (|os| / |g|) + which g group of its os group it is in
// and each factor's plan cuts the same flat layout of a unit into |x| equal shards, so rank r
// holds [pos_x * S_x, (pos_x + 1) * S_x) with S_x = L / |x| (L the unit's padded length).
// A position depends on the local index only modulo A_x: local ranks l and l + A_x of a node
// are replicas of each other in that factor, and a node holds A_x "slots" of it (slot t for
// the local ranks l with l mod A_x == t), whose positions SlotPosition gives.
//
// A plan without a ShardingSpec is the shape every earlier plan has: p = g = os = a shard group
// of plan.world_size ranks made of whole nodes, replicated over the job's replicas.
//
// Thread-safe: the functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cluster.h"
#include "ragshard/v1/plan.pb.h"

namespace ragshard {

enum class Factor { kP = 0, kG = 1, kOs = 2 };
const char* FactorName(Factor f);  // "p", "g", "os"

struct Sharding {
  int64_t nodes = 1;
  int64_t devices = 1;  // per node
  GroupShape p, g, os;

  int64_t world() const { return nodes * devices; }
  bool uniform() const { return p == g && g == os; }
  const GroupShape& shape(Factor f) const;
  int64_t size(Factor f) const { return shape(f).size(); }

  // The position of rank (node, local) in factor f's layout; it depends on local only modulo
  // shape(f).intra.
  int64_t Position(Factor f, int64_t node, int64_t local) const;
  // The position of slot t (< shape(f).intra) of `node`.
  int64_t SlotPosition(Factor f, int64_t node, int64_t t) const { return Position(f, node, t); }
  // The nodes of `node`'s group of factor f (B of them, in order): its node block.
  std::vector<int> GroupNodes(Factor f, int64_t node) const;
  // The nodes holding the same positions of g as `node` in the other g groups (N / B_g of them,
  // `node`'s among them): over them the gradient shards are all-reduced.
  std::vector<int> GradReplicaNodes(int64_t node) const;
  // The nodes of `node`'s os group that hold the same p positions as it (B_os / B_p of them):
  // over them the updated parameters are all-gathered into the p shards (AMSP's update gather).
  std::vector<int> UpdateNodes(int64_t node) const;
  // The index of rank (node, local)'s os group, 0 to W / |os| - 1: group 0 holds every os
  // position once.
  int64_t OsGroup(int64_t node, int64_t local) const;
  // "p=AxB,g=AxB,os=AxB on N nodes x D" (for errors and reports).
  std::string Describe() const;
};

// Checks the shapes against the cluster: positive, p <= g <= os <= N x D, each dividing the next
// at both levels. Errors name the factor and the rule.
absl::Status CheckSharding(const Sharding& s);

// Every sharding that CheckSharding allows on `nodes` x `devices` (for tests and reports).
std::vector<Sharding> AllowedShardings(int64_t nodes, int64_t devices);

// The sharding a plan executes for a job of `world` ranks on nodes of `devices_per_node`: the
// plan's ShardingSpec when it has one (which must match the job), else the uniform shape of a
// shard group of plan.world_size whole nodes. Errors name what does not fit.
absl::StatusOr<Sharding> ShardingOf(const v1::Plan& plan, int64_t world, int64_t devices_per_node);

v1::ShardingSpec ToSpec(const Sharding& s);

// The units of factor f's plan: Plan.units for p and for plans without factors, else the
// FactorPlan's.
const google::protobuf::RepeatedPtrField<v1::UnitPlan>& FactorUnits(const v1::Plan& plan, Factor f);

// The plan of a coarser group from the finest one (os): the same units and tensor offsets over
// `world` positions, shard_elems scaled by finest_world / world, each tensor's ranks
// (first_rank, rank_elems) recomputed. `finest_world` must be a multiple of `world`. Owners of
// whole-matrix tensors are kept only in the os plan (-1 here).
v1::UnitPlan CoarsenUnit(const v1::UnitPlan& finest, int64_t finest_world, int64_t world);

// Factor f's plan alone, as a plan of its own: its units over its positions and its figures
// (the plan itself, less its factors, for p). NOT_FOUND when the plan has no such factor plan.
absl::StatusOr<v1::Plan> FactorPlanOf(const v1::Plan& plan, Factor f);

// Checks that a plan's factor plans are the nested coarsenings its sharding requires: the same
// units and tensors, shard sizes in the ratio of the group sizes. Errors name the unit.
absl::Status CheckFactorPlans(const v1::Plan& plan);

}  // namespace ragshard
