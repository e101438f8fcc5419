"""Shampoo against a direct formula on 2 x 2 blocks, where the inverse fourth root of a
symmetric positive definite matrix has a closed form: sqrt(A) = (A + s I) / sqrt(tr A + 2 s)
with s = sqrt(det A), applied twice, then the 2 x 2 inverse. Checked: the one-process reference
(examples/reference_optim.py, whole and blocked) and the sharded optimizer's root and
blocking (ragshard.torch.optimizers.shampoo), each on its own."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import reference_optim  # noqa: E402
from ragshard.torch.optimizers import shampoo  # noqa: E402

LR, MOMENTUM, EPS, WD = 0.5, 0.9, 1e-3, 0.1


def sqrt2(a):
    """The square root of a 2 x 2 symmetric positive definite matrix (lists of floats)."""
    (p, q), (_, r) = a
    s = math.sqrt(p * r - q * q)
    t = math.sqrt(p + r + 2 * s)
    return [[(p + s) / t, q / t], [q / t, (r + s) / t]]


def inv_fourth_root2(a):
    (p, q), (_, r) = sqrt2(sqrt2(a))
    det = p * r - q * q
    return [[r / det, -q / det], [-q / det, p / det]]


def mm(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(2)) for j in range(2)] for i in range(2)]


def t2(a):
    return [[a[0][0], a[1][0]], [a[0][1], a[1][1]]]


def add(a, b, scale=1.0):
    return [[a[i][j] + scale * b[i][j] for j in range(2)] for i in range(2)]


def norm(a):
    return math.sqrt(sum(x * x for row in a for x in row))


def direct(p0, grads, every, block_cols):
    """The parameter after the steps with gradients `grads`, one 2 x 2 tile after another
    along the columns (block_cols: 2 for the blocked variant, else all), by the formula."""
    rows, cols = len(p0), len(p0[0])
    tiles = [(c, c + block_cols) for c in range(0, cols, block_cols)]
    stats = {t: [[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]] for t in tiles}
    roots = {}
    p = [row[:] for row in p0]
    buf = [[0.0] * cols for _ in range(rows)]
    for step, g in enumerate(grads, start=1):
        for c0, c1 in tiles:
            gb = [row[c0:c1] for row in g]
            stats[(c0, c1)][0] = add(stats[(c0, c1)][0], mm(gb, t2(gb)))
            stats[(c0, c1)][1] = add(stats[(c0, c1)][1], mm(t2(gb), gb))
            if (step - 1) % every == 0:
                eye = [[EPS, 0.0], [0.0, EPS]]
                roots[(c0, c1)] = [inv_fourth_root2(add(s, eye)) for s in stats[(c0, c1)]]
            u = mm(mm(roots[(c0, c1)][0], gb), roots[(c0, c1)][1])
            scale = norm(gb) / norm(u)
            for i in range(rows):
                for j in range(c0, c1):
                    buf[i][j] = MOMENTUM * buf[i][j] + scale * u[i][j - c0]
        for i in range(rows):
            for j in range(cols):
                p[i][j] = p[i][j] * (1 - LR * WD) - LR * buf[i][j]
    return p


@pytest.mark.parametrize("cols,block", [(2, 0), (4, 2)], ids=["whole", "blocked"])
@pytest.mark.parametrize("every", [1, 2])
def test_reference_shampoo_follows_the_formula(cols, block, every):
    gen = torch.Generator().manual_seed(cols * 10 + every)
    p0 = torch.randn(2, cols, generator=gen, dtype=torch.float64)
    grads = [torch.randn(2, cols, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = reference_optim.Shampoo([p], lr=LR, momentum=MOMENTUM, eps=EPS, every=every,
                                  block=block, weight_decay=WD)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = direct(p0.tolist(), [g.tolist() for g in grads], every, block or cols)
    assert torch.allclose(p.detach(), torch.tensor(want, dtype=torch.float64), rtol=1e-9,
                          atol=1e-12), (p, want)
    # The roots are far from the identity (they precondition something).
    st = opt.state[p]
    assert st["refreshed"] == [1, 2, 3][::every]
    for tile in st["tiles"]:
        r = tile["root_L"]
        assert float((r - torch.trace(r) / 2 * torch.eye(2, dtype=r.dtype)).norm()) > 0.01 * \
            float(r.norm())


def test_sharded_inverse_root_follows_the_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    a = x @ x.T
    got = shampoo.inverse_root(a, EPS)
    want = inv_fourth_root2(add(a.tolist(), [[EPS, 0.0], [0.0, EPS]]))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9)
    # A rank-deficient matrix: the null direction gets eps^(-1/4).
    v = torch.tensor([[3.0], [4.0]], dtype=torch.float64)
    r = shampoo.inverse_root(v @ v.T, EPS)
    null = torch.tensor([4.0, -3.0], dtype=torch.float64) / 5
    assert torch.allclose(r @ null, null * EPS ** -0.25, rtol=1e-9)


def test_sharded_blocks_tile_the_matrix():
    got = shampoo.shampoo_blocks(5, 7, 3)
    want = [(slice(r, min(r + 3, 5)), slice(c, min(c + 3, 7))) for r in (0, 3)
            for c in (0, 3, 6)]
    assert got == want
    assert shampoo.shampoo_blocks(5, 7, 0) == [(slice(0, 5), slice(0, 7))]
