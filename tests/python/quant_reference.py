"""Today's quantizer (python/ragshard/quant.py before the tile/run rewrite of issue 52, item 1), kept
verbatim as the reference that tests/python/test_quant_fast.py checks the fast one against."""
import torch


BLOCK = 128
FLAT_BLOCK = BLOCK * BLOCK
CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": torch.finfo(torch.float8_e4m3fn).max}  # 448


def encode(y, kind):
    """Codes of y (already divided by its block's scale, |y| <= QMAX): int8 rounded to nearest,
    or float8_e4m3fn (torch's conversion rounds to nearest even). Values are clamped to the
    format's range first: the conversion to e4m3fn does not saturate (out of range is NaN)."""
    y = y.clamp(-QMAX[kind], QMAX[kind])
    if kind == "int8":
        return y.round().to(torch.int8)
    return y.to(torch.float8_e4m3fn)


def decode(codes, kind):
    """fp32 values of codes, given as int8 / float8_e4m3fn tensors or as their bytes (uint8)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(CODE_DTYPE[kind])
    return codes.float()


def shard_block_ids(unit, rank, shard_elems):
    """For each element of `rank`'s shard of `unit` (a plan unit as a dict), the index of its
    block within the shard, or -1 for padding; and the number of blocks."""
    ids = torch.full((shard_elems,), -1, dtype=torch.long)
    lo, hi = rank * shard_elems, (rank + 1) * shard_elems
    n = 0
    for t in unit["tensors"]:
        off, numel = int(t["offset"]), int(t["numel"])
        a, b = max(off, lo), min(off + numel, hi)
        if a >= b:
            continue
        shape = [int(x) for x in t.get("shape", [])]
        granule = int(t.get("granule_elems", 1))
        e = torch.arange(a, b) - off
        if len(shape) == 2 and granule % (BLOCK * shape[1]) == 0 and granule > 0:
            cols = shape[1]
            row0 = (a - off) // cols
            band = (e // cols - row0) // BLOCK
            tiles = (cols + BLOCK - 1) // BLOCK
            local = band * tiles + (e % cols) // BLOCK
        else:
            local = (e - (a - off)) // FLAT_BLOCK
        ids[a - lo:b - lo] = n + local
        n += int(local.max()) + 1
    return ids, n


def quantize(x, ids, blocks, kind):
    """Codes (int8 or float8_e4m3fn, like x) and scales (fp32, `blocks`) of x by block ids
    (-1: padding, coded as 0)."""
    ids = ids.to(x.device)
    valid = ids >= 0
    amax = torch.zeros(max(blocks, 1), device=x.device).scatter_reduce(0, ids[valid], x[valid].abs(), "amax")
    scale = amax / QMAX[kind]
    scale[scale == 0] = 1.0
    y = torch.where(valid, x / scale[ids.clamp_min(0)], torch.zeros_like(x))
    return encode(y, kind), scale[:blocks]


def dequantize(codes, scales, ids, kind):
    """fp32 values: decode(codes) * scales[ids], 0 where ids < 0."""
    ids = ids.to(codes.device)
    v = decode(codes, kind) * scales[ids.clamp_min(0)]
    return torch.where(ids >= 0, v, torch.zeros_like(v))
