// libragshard_c: the client library behind the C ABI of ragshard_c.h (ragshard._core loads it
// with ctypes). Buffers are returned as addresses: the host arena's (host backends) or the GPU
// slab's, opened from the daemon's CUDA IPC handle (the cuda backend; with fake_device, the host
// arena, so that the device path's pointers, shapes and types are checked where there is no GPU).
// Here: the clients' and the jobs' calls; the calls that need no planner or daemon are in
// ragshard_c_local.cc, the errors and strings every call hands out in ragshard_c_abi.h.
#include "ragshard_c.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/device_memory.h"
#include "engine/dtype.h"
#include "engine/inventory.h"
#include "protocol/planner_client.h"
#include "ragshard_c_abi.h"

// The C++ Client is thread-compatible, and ctypes releases the GIL around every call: `mu`
// serialises the calls that do not wait (what the GIL serialised under the pybind11 module),
// while register, attach and waits run as before, concurrently with them.
struct rs_client {
  std::unique_ptr<ragshard::Client> client;
  // The client's planner connection, for the job's keys (rs_client_put, rs_client_get).
  std::shared_ptr<ragshard::PlannerClient> planner;
  bool fake_device = false;
  std::unique_ptr<ragshard::DeviceMapping> mapping;  // the GPU slab, once opened
  std::mutex mu;
};

struct rs_handle {
  ragshard::OpHandle handle;
  rs_client* client;
};

namespace ragshard {
namespace {

using c_abi::Fail;
using c_abi::Out;
using c_abi::Str;
using c_abi::ToJson;

// 3: the _secure functions (TLS); version 2's functions remain. 4: rs_client_register takes
// local_ranks (registration through the daemon). 5: rs_dequantize_chunks, rs_block_amax,
// rs_encode_chunks. 8: rs_client_attach takes salvage, rs_create_job_secure on_node_loss,
// rs_job_json (shrinking in place). 9: rs_client_release_salvaged. 10: rs_client_op takes
// accumulate (gradient accumulation). 11: rs_pool_contract, rs_redundancy. 13: rs_client_put,
// rs_client_get (the job's keys on the planner: checkpoints' plans).
constexpr int kAbiVersion = 13;

// rs_security's fields: NULL takes the environment's (ClientSecurityFromEnv), else as given;
// an empty token_file is the environment's too (ragshard_c.h).
ClientSecurityOptions Security(const rs_security* s) {
  ClientSecurityOptions o = ClientSecurityFromEnv();
  if (s == nullptr) return o;
  if (s->token_file != nullptr && *s->token_file != '\0') o.token_file = s->token_file;
  for (auto [field, value] :
       {std::pair{&o.tls_ca_file, s->tls_ca}, std::pair{&o.tls_cert_file, s->tls_cert},
        std::pair{&o.tls_key_file, s->tls_key},
        std::pair{&o.tls_server_name, s->tls_server_name}}) {
    if (value != nullptr) *field = value;
  }
  return o;
}

// Version 2's token_file alone: TLS from the environment.
rs_security TokenOnly(const char* token_file) {
  return rs_security{token_file, nullptr, nullptr, nullptr, nullptr};
}

absl::StatusOr<std::shared_ptr<PlannerClient>> Planner(const char* address,
                                                       const rs_security* security) {
  PlannerClientOptions o;
  o.address = Str(address);
  o.security = Security(security);
  auto window = RetryWindowFromEnv(o.retry_window);  // RAGSHARD_PLANNER_RETRY_S, else 60 s
  if (!window.ok()) return window.status();
  o.retry_window = *window;
  auto p = GrpcPlannerClient::Create(std::move(o));
  if (!p.ok()) return p.status();
  return std::shared_ptr<PlannerClient>(std::move(*p));
}

int CheckUnit(const rs_client* c, int unit) {
  if (unit >= 0 && unit < c->client->units()) return 0;
  return Fail(RS_OUT_OF_RANGE,
              absl::StrCat("unit ", unit, " does not exist (", c->client->units(), " units)"));
}

std::string Transient(const v1::UnitBuffers& b, const char* what, const char* when) {
  return absl::StrCat("unit '", b.unit(), "' has no ", what, " now: they exist from ", when,
                      " (transient buffers, docs/daemon.md)");
}

// Offset 0 of the buffers' memory: the host arena, or the GPU slab (opened once).
absl::StatusOr<uintptr_t> Base(rs_client* c) {
  const bool device = c->client->backend() == "cuda";
  if (!device || c->fake_device) return reinterpret_cast<uintptr_t>(c->client->arena());
  if (c->mapping == nullptr) {
    auto m = OpenCudaIpc(c->client->cuda_device(), c->client->cuda_ipc_handle());
    if (!m.ok()) return m.status();
    c->mapping = std::move(*m);
  }
  return c->mapping->base();
}

}  // namespace
}  // namespace ragshard

