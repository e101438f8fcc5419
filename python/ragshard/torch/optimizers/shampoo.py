"""Shampoo on the owners of a ShardedModule's `optimizer: shampoo` matrices.

Each matrix has one owner rank (the planner's, balanced by the preconditioner's cost). Each step
the gradient shards go to the owners (gather_to_owner), and an owner, for each of its matrices
with a gradient, seen as G (numel / shape[-1] rows of shape[-1] columns) and cut into blocks of
at most B x B (B: the plan's shampoo_block; 0: one block), updates each block's preconditioner
and computes its direction, in fp32:

    L += G_b G_b^T          R += G_b^T G_b                      (the statistics, from zero)
    every `precondition_every` steps from the first (steps 1, 1 + N, ...):
        P_L = (L + eps I)^(-1/4)    P_R = (R + eps I)^(-1/4)    (eigh in fp64, eigenvalues
                                                                 clamped at zero first)
    U_b = P_L G_b P_R,  scaled to G_b's Frobenius norm           (SGD grafting)

The directions go back to the gradient shards (scatter_from_owner) and every rank steps its own
pieces: m = momentum * m + U;  p = p * (1 - lr * wd) - lr * m. The momentum is sharded like the
parameters; the statistics and roots live only on the owners. Other parameters go through AdamW.
A matrix without a gradient is skipped (its statistics, roots, momentum and step count kept).
"""
import torch

from .owner import OwnerOptimizer

__all__ = ["ShardedShampoo", "inverse_root", "shampoo_blocks"]


def inverse_root(a, eps, p=4):
    """(a + eps I)^(-1/p) of a symmetric positive semi-definite matrix, through an fp64
    eigendecomposition; negative round-off eigenvalues count as zero."""
    lam, q = torch.linalg.eigh(a.double())
    lam = (lam.clamp(min=0) + eps) ** (-1.0 / p)
    return ((q * lam) @ q.T).to(a.dtype)


def shampoo_blocks(rows, cols, block):
    """(row slice, column slice) of each block of a rows x cols matrix: tiles of at most
    block x block, row by row (block 0: the whole matrix)."""
    br, bc = (block, block) if block > 0 else (rows, cols)
    return [(slice(r, min(r + br, rows)), slice(c, min(c + bc, cols)))
            for r in range(0, rows, br) for c in range(0, cols, bc)]


class _Preconditioner:
    """One owned matrix's state: its step count and, per block, the statistics L and R and
    their inverse fourth roots, as views of `flat` (its state in the module's state tensors,
    `_Preconditioner.numel(...)` elements) and `step` (a one-element float64 view). New (a step
    count of 0), it starts from zero statistics and identity roots."""

    def __init__(self, rows, cols, block, flat, step):
        self._step = step
        self.blocks = shampoo_blocks(rows, cols, block)
        self.left, self.right, self.left_root, self.right_root = [], [], [], []
        at = 0
        for rs, cs in self.blocks:
            r, c = rs.stop - rs.start, cs.stop - cs.start
            for out, n in ((self.left, r), (self.right, c), (self.left_root, r),
                           (self.right_root, c)):
                out.append(flat[at:at + n * n].view(n, n))
                at += n * n
        if self.step == 0:
            flat.zero_()
            for t in self.left_root + self.right_root:
                t.copy_(torch.eye(t.shape[0]))
        self.refreshed = []  # the steps whose roots this process computed

    @staticmethod
    def numel(rows, cols, block):
        """The elements of a rows x cols matrix's state."""
        return sum(2 * ((rs.stop - rs.start) ** 2 + (cs.stop - cs.start) ** 2)
                   for rs, cs in shampoo_blocks(rows, cols, block))

    @property
    def step(self):
        return int(self._step)

    @step.setter
    def step(self, n):
        self._step.fill_(n)

    def tensors(self):
        """Every state tensor, in a fixed order (for checkpoints)."""
        return [t for i in range(len(self.blocks)) for t in (
            self.left[i], self.right[i], self.left_root[i], self.right_root[i])]


