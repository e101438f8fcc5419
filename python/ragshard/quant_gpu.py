"""Block quantize and dequantize on a GPU (the quantized gathers' codes: docs/training.md,
"Block-quantized all-gather"): Triton kernels over a shard's Layout (ragshard.quant), one program
per block (a 128 x 128 tile or a run of 16,384 elements), each row's columns loaded and stored as
one vector where the sizes allow. Dequantize reads each code once and writes each value once;
quantize writes each code once and reads its block once where the autotuner finds a whole block per
step fastest (held in registers), else twice (its amax, then its codes: the second read mostly from
cache).

The numerics are the CPU path's (client/block_quant.cc), bit for bit: a block's scale is the
largest |x| of the block divided by QMAX (IEEE division; 1 where it is 0; NaN if any x is), the
code of x is x / scale (IEEE division) clamped to [-QMAX, QMAX] (NaN kept), then int8 by round to
nearest even (NaN: 0) or float8_e4m3fn by round to nearest even; a value is its code times its
block's scale. Where the division meets NaN or infinity, the GPU's NaN is not the CPU's (x86
returns a NaN operand, the first of two, and a negative NaN for inf / inf; the GPU a positive
canonical one), so the kernel writes the CPU's: a NaN x keeps its own (sign), a NaN block's
codes are +NaN, ±inf in a block whose scale is inf is -NaN. Only the NaN codes' sign is kept.

`fused(layout)` says whether a layout's blocks each lie in one chunk (no block split between
chunks or with the partial rows that the layout keeps as explicit ids): then one pass per block
finds its scale and writes its codes. Other layouts take quant.py's torch path.

CI has no GPU: tests/python/test_quant_gpu.py runs these kernels under Triton's interpreter
(TRITON_INTERPRET=1, on CPU tensors) against the CPU path; the GPU bundle's quant_bandwidth
check (scripts/gpu/checks.py) compares them on a GPU, and measures them.
"""
import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch path
    triton = None


def usable(t):
    """Whether quant.py sends tensor t here: a CUDA tensor, with Triton importable. (The tests
    call quantize and dequantize on CPU tensors under Triton's interpreter.)"""
    return triton is not None and t.is_cuda


_MAX_TILES = 65535  # a CUDA grid's second axis (a chunk's tiles per band)


def fused(layout):
    """Whether every block of `layout` lies in one of its chunks, and the kernels can launch
    over each chunk: at most 65,535 tiles across a band (the grid), offsets within a band (rows
    x columns) below 2^31 (cached on the layout)."""
    got = getattr(layout, "_fused", None)
    if got is None:
        spans = sorted((c[5], c[5] + c[1] * c[6]) for c in layout.chunks)
        got = not layout.generic and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and \
            all(c[2] * c[3] < 2**31 and c[6] <= _MAX_TILES for c in layout.chunks)
        layout._fused = got
    return got


def _top(layout):
    """One past the largest block id of the layout's chunks."""
    return max((c[5] + c[1] * c[6] for c in layout.chunks), default=0)


def _bench(fn, quantiles=None):
    """The autotuner's timing of one candidate: the median of 5 timings of 5 launches back to
    back (CUDA events, after one launch), per launch: the device's time, the host's launch cost
    overlapped; with no 256 MB cache-clearing buffer beside the daemon's slab, as Triton's
    do_bench would allocate."""
    fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 5)
    times.sort()
    return [times[2], times[0], times[4]] if quantiles else times[2]


def _shape(chunk):
    """(rows, columns) of a program's block for a chunk: powers of two that hold h x cw."""
    _, _, h, cols, cw, _, _, _ = chunk
    return triton.next_power_of_2(h), triton.next_power_of_2(min(cw, cols))


