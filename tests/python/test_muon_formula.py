"""The reference Muon (examples/reference_optim.py) against a direct formula through the SVD:
each Newton-Schulz iteration X <- a X + b (X X^T) X + c (X X^T)^2 X maps X = U diag(s) V^T to
U diag(a s + b s^3 + c s^5) V^T, so 5 of them from G / (|G|_F + 1e-7) give U diag(f^5(s)) V^T
with s the singular values of G over |G|_F + 1e-7."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import reference_optim  # noqa: E402

A, B, C = 3.4445, -4.7750, 2.0315


def direct_orthogonalize(g):
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / (g.norm() + 1e-7)
    for _ in range(5):
        s = A * s + B * s ** 3 + C * s ** 5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
def test_reference_muon_follows_the_formula(shape):
    gen = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    p0 = torch.randn(*shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = reference_optim.Muon([p], lr=0.05)
    want, buf = p0.clone(), torch.zeros_like(p0)
    scale = max(1.0, shape[0] / shape[1]) ** 0.5
    for i, g in enumerate(grads):
        p.grad = None if i == 1 else g.clone()  # no gradient: not stepped, momentum kept
        opt.step()
        if i != 1:
            buf = 0.95 * buf + g
            want = want - 0.05 * scale * direct_orthogonalize(g + 0.95 * buf)
    assert torch.allclose(p.detach(), want, rtol=1e-9, atol=1e-12)
    # The orthogonalized direction has its singular values near 1 (Muon's point).
    s = torch.linalg.svdvals(reference_optim.orthogonalize(grads[0]))
    assert float(s.min()) > 0.6 and float(s.max()) < 1.3, s
