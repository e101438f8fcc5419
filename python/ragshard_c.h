/* libragshard_c: the client library behind a C ABI, which ragshard._core loads with ctypes.
 *
 * A C ABI ties the Python package to no CPython version (no Python header, no module init, no
 * reference counting in C++): one build imports under any CPython 3.10 to 3.13 (docs/gpu.md).
 *
 * Every function that can fail returns 0 or an absl::StatusCode, and keeps the message for
 * rs_last_error() on the calling thread. Strings a function hands out (const char** out) stay
 * valid until the next call on the same thread; the caller copies them. No function calls back
 * into Python, so the caller may release the GIL around each call (ctypes does). The calls on a
 * client that do not wait are serialised by its mutex, as the GIL serialised them under the
 * former pybind11 module; register, attach and waits are not.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default)

enum { RS_BAD_ARGUMENT = -1, RS_OUT_OF_RANGE = -2 };

typedef struct rs_client rs_client;
typedef struct rs_handle rs_handle;

/* The ABI's version: ragshard._core refuses a library whose version differs. */
int rs_abi_version(void);
/* The contract of a rank's state buffers in the daemon's pool (protocol/pool_contract.h) as
 * JSON: a static string. */
int rs_pool_contract(const char** out);
/* A job's redundancy across nodes (engine/redundancy.h), the rules the planner and the daemon
 * apply, as JSON: {"name", "whole_copies", "min_nodes", "group" (parity:K's K + 1, else 0),
 * "nodes_error" (why it cannot run on `nodes` nodes, or ""; `nodes` 0: not asked)}. A spelling
 * that is none of them fails (INVALID_ARGUMENT naming `field`). */
int rs_redundancy(const char* field, const char* text, int64_t nodes, const char** out);
const char* rs_last_error(void);

/* How a client reaches its planner: the bearer token file and TLS, as ragshardctl's --token-file,
 * --tls-ca (the planner's CA: enables TLS), --tls-cert and --tls-key (mutual TLS) and
 * --tls-server-name. A NULL field (or a NULL rs_security) takes its environment variable:
 * RAGSHARD_TOKEN_FILE, RAGSHARD_TLS_CA, RAGSHARD_TLS_CERT, RAGSHARD_TLS_KEY,
 * RAGSHARD_TLS_SERVER_NAME. An empty TLS field is none (plaintext when tls_ca is empty); an empty
 * token_file is RAGSHARD_TOKEN_FILE's, as in the functions that take a token_file alone. */
typedef struct rs_security {
  const char* token_file;
  const char* tls_ca;
  const char* tls_cert;
  const char* tls_key;
  const char* tls_server_name;
} rs_security;

/* The functions below that take a token_file (ABI version 2) take TLS from the environment; their
 * _secure forms (version 3) take an rs_security. */

/* fake_device: 1 puts the device path's buffers over the host arena (tests without a GPU). */
int rs_client_create_secure(const char* planner, const char* socket, const char* job, int64_t rank,
                            const char* node, int64_t timeout_ms, const rs_security* security,
                            int fake_device, rs_client** out);
int rs_client_create(const char* planner, const char* socket, const char* job, int64_t rank,
                     const char* node, int64_t timeout_ms, const char* token_file, int fake_device,
                     rs_client** out);
void rs_client_destroy(rs_client* c);
/* Through the node's daemon (ABI version 4): local_ranks is the job's ranks on this node, which
 * the daemon registers in one call once they all have asked; 0: not known (registered alone). */
int rs_client_register(rs_client* c, const char* inventory_json, int send_full,
                       int64_t local_ranks);
/* salvage != 0: only to read this rank's state of a job that cannot go on (a shrunk job's). */
int rs_client_attach(rs_client* c, int salvage);
/* After a salvage attach, once every survivor of the shrink took its state over: detaches and
 * drops the stopped job's buffers on this node (NOT_FOUND: another local rank did already). */
int rs_client_release_salvaged(rs_client* c);
int rs_client_plan_json(rs_client* c, const char** out);
/* units, world_size, replicas, rank, cuda_device; *on_device: 1 when buffers are device memory. */
void rs_client_shape(rs_client* c, int64_t out[5], int* on_device);
int rs_client_unit_dtype(rs_client* c, int unit, const char** out);
int rs_client_shard_elems(rs_client* c, int unit, int64_t* out);
/* This rank's layout of `unit` (engine/sharding.h): its p, g and os positions, whether it steps
 * the optimizer, the gradient shard's and the optimizer range's elements, where that range
 * starts in the parameter shard and in the gradient shard, and its os group's index. */
int rs_client_layout(rs_client* c, int unit, int64_t out[9]);
/* kind: 0 param shard, 1 unsharded, 2 grad, 3 grad shard, 4 owner buffer. *count is -1 when the
 * unit has no owner buffer. *typestr is numpy's ("<f4", "<u2", "|u1"). */
int rs_client_buffer(rs_client* c, int unit, int kind, uintptr_t* ptr, int64_t* count,
                     const char** typestr);
/* kind: a ragshard.v1.OpKind number (proto/ragshard/v1/daemon.proto; not OP_NOOP), reduce a
 * ragshard.v1.ReduceKind (0 sum, 1 avg; for the reductions), keep the group of OP_RESHARD,
 * accumulate (0 or 1) whether OP_REDUCE_SCATTER adds into the gradient shards. */