def _tuned(kernel):
    """kernel, tuned on its first launch per block shape and kind (Triton's autotune, each
    candidate timed on the real arguments, _bench): the warps of a program and the elements it
    takes per step (STEP; a STEP of the whole block reads it once). Tuning runs the kernel a few
    times over: the outputs are the same whichever runs, each written with its final value."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # the tests: a step they name
        return triton.heuristics(
            {"STEP": lambda _: int(os.environ.get("RAGSHARD_QUANT_STEP", "4096"))})(kernel)
    configs = [triton.Config({"STEP": s}, num_warps=w)
               for s, w in ((2048, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16),
                            (16384, 32))]
    return triton.autotune(configs, key=["BR", "BC", "INT8"], do_bench=_bench)(kernel)


def _split(kernel):
    """kernel with each step's rows (RS) and columns (CS) from STEP and the block's shape: a
    step is RS x CS of the block, CS <= BC, RS <= BR."""
    def cs(a):
        return min(a["BC"], a["STEP"])
    return triton.heuristics({"CS": cs,
                              "RS": lambda a: max(1, min(a["BR"], a["STEP"] // cs(a)))})(kernel)


if triton is not None:
    @triton.jit
    def _step(pos, h, cols, cw, r0, c0, RS: tl.constexpr, CS: tl.constexpr):
        """This program's block's start (an int64 element offset), and the int32 offsets from it
        and mask of its RS x CS elements at row r0, column c0 (offsets within a band < 2^31:
        fused). Each row's columns are contiguous, so loads and stores are vectorized where
        the sizes allow."""
        t = tl.program_id(1)
        base = pos + tl.program_id(0).to(tl.int64) * h * cols + t * cw
        r = r0 + tl.arange(0, RS)[:, None]
        c = c0 + tl.arange(0, CS)[None, :]
        mask = (r < h) & (c < cw) & (c < cols - t * cw)
        return base, r * cols + c, mask

    @triton.jit
    def _code(x, scale, nan, qmax, INT8: tl.constexpr):
        """The codes of x in a block of `scale` (nan: whether the block holds a NaN)."""
        # x / scale, with the CPU's NaNs (the module's doc)
        y = tl.where(nan > 0, tl.full([], 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True),
                     tl.div_rn(x, scale))
        y = tl.where(x != x, x, y)
        if scale == float("inf"):
            y = tl.where(tl.abs(x) == float("inf"),
                         tl.full([], 0xFFC00000, tl.uint32).to(tl.float32, bitcast=True), y)
        y = tl.where(y > qmax, qmax, tl.where(y < -qmax, -qmax, y))  # NaN kept
        if INT8:
            # round to nearest even as the CPU does it (|y| <= 127): adding and taking away
            # 1.5 * 2^23 leaves no fraction bits (Triton does not reassociate)
            r = (y + 12582912.0) - 12582912.0
            code = tl.where(y != y, 0.0, r).to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            code = _to_e4m3fn(y)
        return code

    @triton.jit
    def _scale(amax, nan, qmax):
        """A block's scale from its largest |x| and whether it holds a NaN."""
        scale = tl.div_rn(amax, qmax)
        scale = tl.where(scale == 0.0, 1.0, scale)
        # a NaN block's scale: the quiet NaN 0x7fc00000 (the CPU's, from a default NaN input)
        return tl.where(nan > 0, tl.full([], 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True),
                        scale)

    @triton.jit
    def _to_e4m3fn(f):
        """The float8_e4m3fn byte of f (|f| <= 448 or NaN), round to nearest even: the CPU's
        integer steps (client/block_quant.cc, ToE4m3fn), so that both give the same bytes
        whatever a conversion instruction or Triton's interpreter would do."""
        every = f.to(tl.uint32, bitcast=True)
        sign = every & 0x80000000
        bits = every ^ sign
        # below 2^-6: the sum's low bits are the subnormal code, rounded by the addition
        sub = ((bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True)
               - (141 << 23))
        normal = (bits - (120 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
        r = tl.where(bits < (121 << 23), sub, normal)
        r = tl.where(bits >= (1087 << 20), 0x7F, r)  # 448's successors and NaN
        return (r | (sign >> 24)).to(tl.uint8)

    @triton.jit
    def _from_e4m3fn(b):
        """The fp32 value of float8_e4m3fn bytes b (as int32), exactly, without a conversion
        instruction: normal, subnormal (m x 2^-9), NaN (0x7f, 0xff)."""
        e = (b >> 3) & 0xF
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        v = tl.where((e == 15) & (m == 7), float("nan"), v)
        # the sign as a bit (Triton negates as 0 - v, which makes -0 into +0)
        sign = (b & 0x80).to(tl.uint32) << 24
        return (v.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @_tuned
    @_split
    @triton.jit
    def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, pos, h, cols, cw, b0, tiles, qmax,
                         INT8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         STEP: tl.constexpr, RS: tl.constexpr, CS: tl.constexpr):
        # one block per program: read once when a step holds it all (registers), else in
        # steps (few registers: many programs per SM hide the memory's latency), its amax,
        # then its codes (the second read mostly from cache)
        if RS * CS >= BR * BC:
            base, off, mask = _step(pos, h, cols, cw, 0, 0, RS, CS)
            x = tl.load(x_ptr + base + off, mask=mask, other=0.0)
            nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
            scale = _scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), nan, qmax)
            tl.store(codes_ptr + base + off, _code(x, scale, nan, qmax, INT8), mask=mask)
        else:
            most = tl.zeros([RS, CS], dtype=tl.float32)
            nans = tl.zeros([RS, CS], dtype=tl.int32)
            for r0 in range(0, BR, RS):
                for c0 in range(0, BC, CS):
                    base, off, mask = _step(pos, h, cols, cw, r0, c0, RS, CS)
                    x = tl.load(x_ptr + base + off, mask=mask, other=0.0)
                    most = tl.maximum(most, tl.abs(x))
                    nans = nans | (x != x).to(tl.int32)
            nan = tl.max(tl.max(nans, axis=1), axis=0)
            scale = _scale(tl.max(tl.max(most, axis=1), axis=0), nan, qmax)
            for r0 in range(0, BR, RS):
                for c0 in range(0, BC, CS):
                    base, off, mask = _step(pos, h, cols, cw, r0, c0, RS, CS)
                    x = tl.load(x_ptr + base + off, mask=mask, other=0.0)
                    tl.store(codes_ptr + base + off, _code(x, scale, nan, qmax, INT8),
                             mask=mask)
        tl.store(scale_ptr + b0 + tl.program_id(0).to(tl.int64) * tiles + tl.program_id(1),
                 scale)

    @_tuned
    @_split
    @triton.jit
    def _dequantize_kernel(codes_ptr, scale_ptr, out_ptr, pos, h, cols, cw, b0, tiles,
                           INT8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                           STEP: tl.constexpr, RS: tl.constexpr, CS: tl.constexpr):
        scale = tl.load(scale_ptr + b0 + tl.program_id(0).to(tl.int64) * tiles +
                        tl.program_id(1))
        for r0 in range(0, BR, RS):
            for c0 in range(0, BC, CS):
                base, off, mask = _step(pos, h, cols, cw, r0, c0, RS, CS)
                byte = tl.load(codes_ptr + base + off, mask=mask, other=0)
                if INT8:
                    code = byte.to(tl.int8, bitcast=True).to(tl.float32)
                else:
                    code = _from_e4m3fn(byte.to(tl.int32))
                tl.store(out_ptr + base + off, code * scale, mask=mask)