using namespace ragshard;  // NOLINT(google-build-using-namespace): the C ABI's definitions

extern "C" {

int rs_abi_version(void) { return kAbiVersion; }

const char* rs_last_error(void) { return c_abi::LastError(); }

int rs_client_create(const char* planner, const char* socket, const char* job, int64_t rank,
                     const char* node, int64_t timeout_ms, const char* token_file, int fake_device,
                     rs_client** out) {
  const rs_security s = TokenOnly(token_file);
  return rs_client_create_secure(planner, socket, job, rank, node, timeout_ms, &s, fake_device,
                                 out);
}

int rs_client_create_secure(const char* planner, const char* socket, const char* job, int64_t rank,
                            const char* node, int64_t timeout_ms, const rs_security* security,
                            int fake_device, rs_client** out) {
  auto p = Planner(planner, security);
  if (!p.ok()) return Fail(p.status());
  auto from_env = ClientOptions::FromEnvironment();  // RAGSHARD_PEER_TIMEOUT_S, _COMMAND_QUEUE
  if (!from_env.ok()) return Fail(from_env.status());
  ClientOptions o = std::move(*from_env);
  o.planner = *p;
  o.daemon_socket = Str(socket);
  o.job_id = Str(job);
  o.rank = rank;
  o.node_id = Str(node);
  o.timeout = std::chrono::milliseconds(timeout_ms);
  auto c = Client::Create(std::move(o));
  if (!c.ok()) return Fail(c.status());
  *out = new rs_client;
  (*out)->client = std::move(*c);
  (*out)->planner = std::move(*p);
  (*out)->fake_device = fake_device != 0;
  return 0;
}

int rs_client_put(rs_client* c, const char* key, const void* value, int64_t n) {
  if (n < 0 || (n > 0 && value == nullptr)) {
    return Fail(RS_BAD_ARGUMENT, absl::StrCat("rs_client_put: ", n, " bytes at ",
                                              value == nullptr ? "NULL" : "a value"));
  }
  const absl::Status s =
      c->planner->Put(c->client->job_id(), Str(key),
                      n == 0 ? std::string() : std::string(static_cast<const char*>(value), n));
  return s.ok() ? 0 : Fail(s);
}

int rs_client_get(rs_client* c, const char* key, int64_t wait_ms, const char** out, int64_t* n) {
  if (wait_ms < 0) return Fail(RS_BAD_ARGUMENT, absl::StrCat("rs_client_get: wait_ms ", wait_ms));
  auto v = c->planner->Get(c->client->job_id(), Str(key), std::chrono::milliseconds(wait_ms));
  if (!v.ok()) return Fail(v.status());
  *n = static_cast<int64_t>(v->size());
  return Out(std::move(*v), out);
}

void rs_client_destroy(rs_client* c) { delete c; }

int rs_client_register(rs_client* c, const char* inventory_json, int send_full,
                       int64_t local_ranks) {
  auto inv = ParseInventoryJson(Str(inventory_json));
  if (!inv.ok()) return Fail(inv.status());
  const absl::Status s = c->client->Register(*inv, send_full != 0, local_ranks);
  return s.ok() ? 0 : Fail(s);
}

int rs_client_attach(rs_client* c, int salvage) {
  const absl::Status s = c->client->Attach(salvage != 0);
  return s.ok() ? 0 : Fail(s);
}

int rs_client_release_salvaged(rs_client* c) {
  const absl::Status s = c->client->ReleaseSalvaged();
  return s.ok() ? 0 : Fail(s);
}

int rs_client_plan_json(rs_client* c, const char** out) {
  const std::lock_guard<std::mutex> lock(c->mu);
  return Out(ToJson(c->client->plan()), out);
}

void rs_client_shape(rs_client* c, int64_t out[5], int* on_device) {
  const std::lock_guard<std::mutex> lock(c->mu);
  const Client& k = *c->client;
  out[0] = k.units();
  out[1] = k.plan().world_size();
  out[2] = k.replicas();
  out[3] = k.rank();
  out[4] = k.cuda_device();
  *on_device = k.backend() == "cuda" || c->fake_device ? 1 : 0;
}

int rs_client_unit_dtype(rs_client* c, int unit, const char** out) {
  const std::lock_guard<std::mutex> lock(c->mu);
  if (int e = CheckUnit(c, unit)) return e;
  return Out(std::string(DTypeName(c->client->buffers(unit).dtype())), out);
}

int rs_client_shard_elems(rs_client* c, int unit, int64_t* out) {
  const std::lock_guard<std::mutex> lock(c->mu);
  if (int e = CheckUnit(c, unit)) return e;
  *out = c->client->buffers(unit).shard_elems();
  return 0;
}

int rs_client_layout(rs_client* c, int unit, int64_t out[9]) {
  const std::lock_guard<std::mutex> lock(c->mu);
  if (int e = CheckUnit(c, unit)) return e;
  const Client& k = *c->client;
  const v1::RankPositions& pos = k.positions();
  const v1::UnitBuffers& b = k.buffers(unit);
  // A daemon that predates separate factors describes p = g = os.
  const bool described = b.grad_shard_elems() > 0;
  const int64_t p = described ? pos.p() : k.rank() % k.plan().world_size();
  out[0] = p;
  out[1] = described ? pos.g() : p;
  out[2] = described ? pos.os() : p;
  out[3] = described ? pos.steps_optimizer() : 1;
  out[4] = described ? b.grad_shard_elems() : b.shard_elems();
  out[5] = described ? b.os_elems() : b.shard_elems();
  out[6] = b.os_param_offset();
  out[7] = b.os_grad_offset();
  out[8] = described ? pos.os_group() : k.rank() / k.plan().world_size();
  return 0;
}

int rs_client_buffer(rs_client* c, int unit, int kind, uintptr_t* ptr, int64_t* count,
                     const char** typestr) {
  const std::lock_guard<std::mutex> lock(c->mu);
  if (int e = CheckUnit(c, unit)) return e;
  const v1::UnitBuffers& b = c->client->buffers(unit);
  const int64_t s = b.shard_elems(), w = c->client->plan().world_size();
  int64_t offset = 0;
  const char* missing = nullptr;  // a transient buffer that does not exist now, and when it does
  const char* when = nullptr;
  switch (kind) {
    case 0:
      offset = b.param_shard_offset(), *count = s;
      break;
    case 1:
      offset = b.unsharded_offset(), *count = w * s;
      if (offset < 0) {
        missing = "unsharded parameters", when = "unshard to reshard";
      }
      break;
    case 2:
      offset = b.grad_offset(), *count = w * s;
      if (offset < 0) {
        missing = "unsharded gradients", when = "allocate_grad to the end of reduce_scatter";
      }
      break;
    case 3:
      offset = b.grad_shard_offset(), *count = b.grad_shard_elems() > 0 ? b.grad_shard_elems() : s;
      break;
    case 4:
      if (b.owner_elems() == 0) {
        *count = -1;
        return 0;
      }
      offset = b.owner_offset(), *count = b.owner_elems();
      if (offset < 0) {
        missing = "owner buffer", when = "gather_to_owner to scatter_from_owner";
      }
      break;
    default:
      return Fail(RS_BAD_ARGUMENT, absl::StrCat("buffer kind ", kind, " is not one of 0 to 4"));
  }
  if (missing != nullptr) {
    return Fail(absl::FailedPreconditionError(Transient(b, missing, when)));
  }
  // Element type as numpy names it (bf16/fp16 as uint16, 8-bit types as uint8).
  const v1::DType d = kind >= 3 ? v1::DTYPE_FP32 : b.dtype();
  if (d == v1::DTYPE_FP32) {
    *typestr = "<f4";
  } else if (d == v1::DTYPE_BF16 || d == v1::DTYPE_FP16) {
    *typestr = "<u2";
  } else if (d == v1::DTYPE_UINT8 || d == v1::DTYPE_INT8 || d == v1::DTYPE_FP8E4M3 ||
             d == v1::DTYPE_FP8E5M2) {
    *typestr = "|u1";
  } else {
    return Fail(absl::UnimplementedError(absl::StrCat("no array view for dtype ", DTypeName(d))));
  }
  if (kind == 1 && b.has_unsharded_view()) {
    // The host backend's view over the node's shards (protocol/unsharded_view.h).
    *ptr = reinterpret_cast<uintptr_t>(c->client->UnshardedData(unit));
    return 0;
  }
  auto base = Base(c);
  if (!base.ok()) return Fail(base.status());
  *ptr = *base + static_cast<uintptr_t>(offset);
  return 0;
}

int rs_client_op(rs_client* c, int kind, int unit, int reduce, int keep, int accumulate,
                 rs_handle** out) {
  const std::lock_guard<std::mutex> lock(c->mu);
  // GPU buffers: torch's kernels that write them are queued on torch's streams; the daemon's
  // operation must see what they wrote.
  if (c->mapping != nullptr) {
    const absl::Status s = c->mapping->Synchronize();
    if (!s.ok()) return Fail(s);
  }
  auto h = c->client->StartOp(static_cast<v1::OpKind>(kind), unit,
                              static_cast<v1::ReduceKind>(reduce), keep, accumulate != 0);
  if (!h.ok()) return Fail(h.status());
  *out = new rs_handle{*h, c};
  return 0;
}

int rs_client_noop(rs_client* c) {
  const std::lock_guard<std::mutex> lock(c->mu);
  const absl::Status s = c->client->NoOp();
  return s.ok() ? 0 : Fail(s);
}

int rs_client_state_buffer(rs_client* c, const char* name, int64_t bytes, uintptr_t* ptr,
                           int* existed, int* on_device) {
  const std::lock_guard<std::mutex> lock(c->mu);
  if (name == nullptr) return Fail(absl::InvalidArgumentError("name: must not be NULL"));
  auto b = c->client->GetStateBuffer(name, bytes);
  if (!b.ok()) return Fail(b.status());
  *existed = b->existed ? 1 : 0;
  // A buffer in the rank's memory is where its parameter shards are (device memory on the
  // cuda backend, and with fake_device); the others are host memory of the arena.
  *on_device = b->rank_memory && (c->client->backend() == "cuda" || c->fake_device) ? 1 : 0;
  if (!*on_device) {
    *ptr = reinterpret_cast<uintptr_t>(b->data);
    return 0;
  }
  auto base = Base(c);
  if (!base.ok()) return Fail(base.status());
  *ptr = *base + static_cast<uintptr_t>(b->offset);
  return 0;
}

void rs_client_recovery(rs_client* c, int64_t* epoch, int* adopted, int* recoverable) {
  const std::lock_guard<std::mutex> lock(c->mu);
  *epoch = c->client->recovery_epoch();
  *adopted = c->client->adopted() ? 1 : 0;
  *recoverable = c->client->recoverable() ? 1 : 0;
}

void rs_client_redundancy(rs_client* c, const char** text, int* replacement) {
  const std::lock_guard<std::mutex> lock(c->mu);
  *text = c->client->redundancy().c_str();
  *replacement = c->client->replacement() ? 1 : 0;
}

int rs_client_stats(rs_client* c, const char** out) {
  const std::lock_guard<std::mutex> lock(c->mu);
  auto s = c->client->DaemonStats();
  if (!s.ok()) return Fail(s.status());
  std::string json = absl::StrCat(
      "{\"pool_capacity\": ", s->pool_capacity(), ", \"pool_used\": ", s->pool_used(),
      ", \"pool_peak\": ", s->pool_peak(), ", \"pool_fragmentation\": ", s->pool_fragmentation());
  for (const auto& j : s->jobs()) {
    if (j.job_id() == c->client->job_id()) {
      absl::StrAppend(&json, ", \"staging_bytes\": ", j.staging_bytes(),
                      ", \"operations\": ", j.operations(),
                      ", \"protected_bytes\": ", j.protected_bytes(),
                      ", \"parity_bytes\": ", j.parity_bytes(), ", \"parity_steps\": [",
                      absl::StrJoin(j.parity_steps(), ", "), "], \"unit_operations\": [");
      for (int i = 0; i < j.unit_operations_size(); ++i) {
        const auto& u = j.unit_operations(i);
        absl::StrAppend(&json, i ? ", " : "", "{\"unit\": ", u.unit_index(), ", \"kind\": \"",
                        v1::OpKind_Name(u.kind()), "\", \"count\": ", u.count(), "}");
      }
      absl::StrAppend(&json, "]");
    }
  }
  return Out(json + "}", out);
}

int rs_handle_wait(rs_handle* h, int64_t timeout_ms) {
  const absl::Status s = h->handle.Wait(std::chrono::milliseconds(timeout_ms));
  return s.ok() ? 0 : Fail(s);
}

int rs_handle_poll(rs_handle* h, int* done) {
  const std::lock_guard<std::mutex> lock(h->client->mu);
  auto d = h->handle.Poll();
  if (!d.ok()) return Fail(d.status());
  *done = *d ? 1 : 0;
  return 0;
}

void rs_handle_times(rs_handle* h, int64_t* started_ns, int64_t* finished_ns) {
  *started_ns = h->handle.started_ns();
  *finished_ns = h->handle.finished_ns();
}

void rs_handle_destroy(rs_handle* h) { delete h; }

int rs_create_job(const char* planner, const char* job, int64_t shard_size, int64_t replicate_size,
                  const char* policy, const char* default_granule, const char* token_file,
                  const char* strategy, int64_t memory_budget_bytes, const char* optimizer,
                  int64_t tokens_per_step, const char** job_id) {
  const rs_security s = TokenOnly(token_file);
  return rs_create_job_secure(planner, job, shard_size, replicate_size, policy, default_granule, &s,
                              strategy, memory_budget_bytes, optimizer, tokens_per_step, 0, "", "",
                              job_id);
}

int rs_create_job_secure(const char* planner, const char* job, int64_t shard_size,
                         int64_t replicate_size, const char* policy, const char* default_granule,
                         const rs_security* security, const char* strategy,
                         int64_t memory_budget_bytes, const char* optimizer,
                         int64_t tokens_per_step, int64_t recovery_deadline_ms,
                         const char* redundancy, const char* on_node_loss, const char** job_id) {
  JobSpec spec;
  spec.recovery_deadline_ms = recovery_deadline_ms;
  spec.redundancy = Str(redundancy);
  spec.on_node_loss = Str(on_node_loss);
  spec.job_id = Str(job);
  spec.shard_size = shard_size;
  spec.replicate_size = replicate_size;
  spec.policy = Str(policy);
  spec.default_granule = Str(default_granule);
  spec.strategy = Str(strategy);
  spec.memory_budget_bytes = memory_budget_bytes;
  spec.optimizer = Str(optimizer);
  spec.tokens_per_step = tokens_per_step;
  auto p = Planner(planner, security);
  if (!p.ok()) return Fail(p.status());
  auto j = (*p)->CreateJob(
      MakeCreateJobRequest(spec));  // ALREADY_EXISTS is an error too: the caller decides
  if (!j.ok()) return Fail(j.status());
  return Out(j->job_id(), job_id);
}

int rs_delete_job(const char* planner, const char* job, const char* token_file) {
  const rs_security s = TokenOnly(token_file);
  return rs_delete_job_secure(planner, job, &s);
}

int rs_delete_job_secure(const char* planner, const char* job, const rs_security* security) {
  auto p = Planner(planner, security);
  if (!p.ok()) return Fail(p.status());
  const absl::Status s = (*p)->DeleteJob(Str(job));
  return s.ok() ? 0 : Fail(s);
}

int rs_job_world_size(const char* planner, const char* job, const char* token_file,
                      int64_t* world_size) {
  const rs_security s = TokenOnly(token_file);
  return rs_job_world_size_secure(planner, job, &s, world_size);
}

int rs_job_world_size_secure(const char* planner, const char* job, const rs_security* security,
                             int64_t* world_size) {
  auto p = Planner(planner, security);
  if (!p.ok()) return Fail(p.status());
  auto j = (*p)->GetJob(Str(job));
  if (!j.ok()) return Fail(j.status());
  *world_size = j->world_size();
  return 0;
}

int rs_job_json(const char* planner, const char* job, const rs_security* security,
                const char** out) {
  auto p = Planner(planner, security);
  if (!p.ok()) return Fail(p.status());
  auto j = (*p)->GetJob(Str(job));
  if (!j.ok()) return Fail(j.status());
  return Out(ToJson(*j), out);
}

}  // extern "C"