int rs_client_op(rs_client* c, int kind, int unit, int reduce, int keep, int accumulate,
                 rs_handle** out);
int rs_client_noop(rs_client* c);
/* The daemon's pool and this job's figures, as a JSON object. */
int rs_client_stats(rs_client* c, const char** out);
/* A key of this client's job on the planner (its rendezvous keys: Put and Get), set to the n
 * bytes at value; and a key's value, waiting up to wait_ms for it to be set (DEADLINE_EXCEEDED
 * naming the key after that): *out holds *n bytes until this thread's next call. */
int rs_client_put(rs_client* c, const char* key, const void* value, int64_t n);
int rs_client_get(rs_client* c, const char* key, int64_t wait_ms, const char** out, int64_t* n);
/* A buffer of this rank's own in the daemon, kept by name for the job's life
 * (docs/recovery.md): *existed is 1 when it was there before (a restarted process adopts it),
 * else 0 and its bytes are zero. *on_device is 1 when *ptr is device memory beside the rank's
 * parameter shards (the optimizers' state and undo copies on the cuda backend, or with
 * fake_device), else 0: host memory. */
int rs_client_state_buffer(rs_client* c, const char* name, int64_t bytes, uintptr_t* ptr,
                           int* existed, int* on_device);
/* The job's recovery epoch of this attachment, 1 when the rank adopted state that a previous
 * process of it left in the daemon, and 1 when the job recovers lost ranks in place. */
void rs_client_recovery(rs_client* c, int64_t* epoch, int* adopted, int* recoverable);
/* ABI 7: the job's redundancy across nodes ("" none, "parity:K", "replica"; valid while the
 * client lives), and whether this rank's daemon replaces a lost node (docs/recovery.md). */
void rs_client_redundancy(rs_client* c, const char** text, int* replacement);

int rs_handle_wait(rs_handle* h, int64_t timeout_ms);
int rs_handle_poll(rs_handle* h, int* done);
// When the daemon ran the finished operation (CLOCK_MONOTONIC ns; 0 and 0 when unknown).
void rs_handle_times(rs_handle* h, int64_t* started_ns, int64_t* finished_ns);
void rs_handle_destroy(rs_handle* h);

int rs_create_job(const char* planner, const char* job, int64_t shard_size, int64_t replicate_size,
                  const char* policy, const char* default_granule, const char* token_file,
                  const char* strategy, int64_t memory_budget_bytes, const char* optimizer,
                  int64_t tokens_per_step, const char** job_id);
int rs_create_job_secure(const char* planner, const char* job, int64_t shard_size,
                         int64_t replicate_size, const char* policy, const char* default_granule,
                         const rs_security* security, const char* strategy,
                         int64_t memory_budget_bytes, const char* optimizer,
                         int64_t tokens_per_step, int64_t recovery_deadline_ms,
                         const char* redundancy, const char* on_node_loss, const char** job_id);
int rs_delete_job(const char* planner, const char* job, const char* token_file);
int rs_delete_job_secure(const char* planner, const char* job, const rs_security* security);
// The world size of an existing job (NOT_FOUND where there is none).
int rs_job_world_size(const char* planner, const char* job, const char* token_file,
                      int64_t* world_size);
int rs_job_world_size_secure(const char* planner, const char* job, const rs_security* security,
                             int64_t* world_size);
// The job as the planner answers GetJob (protobuf JSON with the proto's field names; NOT_FOUND
// where there is none): its status, and a shrunk job's successor and survivor ranks.
int rs_job_json(const char* planner, const char* job, const rs_security* security,
                const char** out);
int rs_plan_local(const char* inventory_json, int64_t world, const char* policy,
                  int32_t align_bytes, const char** out);
/* engine/data_plane_memory.h for n units; out: shards, grad_shards, unsharded, grads. */
void rs_data_plane_peak(const int64_t* shard_elems, const int64_t* group, const double* bytes,
                        const int64_t* grad_shard_elems, int64_t n, int64_t ranks, int shared,
                        int64_t prefetch, int64_t p_slots, int64_t g_slots, int64_t g_ring_nodes,
                        int64_t g_ring_slots, double out[5]);
/* Dequantizes block-quantized codes into fp32 (client/block_quant.h): chunks holds
   n_chunks x 7 int64 (pos, bands, rows, cols, width, first_block, tiles), values the 256 fp32
   values of the code bytes. Elements outside the chunks are not written. */
int rs_dequantize_chunks(const uint8_t* codes, int64_t n_codes, const float* scales,
                         int64_t n_scales, const float* values, const int64_t* chunks,
                         int64_t n_chunks, float* out, int64_t n_out);
/* The quantizer's passes (client/block_quant.h): each block's largest |x| folded into amax,
   then the codes of x / scales (fp8: e4m3fn, else int8). Elements outside the chunks are not
   written. */
int rs_block_amax(const float* x, int64_t n, const int64_t* chunks, int64_t n_chunks, float* amax,
                  int64_t n_blocks);
int rs_encode_chunks(const float* x, int64_t n, const float* scales, int64_t n_scales,
                     const int64_t* chunks, int64_t n_chunks, int fp8, uint8_t* codes,
                     int64_t n_codes);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
