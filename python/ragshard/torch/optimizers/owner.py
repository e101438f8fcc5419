"""What the whole-matrix optimizers (Muon, muon.py; Shampoo, shampoo.py) share: param groups
whose matrices step by the subclass's rule on their owner ranks and whose other parameters step
by AdamW, a momentum buffer per unit shard, and the round trip of a unit's matrices through their
owners.

Each works on this rank's parameter shards (or their fp32 masters) with the gradient shards as
gradients, and keeps PyTorch's rule for parameters without a gradient: a parameter whose `.grad`
would be None (zero_grad(set_to_none=True) and no rank's backward reached it since, or frozen)
is not stepped at all: no moment update, no weight decay, no step count. The module decides
which parameters have a gradient with the same rule on every rank (`ShardedModule.has_grad`).
"""
import torch

from ..fsdp.views import as_tensor
from .groups import ModuleOptimizer
from .sharded import ShardedAdamW

__all__ = ["OwnerOptimizer", "matrix_units", "ADAMW_OPTIONS"]

# The options of the AdamW that a whole-matrix optimizer runs on the other parameters of each
# group, and the AdamW option each sets.
ADAMW_OPTIONS = {"adamw_lr": "lr", "adamw_betas": "betas", "adamw_eps": "eps",
                 "adamw_weight_decay": "weight_decay"}


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


