"""The tile/run quantizer (python/ragshard/quant.py, issue 52 item 1) gives the same bits as
the per-element one it replaced (tests/python/quant_reference.py, kept verbatim): block ids,
codes, scales and dequantized values, int8 and FP8, on every layout a shard can have."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build")),
                                "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ragshard import quant  # noqa: E402
import quant_reference as ref  # noqa: E402


def _unit(specs):
    """A plan unit of tensors end to end: specs are (shape, granule rows or None)."""
    tensors, off = [], 0
    for shape, rows in specs:
        numel = 1
        for d in shape:
            numel *= d
        g = rows * shape[1] if rows else 1
        tensors.append({"offset": off, "numel": numel, "shape": list(shape), "granule_elems": g})
        off += numel
    return {"tensors": tensors}, off


def _values(n, seed):
    """Mixed magnitudes, an all-zero stretch (scale 1), huge values, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]
    x[n // 7:n // 7 + 20000] = 0.0
    x[n // 3:n // 3 + 50] = -0.0
    x[n // 2] = 3e38
    return x


UNITS = {
    # 2-D row-granule pieces: columns a multiple of 128, not one, fewer than 128; a last band
    # of fewer than 128 rows
    "tiles": [((384, 256), 128), ((256, 200), 128), ((300, 96), 128), ((200, 130), 128)],
    # flat: 1-D runs of 16,384 and a tail, a 2-D tensor without a row granule, one tiny vector
    "flat": [((40000,), None), ((70, 300), None), ((5,), None)],
    # both, interleaved, as a transformer layer's unit (granule of 256 rows too)
    "mixed": [((256,), None), ((384, 256), 128), ((256,), None), ((512, 128), 256),
              ((1024,), None), ((130, 300), 128), ((33,), None)],
}


def _shard_sizes(total, unit):
    """Shard sizes: one rank with padding, ragged splits at granule boundaries and elsewhere
    (pieces that start or end mid-tile, mid-band and mid-row), many small shards."""
    sizes = {total + 1000, (total + 1) // 2, (total + 2) // 3 + 77, total // 5 + 1, 20000, 16384 + 3}
    for t in unit["tensors"]:  # a shard boundary exactly at each tensor, and one just past it
        if 0 < t["offset"] < total:
            sizes.add(t["offset"])
            sizes.add(t["offset"] + 129)
    return sorted(s for s in sizes if s > 0)


def _cases():
    for name, specs in UNITS.items():
        unit, total = _unit(specs)
        for s in _shard_sizes(total, unit):
            yield name, unit, total, s


CASES = list(_cases())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{c[0]}-S{c[3]}" for c in CASES])
def test_tiles_and_runs_give_the_reference_bits(case, kind):
    name, unit, total, s = CASES[case]
    world = (total + s - 1) // s
    got = [quant.shard_block_ids(unit, r, s) for r in range(world)]
    want = [ref.shard_block_ids(unit, r, s) for r in range(world)]
    for (gi, gn), (wi, wn) in zip(got, want):
        assert gn == wn and torch.equal(gi, wi)
        assert quant.layout_of(gi) is not None  # the fast path, not the fallback
    blocks = max(n for _, n in want)
    x = _values(world * s, case)
    codes, scales = [], []
    for r, (ids, _) in enumerate(got):
        xr = x[r * s:(r + 1) * s]
        c, sc = quant.quantize(xr, ids, blocks, kind)
        rc, rsc = ref.quantize(xr, want[r][0], blocks, kind)
        assert c.dtype == rc.dtype and torch.equal(c.view(torch.uint8), rc.view(torch.uint8))
        assert torch.equal(sc, rsc)
        assert torch.equal(quant.dequantize(c.view(torch.uint8), sc, ids, kind),
                           ref.dequantize(rc.view(torch.uint8), rsc, want[r][0], kind))
        codes.append(c.view(torch.uint8))
        scales.append(sc)
    # the gather's form: every rank's codes and scales end to end, ids offset by rank * blocks
    all_ids = torch.cat([torch.where(i >= 0, i + r * blocks, i) for r, (i, _) in enumerate(got)])
    assert quant.layout_of(all_ids) is not None
    ca, sa = torch.cat(codes), torch.cat(scales)
    v = quant.dequantize(ca, sa, all_ids, kind)
    w = ref.dequantize(ca, sa, all_ids, kind)
    assert torch.equal(v, w)
    assert torch.equal(v.view(torch.int32), w.view(torch.int32))  # signs of zeros too
    # into the unsharded buffer, as the gather does: every slot overwritten, padding included
    out = torch.full((ca.numel(),), float("nan"))
    assert quant.dequantize(ca, sa, all_ids, kind, out=out) is out
    assert torch.equal(out.view(torch.int32), w.view(torch.int32))
    assert quant.layout_of(all_ids)._packed is not None  # the client library's kernel ran


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_ids_it_does_not_know_take_the_generic_path(kind):
    torch.manual_seed(1)
    x = torch.randn(3 * 128 * 128 + 5)
    ids = torch.arange(x.numel()) // 1000
    ids[-5:] = -1
    assert quant.layout_of(ids) is None
    c, s = quant.quantize(x, ids, int(ids.max()) + 1, kind)
    rc, rs = ref.quantize(x, ids, int(ids.max()) + 1, kind)
    assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(quant.dequantize(c, s, ids, kind), ref.dequantize(rc, rs, ids, kind))
    out = torch.empty(x.numel())
    quant.dequantize(c, s, ids, kind, out=out)
    assert torch.equal(out, ref.dequantize(rc, rs, ids, kind))


def test_a_changed_ids_tensor_is_not_taken_for_its_old_layout():
    unit, total = _unit(UNITS["mixed"])
    ids, n = quant.shard_block_ids(unit, 0, total)
    assert quant.layout_of(ids) is not None
    ids[:10] = 0  # in place: the cached layout no longer describes it
    lay = quant.layout_of(ids)
    assert lay is None or torch.equal(lay.ids(), ids)
    x = torch.randn(total)
    c, s = quant.quantize(x, ids, n, "int8")
    rc, rs = ref.quantize(x, ids, n, "int8")
    assert torch.equal(c, rc) and torch.equal(s, rs)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_strided_inputs(kind):
    unit, total = _unit(UNITS["mixed"])
    ids, n = quant.shard_block_ids(unit, 0, total)
    x = _values(2 * total, 3).view(total, 2)[:, 1]  # every other element: not contiguous
    c, s = quant.quantize(x, ids, n, kind)
    rc, rs = ref.quantize(x, ids, n, kind)
    assert torch.equal(c.view(torch.uint8), rc.view(torch.uint8)) and torch.equal(s, rs)
    cs = torch.stack([c.view(torch.uint8), c.view(torch.uint8)], 1)[:, 0]
    assert torch.equal(quant.dequantize(cs, s, ids, kind), ref.dequantize(cs, s, ids, kind))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_native_encoder_rounds_as_torch_at_every_tie(kind):
    """The client library's encoder against torch's conversion (round to nearest even) on
    every code's value, every midpoint between neighbouring codes and one ulp either side, the
    clamp's edges and random values; scale 1, one run."""
    from ragshard import _core as core
    if kind == "fp8":
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[torch.isfinite(codes)].unique()
    else:
        codes = torch.arange(-128, 128, dtype=torch.float32)
    mids = (codes[1:] + codes[:-1]) / 2
    edges = torch.tensor([449.0, -449.0, 1e30, -1e30, 128.0, -128.0, 127.5, -127.5, 0.0, -0.0])
    x = torch.cat([codes, mids, torch.nextafter(mids, torch.full_like(mids, float("inf"))),
                   torch.nextafter(mids, torch.full_like(mids, float("-inf"))), edges,
                   torch.randn(100_003) * 100]).contiguous()
    n = x.numel()
    chunks = torch.tensor([[0, 1, 1, n, n, 0, 1]], dtype=torch.int64)
    scales = torch.ones(1)
    got = torch.empty(n, dtype=torch.uint8)
    core.encode_chunks(x.data_ptr(), n, scales.data_ptr(), 1, chunks.data_ptr(), 1,
                       kind == "fp8", got.data_ptr(), n)
    want = quant.encode(x.clone(), kind).view(torch.uint8)
    bad = torch.nonzero(got != want).flatten()[:5]
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad]
    amax = torch.zeros(1)
    core.block_amax(x.data_ptr(), n, chunks.data_ptr(), 1, amax.data_ptr(), 1)
    assert amax.item() == x.abs().max().item()


def test_the_native_kernels_refuse_chunks_that_do_not_fit():
    from ragshard import _core as core
    x = torch.zeros(100)
    chunks = torch.tensor([[60, 1, 1, 50, 50, 0, 1]], dtype=torch.int64)
    amax = torch.zeros(1)
    with pytest.raises(core.Error, match="block chunk 0 .* past the 100 elements"):
        core.block_amax(x.data_ptr(), 100, chunks.data_ptr(), 1, amax.data_ptr(), 1)
