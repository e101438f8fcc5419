"""ragshard._kernels: the C library's local computations (a plan, the block quantization kernels,
the data plane's peak memory), through ragshard._core's library."""
import ctypes

from ._core import _b, _check, _lib, _string


def plan_local(inventory_json, world, policy="ragged", align_bytes=16):
    """The plan the planner would compute for `inventory_json` (the planners are deterministic),
    as protobuf JSON: lets a client size buffers that depend on the shard sizes before
    registering."""
    return _string(_lib.rs_plan_local, _b(inventory_json), int(world), _b(policy),
                   int(align_bytes))


def dequantize_chunks(codes, n_codes, scales, n_scales, values, chunks, n_chunks, out, n_out):
    """client/block_quant.h over raw addresses (ints): out[e] = values[codes[e]] * scale of
    e's block, for the elements of the n_chunks chunks (7 int64 each: pos, bands, rows, cols,
    width, first_block, tiles). ragshard.quant calls it with its tensors' data_ptr()s; the GIL
    is released for the call."""
    _check(_lib.rs_dequantize_chunks(codes, int(n_codes), scales, int(n_scales), values, chunks,
                                     int(n_chunks), out, int(n_out)))


def block_amax(x, n, chunks, n_chunks, amax, n_blocks):
    """client/block_quant.h's BlockAmax over raw addresses: each block's largest |x| over the
    chunks, folded into the fp32 amax."""
    _check(_lib.rs_block_amax(x, int(n), chunks, int(n_chunks), amax, int(n_blocks)))


def encode_chunks(x, n, scales, n_scales, chunks, n_chunks, fp8, codes, n_codes):
    """client/block_quant.h's EncodeChunks over raw addresses: the codes (int8, or FP8 e4m3fn
    where fp8) of x / its block's scale, clamped, for the elements of the chunks."""
    _check(_lib.rs_encode_chunks(x, int(n), scales, int(n_scales), chunks, int(n_chunks),
                                 1 if fp8 else 0, codes, int(n_codes)))


def data_plane_peak(units, ranks, shared, prefetch, p_slots=-1, g_slots=-1, g_ring_nodes=1,
                    g_ring_slots=-1):
    """The data plane's peak bytes (engine/data_plane_memory.h), as the strategy model counts it:
    units as (shard_elems, |p|, parameter bytes per element[, gradient shard elements]); the
    node's blocks hold p_slots parameter and g_slots gradient shards (-1: one per rank); the
    gradients' reduce-scatter rings between g_ring_nodes nodes, chunks of g_ring_slots shards."""
    n = len(units)
    s = (ctypes.c_int64 * n)(*[u[0] for u in units])
    f = (ctypes.c_int64 * n)(*[u[1] for u in units])
    b = (ctypes.c_double * n)(*[u[2] for u in units])
    g = (ctypes.c_int64 * n)(*[u[3] if len(u) > 3 else -1 for u in units])
    out = (ctypes.c_double * 5)()
    _lib.rs_data_plane_peak(s, f, b, g, n, int(ranks), int(bool(shared)), int(prefetch),
                            int(p_slots), int(g_slots), int(g_ring_nodes), int(g_ring_slots),
                            out)
    d = dict(zip(("shards", "grad_shards", "unsharded", "grads", "scratch"), out))
    d["total"] = sum(out)
    return d
