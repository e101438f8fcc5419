"""Block quantization for the quantized all-gather: int8, and FP8 e4m3 (`torch.float8_e4m3fn`),
with one fp32 scale per block.

Blocks, within one rank's shard (quantization is local to the shard): a piece of a 2-D tensor
whose granule is a multiple of 128 rows is cut into 128 x 128 tiles (the granule keeps them
whole); any other piece into runs of 16,384 consecutive elements.

The codes travel as bytes: `quantize` returns int8 or float8_e4m3fn tensors, and
`codes.view(torch.uint8)` is what goes into the byte unit of the gather.

Speed (issue 52): `shard_block_ids` also describes the shard's blocks as a `Layout` of whole
tiles and runs, computed once from the plan and kept with the ids it returns (and under a digest
of those ids, so that the concatenation of every rank's ids that the gather dequantizes with is
recognized once and cached). `quantize` and `dequantize` then reduce and scale by reshaped views
(128 x 128 tiles: a band of 128 rows x the columns, reduced over its rows, then per 128 columns;
runs: 16,384 elements per row), with no per-element block ids. Ids they do not recognize take
the generic per-element path; both give the same bits. On the CPU, `dequantize` runs the layout's
whole tiles and runs through the client library's kernel (client/block_quant.h): one pass,
each element written once (the gather's destination is a node's shared unsharded buffer); on
a GPU, Triton kernels over the same layout (ragshard.quant_gpu: one program per block, where
every block lies in one chunk); elsewhere, the same layout through torch ops; `quantize`
likewise (a pass for the blocks' amax, a pass for the codes, with torch's rounding: int8 to
nearest even, FP8 as c10::Float8_e4m3fn converts). Every path gives the same bits.
"""
import hashlib
import weakref

import torch

from . import _core as core
from . import quant_gpu


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


def _encode_(y, kind):
    """encode(y, kind), clamping and rounding y in place (y is a scratch tensor)."""
    y.clamp_(-QMAX[kind], QMAX[kind])
    if kind == "int8":
        return y.round_().to(torch.int8)
    return y.to(torch.float8_e4m3fn)


