"""Block quantization of the quantized all-gather: e4m3 codes, int8 and FP8 round trips within
their precision, and the 128 x 128 blocks of a shard."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build")),
                                "python"))

from ragshard import quant  # noqa: E402


def test_fp8_codes_are_e4m3fn_and_their_bytes_are_the_format():
    y = torch.tensor([448.0, 1.0, -1.0, 2.0 ** -9, 0.0, 1.07, 460.0, -1e6])
    codes = quant.encode(y, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    # S EEEE MMM, bias 7: 448 is the largest finite value, 2^-9 the smallest subnormal.
    assert codes.view(torch.uint8).tolist()[:5] == [0x7E, 0x38, 0xB8, 0x01, 0x00]
    back = quant.decode(codes.view(torch.uint8), "fp8")  # from the bytes that travel
    assert float(back[5]) == 1.125  # the nearest of 1.0 and 1.125
    assert back[6:].tolist() == [448.0, -448.0]  # clamped, never NaN
    i8 = quant.encode(torch.tensor([126.6, -300.0]), "int8")
    assert i8.dtype == torch.int8 and i8.tolist() == [127, -127]


def test_blocks_of_a_banded_shard_are_128x128_tiles():
    unit = {"tensors": [
        {"offset": 0, "numel": 256 * 200, "shape": [256, 200], "granule_elems": 128 * 200},
        {"offset": 256 * 200, "numel": 40, "shape": [40], "granule_elems": 1}]}
    s = 256 * 200 + 40 + 24  # one rank holds everything, with padding
    ids, n = quant.shard_block_ids(unit, 0, s)
    assert n == 2 * 2 + 1  # 2 bands x 2 column tiles, and the vector
    assert int(ids[0]) == 0 and int(ids[127]) == 0 and int(ids[128]) == 1  # columns 0-127, 128+
    assert int(ids[200 * 128]) == 2  # the second band
    assert int(ids[256 * 200]) == 4 and int(ids[-1]) == -1  # the vector, then padding


def test_round_trips_are_within_the_formats_precision():
    torch.manual_seed(0)
    x = torch.randn(128 * 128 * 3) * torch.linspace(0.01, 10, 128 * 128 * 3)
    ids = torch.arange(x.numel()) // (128 * 128)
    for kind, tol in (("int8", 0.5 / 127), ("fp8", 2.0 ** -4)):
        codes, scales = quant.quantize(x, ids, 3, kind)
        y = quant.dequantize(codes, scales, ids, kind)
        amax = torch.stack([x[ids == b].abs().max() for b in range(3)])
        err = (y - x).abs() / amax[ids]
        # int8: half a step of amax/127; e4m3: relative error 2^-4 of the value, bounded by amax
        assert float(err.max()) <= tol + 1e-6, kind
