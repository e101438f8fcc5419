"""One-process reference optimizers for train_tiny.py's --reference runs, written on whole
tensors and independently of ragshard's sharded ones (which work on pieces of shards), so that
a sharded run that equals its reference checks the sharded code.

Muon: buf = 0.95 buf + G, then the matrix steps by -lr * sqrt(max(1, rows / cols)) times the
quintic Newton-Schulz orthogonalization (5 iterations of X <- a X + b (X X^T) X + c (X X^T)^2 X
with (a, b, c) = (3.4445, -4.7750, 2.0315), from X = N / (|N|_F + 1e-7) in the orientation with
no more rows than columns) of the Nesterov direction N = G + 0.95 buf.

Shampoo: for each matrix (rows = numel / shape[-1], cols = shape[-1]) cut into tiles of at most
block x block (block 0: one tile), each tile G keeps L = sum G G^T and R = sum G^T G; at steps
1, 1 + every, 1 + 2 every, ... of the matrix its roots become (L + eps I)^(-1/4) and
(R + eps I)^(-1/4) (through fp64 eigenvalues, clamped at zero); the tile's direction is
root_L G root_R rescaled to the Frobenius norm of G; then buf = momentum * buf + direction and
p = p * (1 - lr * wd) - lr * buf.

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


def fourth_root_inverse(m, eps):
    """(m + eps I)^(-1/4) for a symmetric positive semi-definite m, from its fp64 eigenvalues."""
    w, v = torch.linalg.eigh(m.to(torch.float64))
    d = torch.diag((torch.clamp(w, min=0.0) + eps) ** -0.25)
    return (v @ d @ v.T).to(m.dtype)


class Shampoo(torch.optim.Optimizer):
    """Blocked Shampoo with SGD grafting and momentum on whole tensors (see the module
    docstring). `stats(p)` gives a parameter's roots, for the tests."""

    def __init__(self, params, lr=0.1, momentum=0.9, eps=1e-6, every=10, block=0,
                 weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps, every=every,
                                      block=block, weight_decay=weight_decay))

    @staticmethod
    def tiles(rows, cols, block):
        tr = block if block else rows
        tc = block if block else cols
        out = []
        r = 0
        while r < rows:
            c = 0
            while c < cols:
                out.append((r, min(r + tr, rows), c, min(c + tc, cols)))
                c += tc
            r += tr
        return out

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g2 = p.grad.reshape(-1, p.shape[-1])
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["buf"] = torch.zeros_like(p)
                    st["tiles"] = []
                    for r0, r1, c0, c1 in self.tiles(g2.shape[0], g2.shape[1], group["block"]):
                        st["tiles"].append({"at": (r0, r1, c0, c1),
                                            "L": torch.zeros(r1 - r0, r1 - r0, dtype=p.dtype),
                                            "R": torch.zeros(c1 - c0, c1 - c0, dtype=p.dtype)})
                st["step"] += 1
                direction = torch.zeros_like(g2)
                for tile in st["tiles"]:
                    r0, r1, c0, c1 = tile["at"]
                    g = g2[r0:r1, c0:c1]
                    tile["L"] += g @ g.T
                    tile["R"] += g.T @ g
                    if (st["step"] - 1) % group["every"] == 0:
                        if not st.setdefault("refreshed", []) or st["refreshed"][-1] != st["step"]:
                            st["refreshed"].append(st["step"])
                        tile["root_L"] = fourth_root_inverse(tile["L"], group["eps"])
                        tile["root_R"] = fourth_root_inverse(tile["R"], group["eps"])
                    d = tile["root_L"] @ g @ tile["root_R"]
                    if float(d.norm()) > 0:
                        d = d * (g.norm() / d.norm())
                    direction[r0:r1, c0:c1] = d
                st["buf"].mul_(group["momentum"]).add_(direction.view(p.shape))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(group["lr"] * st["buf"])


def orthogonalize(g, steps=5):
    """Muon's quintic Newton-Schulz iteration on g (see the module docstring)."""
    wide = g.shape[0] <= g.shape[1]
    x = (g if wide else g.T) / (g.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x if wide else x.T


class Muon(torch.optim.Optimizer):
    """Muon on whole matrices (see the module docstring); a matrix without a gradient is not
    stepped (its momentum kept). `weight_decay`: decoupled, p = p * (1 - lr * wd) before the
    step."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(mu).add_(p.grad)
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(orthogonalize(p.grad + mu * buf) * scale, alpha=-group["lr"])
