"""Muon on the shards of a ShardedModule: Newton-Schulz on each matrix's owner rank
(owner.py), AdamW on the other parameters."""
from .owner import OwnerOptimizer

__all__ = ["ShardedMuon", "newton_schulz"]


def newton_schulz(g, steps=5, eps=1e-7):
    """Muon's quintic Newton-Schulz orthogonalization, in fp32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + eps)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if transposed else x


class ShardedMuon(OwnerOptimizer):
    """Muon for the `optimizer: matrix` tensors with the planner's owners: momentum on the
    gradient shards, gather_to_owner, Newton-Schulz on the owner, scatter_from_owner, and the
    update applied to the parameter shards. Other parameters go through AdamW. A matrix without
    a gradient is skipped (its momentum kept), as the reference skips a grad of None. Group
    options: lr, momentum, nesterov, weight_decay, ns_steps and the adamw_ ones."""

    def __init__(self, model, params=None, lr=0.02, momentum=0.95, nesterov=True,
                 weight_decay=0.0, adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8,
                 adamw_weight_decay=0.0, ns_steps=5):
        super().__init__(model, "matrix", params, dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, adamw_lr=adamw_lr, adamw_betas=adamw_betas,
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay), "muon_momentum")

    recovers = True  # its momentum is the module's state tensors; its AdamW's too

    @staticmethod
    def _orthogonalized(mx, g, group):
        x = newton_schulz(g.view(mx.shape), group["ns_steps"])
        return x * max(1.0, mx.shape[0] / mx.shape[1]) ** 0.5

    def step_unit(self, u, has, shard, grad, pieces):
        buf = self.buf[u]
        for lo, hi, g in pieces:
            b, gr = buf[lo:hi], grad[lo:hi]
            b.copy_(b * g["momentum"] + gr)
            gr.copy_(gr + g["momentum"] * b if g["nesterov"] else b)
        self.through_owners(u, has, self._orthogonalized)
        for lo, hi, g in pieces:
            self.apply(shard[lo:hi], grad[lo:hi], g)
