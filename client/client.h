// The data side of libragshard: a training process attaches to its node's daemon, maps the
// daemon's shared-memory arena and works on views of its RaggedShard buffers without copying.
// Operations are collective over the job's ranks and asynchronous: they return handles.
//
// Thread-compatible: one thread at a time per Client. Destroying the Client detaches (RAII).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/rank_queue.h"
#include "engine/inventory.h"
#include "infra/fd.h"
#include "protocol/planner_client.h"
#include "protocol/unsharded_view.h"
#include "ragshard/v1/daemon.grpc.pb.h"

namespace ragshard {

struct ClientOptions {
  std::string daemon_socket;
  std::shared_ptr<PlannerClient> planner;
  std::string job_id;
  int64_t rank = 0;
  std::string node_id;
  std::chrono::milliseconds timeout{60'000};
  // A daemon that answers nothing for this long is hung (or stopped): the rank's call fails
  // naming it. A live daemon answers a wait at least every kWaitSlice. A program's
  // RAGSHARD_PEER_TIMEOUT_S sets it (FromEnvironment).
  std::chrono::milliseconds peer_timeout{30'000};
  // Start and wait through the shared-memory command queue the daemon offers at attach
  // (docs/daemon.md); false (a program's RAGSHARD_COMMAND_QUEUE=0) keeps every call on gRPC.
  bool command_queue = true;

  // The defaults with what this process's environment sets: RAGSHARD_PEER_TIMEOUT_S (seconds in
  // (0, 86400]) and RAGSHARD_COMMAND_QUEUE (0: gRPC only, or 1). INVALID_ARGUMENT names a
  // variable whose value is neither. Read once where a program (or the C ABI's
  // rs_client_create) starts: Client::Create takes its options as given.
  static absl::StatusOr<ClientOptions> FromEnvironment();
};

class Client;

// An operation in flight. Wait returns its result (an error names a lost peer); once it is
// done, later waits and polls of the same handle answer the same result.
class OpHandle {
 public:
  absl::Status Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60'000));
  // True when done; an error when the operation failed.
  absl::StatusOr<bool> Poll();
  // Once done through the command queue: when the daemon's job thread ran the operation
  // (CLOCK_MONOTONIC ns, as Python's time.monotonic_ns); 0 before, and over gRPC.
  int64_t started_ns() const { return started_ns_; }
  int64_t finished_ns() const { return finished_ns_; }

 private:
  friend class Client;
  OpHandle(Client* client, uint64_t handle, int unit, QueueTicket ticket = {})
      : client_(client), handle_(handle), unit_(unit), ticket_(ticket) {}
  // Through the command queue: done (with `timeout` 0, a poll), or not yet.
  absl::StatusOr<bool> WaitQueued(std::chrono::microseconds timeout);
  absl::Status Finish(absl::Status result);
  Client* client_;
  uint64_t handle_;
  int unit_;
  QueueTicket ticket_;  // slot -1: started over gRPC
  bool finished_ = false;
  absl::Status result_;
  int64_t started_ns_ = 0;
  int64_t finished_ns_ = 0;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(ClientOptions options);
  ~Client();

  // Registers this rank's inventory with the planner, in full or only its canonical hash,
  // through the node's daemon, which registers the node's ranks in one call (docs/daemon.md,
  // "Registration"): answers once that call has. `local_ranks` is this job's ranks on this node
  // (torchrun's LOCAL_WORLD_SIZE): the daemon calls once they all have asked; 0, not known,
  // registers this rank alone. A daemon without Register (an older one) has the rank register
  // with the planner itself (RegisterRank).
  absl::Status Register(const Inventory& inventory, bool send_full, int64_t local_ranks = 0);
  // Attaches to the daemon (which waits for the plan), receives the arena's memfd and maps it.
  // `salvage`: only to read this rank's state of a job that cannot go on (a shrunk job's, whose
  // successor takes it over: docs/recovery.md, "Shrinking in place"); no operation runs.
  absl::Status Attach(bool salvage = false);
  // After a salvage Attach, once every survivor of the shrink has taken its state over: detaches,
  // and the daemon drops the stopped job, returning its buffers on this node to the pool (this
  // client's views of them must not be read again). NOT_FOUND where another rank of the node
  // released it first.
  absl::Status ReleaseSalvaged();

  const v1::Plan& plan() const { return plan_; }
  const std::string& job_id() const { return options_.job_id; }
  int64_t rank() const { return options_.rank; }
  // The gradients' replicas, W / |g| (HSDP's replicas of the shard group when p = g = os; 1 for
  // plain FSDP): where it is above 1, AllReduce sums the gradient shards over them.
  int64_t replicas() const { return replicas_; }
  // This rank's positions in the layouts of the job's factors (engine/sharding.h): its
  // parameter shard is position p of plan().world_size(), and so on.
  const v1::RankPositions& positions() const { return positions_; }
  // "host" or "device-shaped" (views below map the daemon's memfd arena) or "cuda" (the buffers
  // are offsets in the CUDA slab of cuda_device(), shared as cuda_ipc_handle(); host views are
  // then errors).
  const std::string& backend() const { return backend_; }
  int cuda_device() const { return cuda_device_; }
  const std::string& cuda_ipc_handle() const { return cuda_ipc_handle_; }
  int units() const { return static_cast<int>(buffers_.size()); }
  const v1::UnitBuffers& buffers(int unit) const { return buffers_[unit]; }

  // Typed views into the daemon's buffers. T must match the unit's dtype (float for fp32,
  // uint16_t for bf16/fp16, int8_t/uint8_t for 8-bit types, int32_t, int64_t); otherwise
  // INVALID_ARGUMENT names both.
  template <typename T>
  absl::StatusOr<absl::Span<T>> ParamShard(int unit) {
    return View<T>(unit, arena_ + buffers_[Check(unit)].param_shard_offset(), 1);
  }
  // The transient buffers move between allocations: a view is valid until the operation that
  // releases it (reshard, the end of reduce_scatter), and FAILED_PRECONDITION says so outside.
  // On the host backend the unsharded buffer may be a view that maps the node's shards
  // (protocol/unsharded_view.h): its pointer then lies outside arena(), is the same for the unit
  // at every unshard, and this rank's writes over its own shards are discarded at reshard.
  template <typename T>
  absl::StatusOr<absl::Span<T>> Unsharded(int unit) {
    const int64_t off = buffers_[Check(unit)].unsharded_offset();
    if (absl::Status s =
            CheckAllocated(Check(unit), off, "unsharded parameters", "unshard to reshard");
        !s.ok()) {
      return s;
    }
    return View<T>(unit, UnshardedData(unit), plan_.world_size());
  }
  // The unsharded buffer's first byte, or nullptr while the unit is resharded.
  const char* UnshardedData(int unit) const;
  template <typename T>
  absl::StatusOr<absl::Span<T>> Grad(int unit) {
    const int64_t off = buffers_[Check(unit)].grad_offset();
    if (absl::Status s = CheckAllocated(Check(unit), off, "unsharded gradients",
                                        "allocate_grad to the end of reduce_scatter");
        !s.ok()) {
      return s;
    }
    return View<T>(unit, arena_ + off, plan_.world_size());
  }
  // fp32, whatever the unit's dtype: the g layout's shard (grad_shard_elems; with p = g = os
  // the parameter shard's size).
  absl::StatusOr<absl::Span<float>> GradShard(int unit);
  // fp32: the matrices this rank owns, packed in plan order, from GatherToOwner to
  // ScatterFromOwner. NOT_FOUND when this rank owns no matrix tensor of the unit.
  absl::StatusOr<absl::Span<float>> OwnerBuffer(int unit);

  // The mapped arena, for checks that views point into the daemon's memory.
  const char* arena() const { return arena_; }
  size_t arena_bytes() const { return arena_bytes_; }

  absl::StatusOr<OpHandle> Unshard(int unit);
  // keep_ranks > 1: reshard to groups of that many local ranks (FSDP2's
  // reshard_after_forward=n); the next Unshard then moves nothing between nodes.
  absl::StatusOr<OpHandle> Reshard(int unit, int keep_ranks = 0);
  // The unsharded parameter buffer without the all-gather (the caller fills it).
  absl::StatusOr<OpHandle> AllocateUnsharded(int unit);
  // The unit's gradient buffers, zero-filled unless they exist: the start of its backward.
  absl::StatusOr<OpHandle> AllocateGrad(int unit);
  // `accumulate`: the reduction is added to what the gradient shard holds (gradient
  // accumulation by repeated backward) instead of replacing it.
  absl::StatusOr<OpHandle> ReduceScatter(int unit, v1::ReduceKind op = v1::REDUCE_AVG,
                                         bool accumulate = false);
  // The gradient shards over the replicate dimension (HSDP); done at once without replicas.
  absl::StatusOr<OpHandle> AllReduce(int unit, v1::ReduceKind op = v1::REDUCE_AVG);
  // The gradient-shard pieces of the unit's matrix tensors to their owners' buffers, and back.
  absl::StatusOr<OpHandle> GatherToOwner(int unit);
  absl::StatusOr<OpHandle> ScatterFromOwner(int unit);
  // AMSP's update gather after an optimizer step on separate factors (each rank stepped its os
  // range; the ranges reach every parameter shard that holds them).
  absl::StatusOr<OpHandle> UpdateGather(int unit);
  // The daemon's pool and job counters.
  absl::StatusOr<v1::StatsResponse> DaemonStats();

  // A buffer of this rank's own in the daemon, kept by name for the job's life: a later process
  // of the same rank gets it back (docs/recovery.md). `existed`: it was there before this call,
  // with what was written into it; else its bytes are zero. `rank_memory`: it lives beside the
  // rank's parameter shards (pool::InRankMemory), at `offset` of the memory their placements
  // are offsets of; `data` is its host address, nullptr where that memory is a CUDA device's.
  struct StateBuffer {
    char* data = nullptr;
    int64_t offset = 0;
    int64_t bytes = 0;
    bool existed = false;
    bool rank_memory = false;
  };
  absl::StatusOr<StateBuffer> GetStateBuffer(const std::string& name, int64_t bytes);
  // The job's recovery epoch this attachment runs in, and whether this rank's state was in the
  // daemon before it attached (a process of this rank had attached: it adopts that state).
  int64_t recovery_epoch() const { return recovery_epoch_; }
  bool adopted() const { return adopted_; }
  // The job's redundancy across nodes (JobOptions.redundancy; "" none), and whether this rank's
  // daemon replaces a lost node: its state is then rebuilt by OP_REBUILD (docs/recovery.md).
  const std::string& redundancy() const { return redundancy_; }
  bool replacement() const { return replacement_; }
  bool recoverable() const { return recoverable_; }
  // A round trip to the daemon that does nothing (control-path latency): through the command
  // queue when there is one, else gRPC. NoOpRpc is always gRPC, for comparison.
  absl::Status NoOp();
  absl::Status NoOpRpc();
  // Whether starts and waits go through the shared-memory command queue.
  bool command_queue() const { return queue_ != nullptr; }

  // Starts an operation of any kind (the named methods above are this with their kind): what
  // the Python binding passes down as the enum itself. `op` is for the reductions, `keep_ranks`
  // for OP_RESHARD, `accumulate` for OP_REDUCE_SCATTER. INVALID_ARGUMENT for OP_NOOP and unknown
  // kinds.
  absl::StatusOr<OpHandle> StartOp(v1::OpKind kind, int unit, v1::ReduceKind op = v1::REDUCE_SUM,
                                   int keep_ranks = 0, bool accumulate = false);

  // The longest one wait call to the daemon lasts (OpHandle::Wait repeats it).
  static constexpr std::chrono::milliseconds kWaitSlice{2000};

 private:
  friend class OpHandle;
  // The error of a failed call to the daemon: a call that got no answer names the daemon's
  // node and socket and says it is hung; one that could not reach it, unreachable.
  absl::Status DaemonCallError(const grpc::ClientContext& ctx, const grpc::Status& st,
                               const char* call) const;
  explicit Client(ClientOptions options) : options_(std::move(options)) {}
  int Check(int unit) const { return unit >= 0 && unit < units() ? unit : 0; }
  absl::Status CheckHostBuffers() const;
  absl::Status CheckAllocated(int unit, int64_t offset, const char* what, const char* op) const;
  // Applies the placement an operation on `unit` reported, mapping its unsharded view.
  absl::Status Place(int unit, const v1::UnitBuffers& placement);
  absl::Status MapUnshardedView(int unit);
  absl::Status CheckView(int unit, size_t item, bool (*matches)(v1::DType)) const;
  template <typename T>
  absl::StatusOr<absl::Span<T>> View(int unit, const char* data, int64_t count_per_shard);

  ClientOptions options_;
  std::unique_ptr<v1::Daemon::Stub> daemon_;
  std::string attachment_;
  v1::Plan plan_;
  std::vector<v1::UnitBuffers> buffers_;
  int64_t replicas_ = 1;
  v1::RankPositions positions_;
  std::string backend_ = "host";
  int cuda_device_ = 0;
  std::string cuda_ipc_handle_;
  ScopedFd side_channel_;
  char* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  ScopedFd arena_fd_;
  std::vector<std::unique_ptr<UnshardedView>> views_;  // per unit, once it has had one
  std::unique_ptr<RankQueue> queue_;                   // after Attach, where the daemon offered one
  int64_t recovery_epoch_ = 0;
  bool adopted_ = false;
  std::string redundancy_;
  bool replacement_ = false;
  bool recoverable_ = false;
};

template <typename T>
bool DTypeMatches(v1::DType d) {
  if constexpr (std::is_same_v<T, float>) return d == v1::DTYPE_FP32;
  if constexpr (std::is_same_v<T, uint16_t>) return d == v1::DTYPE_BF16 || d == v1::DTYPE_FP16;
  if constexpr (std::is_same_v<T, int8_t>) return d == v1::DTYPE_INT8;
  if constexpr (std::is_same_v<T, uint8_t>) {
    return d == v1::DTYPE_UINT8 || d == v1::DTYPE_FP8E4M3 || d == v1::DTYPE_FP8E5M2;
  }
  if constexpr (std::is_same_v<T, int32_t>) return d == v1::DTYPE_INT32;
  if constexpr (std::is_same_v<T, int64_t>) return d == v1::DTYPE_INT64;
  return false;
}

template <typename T>
absl::StatusOr<absl::Span<T>> Client::View(int unit, const char* data, int64_t count_per_shard) {
  absl::Status s = CheckView(unit, sizeof(T), &DTypeMatches<T>);
  if (!s.ok()) return s;
  T* base = reinterpret_cast<T*>(const_cast<char*>(data));
  return absl::Span<T>(base, static_cast<size_t>(buffers_[unit].shard_elems() * count_per_shard));
}

}  // namespace ragshard