def decode(codes, kind):
    """fp32 values of codes, given as int8 / float8_e4m3fn tensors or as their bytes (uint8)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(CODE_DTYPE[kind])
    return codes.float()


_FP8_VALUES = {}  # device -> the 256 fp32 values of the e4m3fn bytes
_CODE_VALUES = {}  # kind -> the 256 fp32 values of its code bytes, on the CPU


def _code_values(kind):
    if kind not in _CODE_VALUES:
        every = torch.arange(256, dtype=torch.uint8)
        _CODE_VALUES[kind] = decode(every, kind).contiguous()
    return _CODE_VALUES[kind]


def _decode_fast(codes, kind):
    """decode(codes, kind) as a new flat tensor, the same bits: FP8 through a table of its 256
    values (torch's CPU conversion from float8 is several times slower than a lookup)."""
    if kind == "fp8" and codes.device.type == "cpu":
        key = str(codes.device)
        if key not in _FP8_VALUES:
            every = torch.arange(256, dtype=torch.uint8, device=codes.device)
            _FP8_VALUES[key] = decode(every, kind)
        return _FP8_VALUES[key].index_select(0, codes.view(torch.uint8).reshape(-1).int())
    v = decode(codes, kind).reshape(-1).contiguous()
    return v.clone() if v.data_ptr() == codes.data_ptr() else v


class Layout:
    """The blocks of a shard (or of several shards end to end) as whole tiles and runs.

    chunks: (pos, nb, h, cols, cw, b0, tiles, colmap): elements [pos, pos + nb*h*cols) viewed
    as nb bands of h rows x cols; block b0 + band*tiles + column//cw (colmap: column//cw as a
    tensor when tiles > 1). A run of 16,384 is a band of 1 row of 16,384 columns, one tile.
    generic: (pos, ids): elements [pos, pos + len(ids)) with explicit block ids (only the partial
    rows of a piece that starts or ends inside a row).
    pads: (a, b): element ranges of no block (coded 0)."""

    def __init__(self, n, chunks, generic, pads):
        self.n, self.chunks, self.generic, self.pads = n, chunks, generic, pads
        self._dev = {}
        self._packed = None  # the chunks as the native kernel's int64 array, once needed

    def _on(self, device):
        """(chunks, generic) with their index tensors on `device` (cached)."""
        key = str(device)
        if key not in self._dev:
            self._dev[key] = (
                [c[:7] + (None if c[7] is None else c[7].to(device),) for c in self.chunks],
                [(p, i.to(device)) for p, i in self.generic])
        return self._dev[key]

    def ids(self):
        """The per-element block ids (-1: padding) that this layout stands for."""
        ids = torch.full((self.n,), -1, dtype=torch.long)
        for pos, nb, h, cols, cw, b0, tiles, _ in self.chunks:
            band = torch.arange(nb).view(nb, 1, 1) * tiles
            col = (torch.arange(cols) // cw).view(1, 1, cols)
            ids[pos:pos + nb * h * cols] = (b0 + band + col).expand(nb, h, cols).reshape(-1)
        for pos, g in self.generic:
            ids[pos:pos + g.numel()] = g
        return ids

    def shifted(self, dpos, dblock):
        return ([(c[0] + dpos, *c[1:5], c[5] + dblock, *c[6:]) for c in self.chunks],
                [(p + dpos, g + dblock) for p, g in self.generic],
                [(a + dpos, b + dpos) for a, b in self.pads])

    @staticmethod
    def concat(parts):
        """The layout of shards end to end: parts is [(layout, block offset)]."""
        chunks, generic, pads, n = [], [], [], 0
        for lay, dblock in parts:
            c, g, p = lay.shifted(n, dblock)
            chunks += c
            generic += g
            pads += p
            n += lay.n
        return Layout(n, chunks, generic, _merge(pads))

    @staticmethod
    def _views(t, pos, nb, h, cols):
        return t[pos:pos + nb * h * cols].view(nb, h, cols)

    @staticmethod
    def _cols(scale, b0, nb, tiles, colmap, cols):
        """The scales of nb bands, per column, shaped to broadcast over (nb, h, cols)."""
        sc = scale[b0:b0 + nb * tiles].view(nb, tiles)
        if colmap is None:
            return sc.view(nb, 1, 1)
        return sc.index_select(1, colmap).view(nb, 1, cols)

    def _by_block(self, op, src, scales, dst, chunks, generic):
        """dst = op(src, the scale of each element's block) (torch.div to quantize, torch.mul
        to dequantize) over the chunks and the generic blocks, and 0 in the padding."""
        for pos, nb, h, cols, cw, b0, tiles, colmap in chunks:
            op(self._views(src, pos, nb, h, cols), self._cols(scales, b0, nb, tiles, colmap, cols),
               out=self._views(dst, pos, nb, h, cols))
        for pos, g in generic:
            op(src[pos:pos + g.numel()], scales[g], out=dst[pos:pos + g.numel()])
        for a, b in self.pads:
            dst[a:b] = 0.0

    def quantize(self, x, blocks, kind):
        native = self._quantize_native(x, blocks, kind)
        if native is not None:
            return native
        if x.dtype == torch.float32 and quant_gpu.usable(x) and quant_gpu.fused(self):
            return quant_gpu.quantize(self, x.contiguous().view(-1), blocks, kind, QMAX[kind],
                                      CODE_DTYPE[kind])
        chunks, generic = self._on(x.device)
        x = x.contiguous()
        xa = x.abs()
        amax = torch.zeros(max(blocks, 1), device=x.device)
        for pos, nb, h, cols, cw, b0, tiles, _ in chunks:
            m = self._views(xa, pos, nb, h, cols)
            m = m.amax(1) if h > 1 else m.view(nb, cols)
            tf, rem = cols // cw, cols % cw
            if tiles == 1:
                m = m.amax(1) if cols > 1 else m.view(nb)
            else:
                parts = [m[:, :tf * cw].reshape(nb, tf, cw).amax(2)]
                if rem:
                    parts.append(m[:, tf * cw:].amax(1, keepdim=True))
                m = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
            dst = amax[b0:b0 + nb * tiles]
            torch.maximum(dst, m.reshape(-1), out=dst)
        for pos, g in generic:
            amax.scatter_reduce_(0, g, xa[pos:pos + g.numel()], "amax")
        scale = amax / QMAX[kind]
        scale[scale == 0] = 1.0
        y = xa  # reused as the scratch tensor of the scaled values
        self._by_block(torch.div, x, scale, y, chunks, generic)
        return _encode_(y, kind), scale[:blocks]

    def _chunks_packed(self):
        """The chunks as the client library's kernels take them (7 int64 each), made once."""
        if self._packed is None:
            self._packed = torch.tensor([list(c[:7]) for c in self.chunks],
                                        dtype=torch.int64).reshape(-1, 7)
        return self._packed

    def _quantize_native(self, x, blocks, kind):
        """quantize through the client library's kernels (fp32 CPU tensors: one pass for the
        blocks' amax, one for the codes), or None where they do not apply."""
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        x = x.contiguous().view(-1)
        packed = self._chunks_packed()
        amax = torch.zeros(max(blocks, 1))
        core.block_amax(x.data_ptr(), x.numel(), packed.data_ptr(), packed.shape[0],
                        amax.data_ptr(), amax.numel())
        for pos, g in self.generic:
            amax.scatter_reduce_(0, g, x[pos:pos + g.numel()].abs(), "amax")
        scale = amax / QMAX[kind]
        scale[scale == 0] = 1.0
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        core.encode_chunks(x.data_ptr(), x.numel(), scale.data_ptr(), scale.numel(),
                           packed.data_ptr(), packed.shape[0], kind == "fp8", codes.data_ptr(),
                           codes.numel())
        for pos, g in self.generic:
            n = g.numel()
            codes[pos:pos + n] = encode(x[pos:pos + n] / scale[g], kind).view(torch.uint8)
        for a, b in self.pads:
            codes[a:b] = 0
        return codes.view(CODE_DTYPE[kind]), scale[:blocks]

    def _native(self, codes, scales, kind, out):
        """dequantize's chunks through the client library's kernel (CPU tensors), or False
        where it does not apply."""
        if codes.device.type != "cpu" or scales.device.type != "cpu" or \
                not codes.is_contiguous() or not scales.is_contiguous() or \
                scales.dtype != torch.float32 or (out is not None and not out.is_contiguous()):
            return False
        packed = self._chunks_packed()
        values = _code_values(kind)
        core.dequantize_chunks(codes.data_ptr(), codes.numel(), scales.data_ptr(),
                               scales.numel(), values.data_ptr(), packed.data_ptr(),
                               packed.shape[0], out.data_ptr(), out.numel())
        return True

    def dequantize(self, codes, scales, kind, out=None):
        """The values of codes, into `out` when given. `out` may be a buffer that other
        processes write the same values into at the same time (a node's shared unsharded
        buffer): each of its elements is written once, with its final value."""
        chunks, generic = self._on(codes.device)
        dst = out if out is not None else torch.empty(codes.numel(), device=codes.device)
        if quant_gpu.usable(codes) and quant_gpu.fused(self) and dst.is_contiguous() and \
                dst.dtype == torch.float32 and dst.device == codes.device and \
                scales.dtype == torch.float32 and scales.device == codes.device:
            return quant_gpu.dequantize(self, codes.reshape(-1).view(torch.uint8).contiguous(),
                                        scales, dst.view(-1), kind)
        if self._native(codes.reshape(-1), scales, kind, dst):
            for pos, g in generic:
                n = g.numel()
                torch.mul(_decode_fast(codes[pos:pos + n], kind), scales[g], out=dst[pos:pos + n])
            for a, b in self.pads:
                dst[a:b] = 0.0
            return dst
        v = _decode_fast(codes, kind)
        dst = v if out is None else dst
        self._by_block(torch.mul, v, scales, dst, chunks, generic)
        return dst


def _merge(ranges):
    out = []
    for a, b in sorted(ranges):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _piece_layout(t, off, numel, a, b, lo, n):
    """chunks and generic parts of the piece [a, b) of tensor t (first block n), as
    shard_block_ids numbers its blocks."""
    shape = [int(x) for x in t.get("shape", [])]
    granule = int(t.get("granule_elems", 1))
    chunks, generic = [], []
    if len(shape) == 2 and granule % (BLOCK * shape[1]) == 0 and granule > 0:
        cols = shape[1]
        tiles = (cols + BLOCK - 1) // BLOCK
        colmap = (torch.arange(cols) // BLOCK) if tiles > 1 else None
        ra, rb = a - off, b - off
        row0 = ra // cols

        def partial(e0, e1):  # elements [e0, e1) of the tensor, inside one row
            e = torch.arange(e0, e1)
            band = (e // cols - row0) // BLOCK
            generic.append((e0 + off - lo, n + band * tiles + (e % cols) // BLOCK))
        k0, head_end = 0, ra
        if ra % cols:  # a first row that starts inside the row
            head_end = min(rb, (row0 + 1) * cols)
            partial(ra, head_end)
            k0 = 1
        tail = max((rb // cols) * cols, head_end)
        if tail < rb:  # a last row that ends inside the row
            partial(tail, rb)
        k1 = max(rb // cols - row0, k0)  # rows [k0, k1) relative to row0 are whole

        def band_chunk(k, nb, h):  # nb bands of h rows from row k (relative to row0)
            if nb > 0 and h > 0:
                chunks.append(((row0 + k) * cols + off - lo, nb, h, cols, BLOCK,
                               n + (k // BLOCK) * tiles, tiles, colmap))
        k = k0
        if k % BLOCK and k < k1:
            h = min(k1, (k // BLOCK + 1) * BLOCK) - k
            band_chunk(k, 1, h)
            k += h
        nbf = (k1 - k) // BLOCK
        band_chunk(k, nbf, BLOCK)
        k += nbf * BLOCK
        band_chunk(k, 1, k1 - k)
    else:
        m = b - a
        full, rem = m // FLAT_BLOCK, m % FLAT_BLOCK
        if full:
            chunks.append((a - lo, full, 1, FLAT_BLOCK, FLAT_BLOCK, n, 1, None))
        if rem:
            chunks.append((a - lo + full * FLAT_BLOCK, 1, 1, rem, rem, n + full, 1, None))
    return chunks, generic


_BY_DIGEST = {}  # digest of ids less their smallest block id -> (layout, that id)
_BY_DIGEST_MAX = 1 << 16
_RESOLVED = {}  # id(ids) -> (weakref to ids, its version, layout or None)


def _digest(ids):
    ids = ids.detach().to("cpu", torch.long).contiguous()
    valid = ids >= 0
    m = int(ids[valid].min()) if bool(valid.any()) else 0
    norm = torch.where(valid, ids - m, ids)
    return hashlib.blake2b(norm.numpy().tobytes(), digest_size=16).digest(), m


def _register(ids, layout):
    try:
        ids._ragshard_layout = (layout, ids._version)
    except (AttributeError, RuntimeError):
        pass
    d, m = _digest(ids)
    if len(_BY_DIGEST) >= _BY_DIGEST_MAX:
        _BY_DIGEST.pop(next(iter(_BY_DIGEST)))
    _BY_DIGEST[d] = (layout, m)


def _find(ids):
    """The layout of ids: a shard's ids that shard_block_ids returned (or a copy of them), or
    several shards' ids end to end with their blocks offset (the gather's all_ids); None if
    they are neither."""
    d, m = _digest(ids)
    if d in _BY_DIGEST:
        lay, m0 = _BY_DIGEST[d]
        return lay if m == m0 else Layout.concat([(lay, m - m0)])
    n = ids.numel()
    for s in sorted({lay.n for lay, _ in _BY_DIGEST.values()}, reverse=True):
        if s <= 0 or s >= n or n % s:
            continue
        parts = []
        for r in range(n // s):
            dr, mr = _digest(ids[r * s:(r + 1) * s])
            hit = _BY_DIGEST.get(dr)
            if hit is None:
                break
            parts.append((hit[0], mr - hit[1]))
        else:
            return Layout.concat(parts)
    return None


def layout_of(ids):
    """The Layout that ids stand for (found once, then cached with the ids), or None."""
    got = getattr(ids, "_ragshard_layout", None)
    if got is not None and got[1] == ids._version:
        return got[0]
    hit = _RESOLVED.get(id(ids))
    if hit is not None and hit[0]() is ids and hit[1] == ids._version:
        return hit[2]
    lay = _find(ids)
    key = id(ids)
    try:
        ref = weakref.ref(ids, lambda _, k=key: _RESOLVED.pop(k, None))
    except TypeError:
        return lay
    _RESOLVED[key] = (ref, ids._version, lay)
    return lay


def shard_block_ids(unit, rank, shard_elems):
    """For each element of `rank`'s shard of `unit` (a plan unit as a dict), the index of its
    block within the shard, or -1 for padding; and the number of blocks. The ids carry the
    shard's Layout (see the module's doc), which quantize and dequantize use."""
    ids = torch.full((shard_elems,), -1, dtype=torch.long)
    lo, hi = rank * shard_elems, (rank + 1) * shard_elems
    n = 0
    chunks, generic, covered = [], [], []
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
        c, g = _piece_layout(t, off, numel, a, b, lo, n)
        chunks += c
        generic += g
        covered.append((a - lo, b - lo))
        n += int(local.max()) + 1
    pads, at = [], 0
    for a, b in sorted(covered):
        if a > at:
            pads.append((at, a))
        at = max(at, b)
    if at < shard_elems:
        pads.append((at, shard_elems))
    layout = Layout(shard_elems, chunks, generic, _merge(pads))
    if torch.equal(layout.ids(), ids):  # always, by construction; else the generic path
        _register(ids, layout)
    return ids, n


def quantize(x, ids, blocks, kind):
    """Codes (int8 or float8_e4m3fn, like x) and scales (fp32, `blocks`) of x by block ids
    (-1: padding, coded as 0)."""
    lay = layout_of(ids)
    if lay is not None and lay.n == x.numel():
        return lay.quantize(x, blocks, kind)
    ids = ids.to(x.device)
    valid = ids >= 0
    amax = torch.zeros(max(blocks, 1), device=x.device).scatter_reduce(0, ids[valid], x[valid].abs(), "amax")
    scale = amax / QMAX[kind]
    scale[scale == 0] = 1.0
    y = torch.where(valid, x / scale[ids.clamp_min(0)], torch.zeros_like(x))
    return encode(y, kind), scale[:blocks]


def dequantize(codes, scales, ids, kind, out=None):
    """fp32 values: decode(codes) * scales[ids], 0 where ids < 0; written into `out` (a
    contiguous fp32 tensor of codes.numel() elements) when given, and returned."""
    lay = layout_of(ids)
    if lay is not None and lay.n == codes.numel() and (out is None or out.is_contiguous()):
        v = lay.dequantize(codes, scales, kind, None if out is None else out.view(-1))
        return v if out is None else out
    ids = ids.to(codes.device)
    v = decode(codes, kind) * scales[ids.clamp_min(0)]
    v = torch.where(ids >= 0, v, torch.zeros_like(v))
    return v if out is None else out.copy_(v.view(out.shape))