def _on_device(t):
    """The launches' device context: t's GPU (a kernel runs on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def quantize(layout, x, blocks, kind, qmax, code_dtype):
    """(codes, scales) of x (flat, fp32, contiguous, layout.n elements) over a fused layout,
    with `blocks` scales."""
    if not fused(layout):
        raise ValueError("quant_gpu.quantize: the layout has blocks split between chunks")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != layout.n:
        raise ValueError(f"quant_gpu.quantize: x must be {layout.n} contiguous fp32 elements, "
                         f"not {x.numel()} of {x.dtype}")
    top = _top(layout)
    if top > max(blocks, 1):
        raise ValueError(f"quant_gpu.quantize: the layout's blocks go to {top}, past the "
                         f"{blocks} asked for")
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    covered = sum(c[1] * c[6] for c in layout.chunks)  # each block once (fused)
    scales = (torch.empty if covered == blocks == top and blocks else torch.ones)(
        max(blocks, 1), dtype=torch.float32, device=x.device)
    with _on_device(x):
        for c in layout.chunks:
            pos, nb, h, cols, cw, b0, tiles, _ = c
            br, bc = _shape(c)
            _quantize_kernel[(nb, tiles)](x, codes, scales, pos, h, cols, cw, b0, tiles,
                                          float(qmax), INT8=kind == "int8", BR=br, BC=bc)
    for a, b in layout.pads:
        codes[a:b] = 0
    return codes.view(code_dtype), scales[:blocks]


def dequantize(layout, codes, scales, out, kind):
    """out = the values of codes (flat bytes, layout.n of them) over a fused layout: `out` a
    contiguous fp32 tensor of layout.n elements on the codes' device, `scales` (fp32, there too)
    one per block."""
    if not fused(layout):
        raise ValueError("quant_gpu.dequantize: the layout has blocks split between chunks")
    if codes.dtype != torch.uint8 or not codes.is_contiguous() or codes.numel() != layout.n:
        raise ValueError(f"quant_gpu.dequantize: codes must be {layout.n} contiguous bytes, not "
                         f"{codes.numel()} of {codes.dtype}")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != layout.n or \
            out.device != codes.device:
        raise ValueError(f"quant_gpu.dequantize: out must be {layout.n} contiguous fp32 "
                         f"elements on {codes.device}, not {out.numel()} of {out.dtype} on "
                         f"{out.device}")
    if scales.dtype != torch.float32 or scales.device != codes.device or \
            scales.numel() < _top(layout):
        raise ValueError(f"quant_gpu.dequantize: {_top(layout)} fp32 scales on {codes.device} "
                         f"needed, not {scales.numel()} of {scales.dtype} on {scales.device}")
    scales = scales.contiguous()
    with _on_device(codes):
        for c in layout.chunks:
            pos, nb, h, cols, cw, b0, tiles, _ = c
            br, bc = _shape(c)
            _dequantize_kernel[(nb, tiles)](codes, scales, out, pos, h, cols, cw, b0, tiles,
                                            INT8=kind == "int8", BR=br, BC=bc)
    for a, b in layout.pads:
        out[a:b] = 0.0
    return out