class OwnerOptimizer(ModuleOptimizer):
    """What the whole-matrix optimizers (Muon, Shampoo) share: param groups over the module's
    parameters whose matrices of one `kind` step by the subclass's rule with the group's `lr`,
    `momentum` and `weight_decay`, and whose other parameters step by AdamW with the group's
    `adamw_lr`, `adamw_betas`, `adamw_eps` and `adamw_weight_decay`; a momentum buffer per unit
    shard in the module's state tensors (`momentum_kind`: its records in checkpoints); the
    round trip of a unit's matrices through their owners; and the step on the shards.

    A scheduler sets a group's `lr`; the group's AdamW parameters step with `adamw_lr` scaled
    by the same factor (lr / the group's lr when the optimizer was made), so that one schedule
    drives both, as it would drive one optimizer."""

    def __init__(self, model, kind, params, defaults, momentum_kind):
        self.units = matrix_units(model, kind, type(self).__name__)
        super().__init__(model, params, defaults)
        self.momentum_kind = momentum_kind
        self._matrix = {mx.index: mx for mx in model.matrices}
        self.buf = {u: model.optimizer_state(type(self).__name__, momentum_kind, u,
                                             model.os_elems[u]) for u in self.units}
        self._base_lr = [g["lr"] for g in self.param_groups]
        self.adamw = ShardedAdamW(model, [self._adamw_group(g) for g in self.param_groups],
                                  skip_matrices=True)

    def _adamw_group(self, g):
        out = {option: g[key] for key, option in ADAMW_OPTIONS.items()}
        out["params"] = [p for p in g["params"] if self.model.param_index(p) not in self._matrix]
        return out

    def _groups_changed(self):
        if hasattr(self, "adamw"):  # a group added after construction
            self._base_lr.append(self.param_groups[-1]["lr"])
            self.adamw.add_param_group(self._adamw_group(self.param_groups[-1]))

    def _step_all(self, m, **options):
        has = m.has_grad
        for g, base, ag in zip(self.param_groups, self._base_lr, self.adamw.param_groups):
            for key, option in ADAMW_OPTIONS.items():
                ag[option] = g[key]
            ag["lr"] = g["adamw_lr"] * (g["lr"] / base if base else 1.0)
        self.adamw.step(gather=False)
        # The owner round trip sends each matrix's update through the gradient shards: the
        # gradients come back after the step, as torch's .grad stays until zero_grad (a backward
        # before it adds to them).
        kept = {u: m.shard(u)[1].clone() for u in self.units} if m.steps else {}
        for u in self.units:
            if not m.steps:
                # Another local rank steps this range in the same memory; the owner operations
                # are the node's, and every rank issues them.
                self.through_owners(u, has, None)
                continue
            shard, grad = m.shard(u)
            pieces = []  # (lo, hi, group) of this unit's matrices with a gradient, in a group
            for pc in m.pieces(u):
                g = self.group_of(pc.index) if pc.matrix and has[pc.index] else None
                if g is not None:
                    pieces.append((pc.lo, pc.hi, g))
            self.step_unit(u, has, shard, grad, pieces)
        for u, grad in kept.items():
            m.shard(u)[1].copy_(grad)
        m.gather_updates()

    def step_unit(self, u, has, shard, grad, pieces):
        """Steps unit `u`'s matrices; `pieces`: (lo, hi, group) of this rank's elements of those
        with a gradient (`has`) and a group."""
        raise NotImplementedError

    def through_owners(self, u, has, transform):
        """gather_to_owner of unit `u`'s gradient shards; on the owner (an os position), each of
        its matrices with a gradient and a group becomes transform(matrix, its flat gradient,
        its group); scatter_from_owner. The gather and scatter run on every rank, so the ranks
        issue the same operations (`transform` None: nothing to compute here)."""
        m = self.model
        m.client.gather_to_owner(u).wait()
        whole = m.client.owner_buffer(u) if transform is not None else None
        if whole is not None:
            whole = as_tensor(whole)
            for mx in m.matrices:
                g = self.group_of(mx.index)
                if mx.unit == u and mx.owner == m.ospos and has[mx.index] and g is not None:
                    piece = whole[mx.packed:mx.packed + mx.numel]
                    piece.copy_(transform(mx, piece, g).reshape(-1))
        m.client.scatter_from_owner(u).wait()

    @staticmethod
    def apply(shard, update, g):
        """The step on a piece of a unit shard: decoupled weight decay, then -lr * update."""
        if g["weight_decay"]:
            shard.copy_(shard * (1 - g["lr"] * g["weight_decay"]))
        shard.copy_(shard - g["lr"] * update)

    def _momentum_pieces(self, index):
        """(momentum buffer, lo, hi, unit) of this rank's pieces of matrix `index`."""
        return [(self.buf[u], pc.lo, pc.hi, u) for u in self.units for pc in self.model.pieces(u)
                if pc.index == index] if self.model.steps else []

    def init_state(self):
        self.adamw.init_state()

    def dcp_state(self, index):
        """As ShardedOptimizer.dcp_state: a matrix's momentum, or the AdamW state of another
        parameter."""
        if index not in self._matrix:
            return self.adamw.dcp_state(index)
        pieces = [(self.model.piece_start(u, lo, index), b[lo:hi])
                  for b, lo, hi, u in self._momentum_pieces(index)]
        return ({"momentum_buffer": pieces} if pieces else {}), {}

    def dcp_set_scalars(self, index, scalars):
        if index not in self._matrix:
            self.adamw.dcp_set_scalars(index, scalars)

    def param_state(self, index):
        if index not in self._matrix:
            return self.adamw.param_state(index)
        pieces = self._momentum_pieces(index)
        if not pieces:
            return {}
        return {"momentum_buffer": torch.cat([b[lo:hi] for b, lo, hi, _ in pieces])}

    def set_param_state(self, index, state):
        if index not in self._matrix:
            return self.adamw.set_param_state(index, state)
        pieces = self._momentum_pieces(index)
        flat = state["momentum_buffer"].reshape(-1)
        if flat.numel() != sum(hi - lo for _, lo, hi, _ in pieces):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the momentum of "
                             f"'{self.model.unit_param_name(index)}' has {flat.numel()} "
                             "elements, not this rank's (load under the same plan)")
        at = 0
        for b, lo, hi, _ in pieces:
            b[lo:hi] = flat[at:at + hi - lo]
            at += hi - lo
