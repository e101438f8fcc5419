"""The GPU's block quantize and dequantize (python/ragshard/quant_gpu.py, Triton kernels) give the
CPU path's bits: codes, scales and values, int8 and FP8, on every layout they take (blocks whole
in one chunk), with zeros, huge values, negative zeros and NaN. CI has no GPU, so the kernels run
under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before Triton is imported);
on a GPU machine, RAGSHARD_QUANT_TEST_DEVICE=cuda runs them on the GPU (docs/gpu.md)."""
import os
import sys

DEVICE = os.environ.get("RAGSHARD_QUANT_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_quant_fast as fast  # noqa: E402  (its units, shard sizes and values)
from ragshard import quant, quant_gpu  # noqa: E402

# (numpy's warnings from the interpreter's arithmetic on the NaN and infinite inputs)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

if quant_gpu.triton is None:
    pytest.skip("Triton is not importable (torch's CUDA build brings it)", allow_module_level=True)
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.fail(f"RAGSHARD_QUANT_TEST_DEVICE={DEVICE} but torch sees no GPU", pytrace=False)


def _fused_cases():
    """fast's cases whose shards' layouts the kernels take (every block in one chunk)."""
    out = []
    for name, unit, total, s in fast.CASES:
        world = (total + s - 1) // s
        lays = [quant.layout_of(quant.shard_block_ids(unit, r, s)[0]) for r in range(world)]
        if all(quant_gpu.fused(lay) for lay in lays):
            out.append((name, unit, total, s))
    return out


CASES = _fused_cases()


def test_the_kernels_take_tiles_runs_and_mixed_units():
    assert {c[0] for c in CASES} == {"tiles", "flat", "mixed"}
    assert len(CASES) >= 12


def test_a_block_split_by_a_partial_row_is_not_fused():
    # a shard that starts inside a row of a row-granule tensor: that row's elements are explicit
    # ids, sharing their band's blocks with a chunk
    unit, _ = fast._unit([((384, 256), 128)])
    lay = quant.layout_of(quant.shard_block_ids(unit, 1, 256 * 100 + 7)[0])
    assert lay.generic and not quant_gpu.fused(lay)


def _band(rows, cols, width):
    """A layout of one band of rows x cols in blocks `width` columns wide."""
    tiles = -(-cols // width)
    return quant.Layout(rows * cols, [(0, 1, rows, cols, width, 0, tiles, None)], [], [])


def test_chunks_the_kernels_cannot_launch_over_are_not_fused():
    # at most 65,535 tiles across a band (a CUDA grid's second axis)
    assert quant_gpu.fused(_band(128, 65535 * 128, 128))
    assert not quant_gpu.fused(_band(128, 65536 * 128, 128))
    # offsets within a band below 2^31
    assert quant_gpu.fused(_band(1, (1 << 31) - 1, 1 << 31))
    assert not quant_gpu.fused(_band(2, 1 << 30, 1 << 31))


def test_bad_arguments_are_refused_by_name():
    unit, total = fast._unit([((256, 256), 128)])
    ids, blocks = quant.shard_block_ids(unit, 0, total)
    lay = quant.layout_of(ids)
    x = torch.zeros(total)
    with pytest.raises(ValueError, match="past the 3 asked for"):
        quant_gpu.quantize(lay, x, 3, "int8", 127.0, torch.int8)
    with pytest.raises(ValueError, match="contiguous fp32"):
        quant_gpu.quantize(lay, x.double(), blocks, "int8", 127.0, torch.int8)
    codes = torch.zeros(total, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out must be"):
        quant_gpu.dequantize(lay, codes, torch.ones(blocks), torch.zeros(total - 1), "int8")
    with pytest.raises(ValueError, match="scales on"):
        quant_gpu.dequantize(lay, codes, torch.ones(blocks - 1), torch.zeros(total), "int8")


# the elements a program takes per step under the interpreter (on a GPU the autotuner picks): a
# 128 x 128 tile in steps of 32 rows, a run in steps of 4,096; and each block read once, whole
STEPS = ["4096", "16384"] if DEVICE == "cpu" else ["tuned"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-S{c[3]}" for c in CASES])
def test_the_kernels_give_the_cpu_paths_bits(case, kind, step, monkeypatch):
    if step != "tuned":
        monkeypatch.setenv("RAGSHARD_QUANT_STEP", step)
    name, unit, total, s = CASES[case]
    world = (total + s - 1) // s
    x = fast._values(world * s, case)
    x[7] = float("nan")  # one block's scale and codes NaN (int8: codes 0), a zero's too
    x[8] = 0.0
    x.view(torch.int32)[9] = -4194304  # 0xffc00000: a negative NaN keeps its sign (FP8 0xff)
    for r in range(world):  # an infinity in each shard's middle block: inf / inf
        x[r * s + s // 2] = float("inf")
        x[r * s + s // 2 + 1] = -float("inf")
    for r in range(world):
        ids, blocks = quant.shard_block_ids(unit, r, s)
        lay = quant.layout_of(ids)
        xr = x[r * s:(r + 1) * s].contiguous()
        want_c, want_s = quant.quantize(xr, ids, blocks, kind)  # the client library's kernel
        got_c, got_s = quant_gpu.quantize(lay, xr.to(DEVICE), blocks, kind, quant.QMAX[kind],
                                          quant.CODE_DTYPE[kind])
        got_c, got_s = got_c.cpu(), got_s.cpu()
        assert got_c.dtype == want_c.dtype
        assert torch.equal(got_c.view(torch.uint8), want_c.view(torch.uint8))
        assert torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))
        want_v = quant.dequantize(want_c.view(torch.uint8), want_s, ids, kind)
        out = torch.full((s,), 5.0, device=DEVICE)  # every element overwritten, padding with 0
        assert quant_gpu.dequantize(lay, got_c.view(torch.uint8).to(DEVICE), got_s.to(DEVICE),
                                    out, kind) is out
        _same_bits(out.cpu(), want_v)


def _same_bits(got, want):
    """Equal bit for bit (the signs of zeros too), NaN where NaN (a GPU's arithmetic writes its
    own NaN's bits: no data is in them)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
