"""Optimizers on the shards of a ShardedModule.

Each works on this rank's parameter shards (or their fp32 masters) with the gradient shards as
gradients, and keeps PyTorch's rule for parameters without a gradient: a parameter whose `.grad`
would be None (zero_grad(set_to_none=True) and no rank's backward reached it since, or frozen)
is not stepped at all: no moment update, no weight decay, no step count. The module decides
which parameters have a gradient with the same rule on every rank (`ShardedModule.has_grad`).
"""
import torch

from .views import as_tensor

__all__ = ["ShardedAdamW", "ShardedMuon", "OwnerOptimizer", "newton_schulz", "master_copies",
           "copy_masters", "matrix_units", "matrix_mask"]


class ShardedAdamW:
    """torch.optim.AdamW on this rank's shards: one tensor per piece of a parameter that lies in
    the shard (a view of the parameter shard, or of the fp32 master with param_dtype bf16 or
    quantized gathers), whose gradient is the same piece of the gradient shard. A piece is
    stepped only while its parameter has a gradient, with that parameter's own step count, as
    torch.optim.AdamW steps each parameter. Matrix parameters are left out with
    `skip_matrices` (ShardedMuon updates them)."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 skip_matrices=False):
        self.model = model
        self.pieces = []  # (parameter index, piece of the master, piece of the gradient shard)
        self.where = []  # (unit, lo, hi): each piece's elements of the optimizer range
        self.copies = master_copies(model)
        for ui in model.units() if model.steps else ():
            shard, grad = model.shard(ui)
            master = _master(model, ui, shard)
            for piece in model.pieces(ui):
                if skip_matrices and piece.matrix:
                    continue
                p = torch.nn.Parameter(master[piece.lo:piece.hi], requires_grad=False)
                self.pieces.append((piece.index, p, grad[piece.lo:piece.hi]))
                self.where.append((ui, piece.lo, piece.hi))
        # A rank whose shard holds no piece (a small model over many ranks) has nothing to step.
        self.opt = torch.optim.AdamW([p for _, p, _ in self.pieces], lr=lr, betas=betas,
                                     eps=eps, weight_decay=weight_decay) if self.pieces else None

    def step(self, gather=True):
        """Steps this rank's optimizer range, then (unless `gather` is False: the caller
        gathers once its own updates are in) AMSP's update gather."""
        self.model.wait_for_checkpoint_write()  # an asynchronous save may be reading the state
        has = self.model.has_grad
        for index, p, grad in self.pieces:
            p.grad = grad if has[index] else None
        if self.opt is not None:
            self.opt.step()
        copy_masters(self.copies)
        if gather:
            self.model.gather_updates()

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def _master(model, ui, shard):
    """What the optimizer steps for unit `ui`: the fp32 master of the optimizer range where the
    module keeps one, else the range of the shard itself."""
    master = model.master_of(ui)
    return shard if master is None else master


def master_copies(model):
    """(compute shard's optimizer range, its fp32 master) of every unit whose optimizer state
    is an fp32 master apart from the shard (bf16 parameters, quantized gathers); none on a
    rank that does not step (model.steps)."""
    copies = []
    for ui in model.units() if model.steps else ():
        shard, _ = model.shard(ui)
        master = _master(model, ui, shard)
        if master.data_ptr() != shard.data_ptr():
            copies.append((shard, master))
    return copies


def copy_masters(copies):
    """After a step: the compute shards take their masters' new values (rounded to bf16)."""
    for shard, master in copies:
        shard.copy_(master.to(shard.dtype))


def matrix_units(model, kind, name):
    """The units that hold whole-matrix tensors, after checking that every one of them is of
    `kind` ('matrix' for Muon, 'shampoo' for Shampoo) and that the parameters are fp32 without
    quantized gathers. `name`: the optimizer, for the errors."""
    if model.param_dtype != "fp32" or model.quantize:
        raise ValueError(f"{name}: needs param_dtype fp32 without quantized gathers")
    other = [mx.name for mx in model.matrices if mx.kind != kind]
    if other:
        raise ValueError(f"{name}: parameter '{other[0]}' was registered with another whole-matrix "
                         f"optimizer than '{kind}' (fully_shard's optimizer=)")
    return sorted({mx.unit for mx in model.matrices})