class ShardedShampoo(OwnerOptimizer):
    """Shampoo for the `optimizer: shampoo` matrices (see the module docstring); AdamW for the
    rest. `precondition_every`: the inverse roots are recomputed every N steps of a matrix,
    from its first. Group options: lr, momentum, eps, precondition_every, weight_decay and the
    adamw_ ones. Its state is the module's state tensors (in a job that recovers lost ranks in
    place, the pool's): the momentum, and the owned matrices' statistics, roots and step
    counts."""

    recovers = True

    def __init__(self, model, params=None, lr=0.1, momentum=0.9, eps=1e-6,
                 precondition_every=10, weight_decay=0.0, adamw_lr=1e-3,
                 adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=0.0):
        super().__init__(model, "shampoo", params, dict(
            lr=lr, momentum=momentum, eps=eps, precondition_every=precondition_every,
            weight_decay=weight_decay, adamw_lr=adamw_lr, adamw_betas=adamw_betas,
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay), "shampoo_momentum")
        # This rank's matrices (it is their owner), by name. Their state lives in the module's
        # state tensors (the pool's where the job recovers in place): per unit, its owned
        # matrices' back to back, and a step count per matrix.
        self.owned = {mx.name: mx for mx in model.matrices
                      if mx.owner == model.ospos and model.steps}
        names = sorted(self.owned)
        tag = type(self).__name__
        self._steps = model.optimizer_state(tag, "matrix_step", -1, max(len(names), 1),
                                            torch.float64)
        sizes, self._at = {}, {}  # unit -> its state's elements; name -> (unit, offset, step)
        for i, name in enumerate(names):
            mx = self.owned[name]
            self._at[name] = (mx.unit, sizes.get(mx.unit, 0), i)
            sizes[mx.unit] = sizes.get(mx.unit, 0) + _Preconditioner.numel(*self._shape(mx))
        self._flat = {u: model.optimizer_state(tag, "preconditioner", u, n)
                      for u, n in sizes.items()}
        self.state = {}  # name -> _Preconditioner, of the matrices stepped (or loaded)
        for name in names:
            if self._steps[self._at[name][2]] > 0:  # (a rank that adopted its state)
                self.preconditioner(name)

    @staticmethod
    def _shape(mx):
        return mx.numel // mx.shape[-1], mx.shape[-1], mx.block

    def add_param_group(self, param_group):
        every = param_group.get("precondition_every", self.defaults["precondition_every"])
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"ShardedShampoo: precondition_every {every!r} must be an integer "
                             "of at least 1")
        super().add_param_group(param_group)

    def preconditioner(self, name):
        """The state of an owned matrix (made where it has none yet: zero statistics)."""
        st = self.state.get(name)
        if st is None:
            u, at, i = self._at[name]
            rows, cols, block = self._shape(self.owned[name])
            flat = self._flat[u][at:at + _Preconditioner.numel(rows, cols, block)]
            st = self.state[name] = _Preconditioner(rows, cols, block, flat,
                                                    self._steps[i:i + 1])
        return st

    def clear_state(self):
        """Every owned matrix back to no state (a load follows)."""
        self._steps.zero_()
        self.state.clear()

    def _direction(self, mx, g, group):
        """Updates matrix `mx`'s preconditioner with its gradient g and returns the grafted
        direction."""
        g = g.view(-1, mx.shape[-1])
        st = self.preconditioner(mx.name)
        st.step = st.step + 1
        refresh = (st.step - 1) % group["precondition_every"] == 0
        if refresh:
            st.refreshed.append(st.step)
        out = torch.empty_like(g)
        for i, (rs, cs) in enumerate(st.blocks):
            gb = g[rs, cs]
            st.left[i].add_(gb @ gb.T)
            st.right[i].add_(gb.T @ gb)
            if refresh:
                st.left_root[i].copy_(inverse_root(st.left[i], group["eps"]))
                st.right_root[i].copy_(inverse_root(st.right[i], group["eps"]))
            u = st.left_root[i] @ gb @ st.right_root[i]
            norm = u.norm()
            out[rs, cs] = u * (gb.norm() / norm) if norm > 0 else u
        return out

    def step_unit(self, u, has, shard, grad, pieces):
        self.through_owners(u, has, self._direction)
        buf = self.buf[u]
        for lo, hi, g in pieces:
            b = buf[lo:hi]
            b.copy_(b * g["momentum"] + grad[lo:hi])
            self.apply(shard[lo:hi], b, g)

    def param_state(self, index):
        out = super().param_state(index)
        mx = self._matrix.get(index)
        st = self.state.get(mx.name) if mx is not None else None
        if st is not None and out is not None:
            out = dict(out, step=st.step,
                       preconditioner=torch.cat([t.reshape(-1) for t in st.tensors()]))
        return out

    def set_param_state(self, index, state):
        state = dict(state)
        flat, step = state.pop("preconditioner", None), state.pop("step", None)
        super().set_param_state(index, state)
        mx = self._matrix.get(index)
        if flat is not None and mx is not None and mx.name in self.owned:
            st = self.preconditioner(mx.name)
            at = 0
            for t in st.tensors():
                t.copy_(flat[at:at + t.numel()].view(t.shape))
                at += t.numel()
            st.step = int(step)
