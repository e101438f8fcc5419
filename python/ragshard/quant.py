"""Block quantization for the quantized all-gather: int8, and FP8 e4m3 emulated on the CPU
(torch 1.13 has no float8 type: codes are the e4m3 bit patterns in uint8), with one fp32 scale
per block.

Blocks, within one rank's shard (quantization is local to the shard): a piece of a 2-D tensor
whose granule is a multiple of 128 rows is cut into 128 x 128 tiles (the granule keeps them
whole); any other piece into runs of 16,384 consecutive elements.
"""
import warnings

import torch


BLOCK = 128
FLAT_BLOCK = BLOCK * BLOCK
QMAX = {"int8": 127.0, "fp8": 448.0}


def _e4m3_table():
    """The value of every e4m3fn code (S EEEE MMM, bias 7, no infinities; 0x7f/0xff NaN)."""
    vals = torch.empty(256)
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            v = float("nan")
        elif e == 0:
            v = m / 8.0 * 2.0 ** -6
        else:
            v = (1 + m / 8.0) * 2.0 ** (e - 7)
        vals[code] = -v if s else v
    return vals


E4M3 = _e4m3_table()
_POS = E4M3[:127]                        # codes 0..126: the non-negative finite values, ascending
_MID = (_POS[1:] + _POS[:-1]) / 2        # rounding boundaries


def encode(y, kind):
    """Codes (uint8) of y (already divided by its block's scale, |y| <= QMAX)."""
    if kind == "int8":
        return y.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    code = torch.searchsorted(_MID, y.abs().contiguous()).to(torch.uint8)
    return torch.where(y < 0, code | 0x80, code)


def decode(codes, kind):
    """fp32 values of uint8 codes."""
    if kind == "int8":
        return codes.view(torch.int8).float()
    return E4M3[codes.long()]


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
    """Codes (uint8, like x) and scales (fp32, `blocks`) of x by block ids (-1: padding)."""
    valid = ids >= 0
    with warnings.catch_warnings():  # torch 1.13 calls scatter_reduce beta
        warnings.simplefilter("ignore", UserWarning)
        amax = torch.zeros(max(blocks, 1)).scatter_reduce(0, ids[valid], x[valid].abs(), "amax")
    scale = amax / QMAX[kind]
    scale[scale == 0] = 1.0
    y = torch.where(valid, x / scale[ids.clamp_min(0)], torch.zeros_like(x))
    return encode(y, kind), scale[:blocks]


def dequantize(codes, scales, ids, kind):
    """fp32 values: decode(codes) * scales[ids], 0 where ids < 0."""
    v = decode(codes, kind) * scales[ids.clamp_min(0)]
    return torch.where(ids >= 0, v, torch.zeros_like(v))