def matrix_mask(model, u, has):
    """This rank's optimizer-range elements of unit `u` in whole-matrix tensors that have a
    gradient."""
    mask = torch.zeros(model.os_elems[u], dtype=torch.bool)
    for piece in model.pieces(u):
        if piece.matrix and has[piece.index]:
            mask[piece.lo:piece.hi] = True
    return mask


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


class OwnerOptimizer:
    """What the whole-matrix optimizers (Muon, Shampoo) share: the matrices of one `kind`, AdamW
    (`adamw`: lr, betas, eps, weight decay) for the other parameters, a momentum buffer per
    unit shard (`momentum_kind`: its records in checkpoints), the round trip of a unit's
    matrices through their owners, and the step on the shards."""

    def __init__(self, model, kind, lr, momentum, weight_decay, adamw, momentum_kind):
        self.units = matrix_units(model, kind, type(self).__name__)
        self.model, self.lr, self.momentum, self.weight_decay = model, lr, momentum, weight_decay
        self.adamw = ShardedAdamW(model, *adamw, skip_matrices=True)
        self.buf = {u: torch.zeros(model.os_elems[u]) for u in self.units}
        self.momentum_kind = momentum_kind

    def step(self):
        m = self.model
        m.wait_for_checkpoint_write()  # an asynchronous save may be reading the state
        has = m.has_grad
        self.adamw.step(gather=False)
        for u in self.units:
            if not m.steps:
                # Another local rank steps this range in the same memory; the owner operations
                # are the node's, and every rank issues them.
                self.through_owners(u, has, None)
                continue
            shard, grad = m.shard(u)
            self.step_unit(u, has, shard, grad, matrix_mask(m, u, has))
        m.gather_updates()

    def step_unit(self, u, has, shard, grad, mask):
        """Steps unit `u`'s matrices; `mask`: this rank's shard elements of those with a
        gradient (`has`)."""
        raise NotImplementedError

    def through_owners(self, u, has, transform):
        """gather_to_owner of unit `u`'s gradient shards; on the owner (an os position), each of
        its matrices with a gradient becomes transform(matrix, its flat gradient);
        scatter_from_owner. The gather and scatter run on every rank, so the ranks issue the same
        operations (`transform` None: nothing to compute here)."""
        m = self.model
        m.client.gather_to_owner(u).wait()
        whole = m.client.owner_buffer(u) if transform is not None else None
        if whole is not None:
            whole = as_tensor(whole)
            for mx in m.matrices:
                if mx.unit == u and mx.owner == m.ospos and has[mx.index]:
                    piece = whole[mx.packed:mx.packed + mx.numel]
                    piece.copy_(transform(mx, piece).reshape(-1))
        m.client.scatter_from_owner(u).wait()

    def apply(self, shard, mask, update):
        """The step on this rank's matrix elements `mask` of a unit shard: decoupled weight
        decay, then -lr * update."""
        if self.weight_decay:
            shard[mask] = shard[mask] * (1 - self.lr * self.weight_decay)
        shard[mask] = shard[mask] - self.lr * update

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


class ShardedMuon(OwnerOptimizer):
    """Muon for the `optimizer: matrix` tensors with the planner's owners: momentum on the
    gradient shards, gather_to_owner, Newton-Schulz on the owner, scatter_from_owner, and the
    update applied to the parameter shards. Other parameters go through AdamW. A matrix without
    a gradient is skipped (its momentum kept), as the reference skips a grad of None."""

    def __init__(self, model, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=0.0,
                 ns_steps=5):
        super().__init__(model, "matrix", lr, momentum, weight_decay,
                         (adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay), "muon_momentum")
        self.nesterov, self.ns_steps = nesterov, ns_steps

    def _orthogonalized(self, mx, g):
        x = newton_schulz(g.view(mx.shape), self.ns_steps)
        return x * max(1.0, mx.shape[0] / mx.shape[1]) ** 0.5

    def step_unit(self, u, has, shard, grad, mask):
        buf = self.buf[u]
        buf[mask] = buf[mask] * self.momentum + grad[mask]
        grad[mask] = grad[mask] + self.momentum * buf[mask] if self.nesterov else buf[mask]
        self.through_owners(u, has, self._orthogonalized)
        self.apply(shard, mask, grad[mask])
