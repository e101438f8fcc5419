"""One-process reference optimizers for train_tiny.py's --reference runs, written on whole
tensors and independently of ragshard's sharded ones (which work on pieces of shards), so that
a sharded run that equals its reference checks the sharded code.

Adam8bit: AdamW whose moments are stored block-quantized, one fp32 scale per block: 128 x 128
tiles of a matrix (numel / shape[-1] rows of shape[-1] columns; edge tiles partial) and runs of
256 elements of a vector. The first moment is stored as int8 round(127 m / max|m|), the second
as uint8 round(255 sqrt(v) / max sqrt(v)), the maxima taken over the block (a block of zeros
stores zeros with scale 0). Each step dequantizes, updates the moments in fp32, steps the
parameter with them (AdamW with decoupled weight decay and bias corrections, as torch.optim.AdamW
computes it), then quantizes them again.
"""
import math

import torch


def blocks(shape):
    """The blocks of a tensor of `shape` as (row slice, column slice) of its 2-D view
    (rows, cols): 128 x 128 tiles for a matrix, 256-element runs of the one row of a vector."""
    if len(shape) >= 2:
        cols = shape[-1]
        rows = math.prod(shape) // cols
        return [(slice(r, min(r + 128, rows)), slice(c, min(c + 128, cols)))
                for r in range(0, rows, 128) for c in range(0, cols, 128)]
    n = math.prod(shape)
    return [(slice(0, 1), slice(c, min(c + 256, n))) for c in range(0, n, 256)]


def as_2d(t):
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)


def quantize(x, levels, dtype):
    """Codes (x's shape) and one scale per block of x (>= 0 with levels 255)."""
    x2 = as_2d(x)
    q = torch.zeros_like(x2, dtype=dtype)
    scales = []
    for rs, cs in blocks(x.shape):
        block = x2[rs, cs]
        s = block.abs().max()
        if s > 0:
            q[rs, cs] = torch.round(block / s * levels).to(dtype)
        scales.append(s)
    return q.view(x.shape), torch.stack(scales) if scales else torch.zeros(0)


def dequantize(q, scales, levels):
    q2 = as_2d(q)
    out = torch.zeros(q2.shape)
    for (rs, cs), s in zip(blocks(q.shape), scales):
        out[rs, cs] = q2[rs, cs].float() * s / levels
    return out.view(q.shape)


class Adam8bit(torch.optim.Optimizer):
    """AdamW with block-quantized moments on whole tensors (see the module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = (group[k] for k in ("lr", "betas", "eps", "weight_decay"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"], st["m_scale"] = quantize(torch.zeros_like(p), 127, torch.int8)
                    st["v"], st["v_scale"] = quantize(torch.zeros_like(p), 255, torch.uint8)
                st["step"] += 1
                t, g = st["step"], p.grad
                m = dequantize(st["m"], st["m_scale"], 127) * b1 + (1 - b1) * g
                u = dequantize(st["v"], st["v_scale"], 255)
                v = u * u * b2 + (1 - b2) * g * g
                p.mul_(1 - lr * wd)
                p.sub_(lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps))
                st["m"], st["m_scale"] = quantize(m, 127, torch.int8)
                st["v"], st["v_scale"] = quantize(v.sqrt(), 255, torch.uint8)
