"""The 8-bit Adam's block quantization against a direct, element-by-element formula on small
tensors with partial blocks: the one-process reference (examples/reference_optim.py) and the
sharded optimizer's block arithmetic (ragshard.torch.optimizers.adam8bit), each checked on its own."""
import math
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import reference_optim  # noqa: E402
from ragshard.torch.optimizers import adam8bit as optim8bit  # noqa: E402
from ragshard.torch.fsdp.pieces import Piece  # noqa: E402

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.1


def block_of(shape, i):
    """Element i's block: (row band, column band) of a matrix's 128x128 tiles, or its
    256-element run of a vector."""
    if len(shape) >= 2:
        return (i // shape[-1] // 128, i % shape[-1] // 128)
    return i // 256


def direct_quantize(x, levels):
    """Codes and per-element dequantized values, one element at a time."""
    flat = x.reshape(-1).tolist()
    peak = {}
    for i, a in enumerate(flat):
        b = block_of(tuple(x.shape), i)
        peak[b] = max(peak.get(b, 0.0), abs(a))
    codes, values = [], []
    for i, a in enumerate(flat):
        s = peak[block_of(tuple(x.shape), i)]
        q = round(a / s * levels) if s > 0 else 0  # halves: both round to even
        codes.append(q)
        values.append(q * s / levels)
    return codes, values


def direct_steps(p0, grads):
    """8-bit AdamW by the formula, in float64 apart from the stored codes."""
    p = p0.double().reshape(-1).tolist()
    m_hat = [0.0] * len(p)
    u_hat = [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        g = g.double().reshape(-1).tolist()
        m = [a * B1 + (1 - B1) * b for a, b in zip(m_hat, g)]
        v = [u * u * B2 + (1 - B2) * b * b for u, b in zip(u_hat, g)]
        p = [x * (1 - LR * WD) - LR / (1 - B1 ** t) * a / (math.sqrt(b) / math.sqrt(1 - B2 ** t)
                                                        + EPS) for x, a, b in zip(p, m, v)]
        shape = p0.shape
        _, m_hat = direct_quantize(torch.tensor(m).view(shape), 127)
        _, u_hat = direct_quantize(torch.tensor([math.sqrt(b) for b in v]).view(shape), 255)
    return torch.tensor(p, dtype=torch.float64).view(p0.shape)


SHAPES = [(130, 200), (300,), (3, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=["matrix", "vector", "small"])
def test_reference_adam8bit_follows_the_formula(shape):
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(shape, generator=gen)
    # Gradients of mixed magnitude, so that blocks have large and small elements.
    grads = [torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) ** 4
             for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = reference_optim.Adam8bit([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = direct_steps(p0, grads)
    assert torch.allclose(p.detach().double(), want, rtol=1e-5, atol=1e-6)
    # The stored codes are the formula's.
    st = opt.state[p]
    assert st["m"].dtype == torch.int8 and st["v"].dtype == torch.uint8
    blocks = len(reference_optim.blocks(shape))
    assert st["m_scale"].numel() == blocks == st["v_scale"].numel()


def piece(shape, start, count):
    return Piece("w", shape, 0, 0, 0, count, start, len(shape) == 2)


@pytest.mark.parametrize("shape,start,count", [
    ((300, 200), 128 * 200, 172 * 200),  # rows 128..300 of a matrix: one full band, one partial
    ((300, 200), 0, 300 * 200),
    ((600,), 256, 344),  # elements 256..600 of a vector
])
def test_sharded_blocks_quantize_like_the_formula(shape, start, count):
    """The sharded optimizer's blocks of a piece are the tensor's blocks: quantizing the piece
    gives the formula's codes for those elements."""
    gen = torch.Generator().manual_seed(2)
    whole = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) ** 3
    blocks = optim8bit._blocks_of(piece(shape, start, count))
    x = whole.reshape(-1)[start:start + count]
    q, s = optim8bit._quantize(x, blocks, 127, torch.int8)
    codes, values = direct_quantize(whole, 127)
    assert q.tolist() == codes[start:start + count]
    assert torch.allclose(optim8bit._dequantize(q, s, blocks, 127),
                          torch.tensor(values[start:start + count]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape,start,count,what", [
    ((300, 200), 64 * 200, 236 * 200, "cut at rows 64..300"),
    ((300, 200), 0, 200 * 200, "cut at rows 0..200"),
    ((600,), 100, 500, "cut at elements 100..600"),
])
def test_sharded_adam8bit_refuses_a_cut_block(shape, start, count, what):
    with pytest.raises(ValueError, match=re.escape(f"parameter 'w' {list(shape)} is {what}")):
        optim8bit._blocks_of(piece(shape, start, count))
