"""Any elementwise torch optimizer on the shards of a ShardedModule.

    opt = ShardedOptimizer(model, torch.optim.AdamW, [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_cosine)

The optimizer is a torch.optim.Optimizer whose param groups hold the module's own parameters
(ragshard.torch.optimizers.groups). Underneath, CLS itself runs on this rank's pieces: one tensor
per piece of a parameter in this rank's optimizer range (a view of the parameter shard, or of the fp32
master with bf16 parameters or quantized gathers), whose gradient is the same piece of the
gradient shard, in an inner group per param group that takes the group's options at every step.
A piece is stepped only while its parameter has a gradient (`ShardedModule.has_grad`, the same
on every rank), with that parameter's own step count, so the pieces of a parameter step exactly
as torch steps the whole parameter: the optimizers allowed are those whose update of an element
depends only on that element's gradient, state and the parameter's step count.

The state of the pieces lives in tensors that the module provides
(`ShardedModule.optimizer_state`), one flat tensor per unit and state key holding this
optimizer's pieces of that unit back to back: whatever CLS allocates at its first step is moved
there, and CLS updates it in place from then on. Only this rank's pieces have state.
"""
import inspect

import torch

from .groups import ModuleOptimizer, piece_ranges
from ... import _pool

__all__ = ["ShardedOptimizer", "ShardedAdamW", "ELEMENTWISE", "master_copies", "copy_masters"]

# torch's optimizers whose update is elementwise (per element: its gradient, its state, and the
# parameter's step count). Others (LBFGS: a closure and whole-model line searches; Adafactor:
# row and column statistics of whole matrices; SparseAdam: sparse gradients) are refused.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "AdamW", "Adam", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"))


def options_of(cls):
    """{option: default} of a torch optimizer class, from its constructor."""
    out = {}
    for name, prm in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        out[name] = None if prm.default is prm.empty else prm.default
    return out


def state_keys(cls, given):
    """([elementwise state keys], {other state key: its probe value}, the step count left out)
    of torch optimizer `cls` with options `given`, from one step of a two-element probe."""
    p = torch.zeros(2, requires_grad=True)
    probe = cls([p], **given)
    p.grad = torch.zeros(2)
    probe.step()
    st = probe.state[p]
    elementwise = sorted(k for k, v in st.items() if torch.is_tensor(v) and v.shape == p.shape)
    other = {k: v for k, v in sorted(st.items())
             if k not in elementwise and k != "step" and v is not None}
    return elementwise, other


def master_of_unit(model, ui):
    """What the optimizer steps for unit `ui`: the fp32 master of the optimizer range where the
    module keeps one, else the range of the shard itself."""
    master = model.master_of(ui)
    return model.shard(ui)[0] if master is None else master


def master_copies(model):
    """(compute shard's optimizer range, its fp32 master) of every unit whose optimizer state
    is an fp32 master apart from the shard (bf16 parameters, quantized gathers); none on a
    rank that does not step (model.steps)."""
    copies = []
    for ui in model.units() if model.steps else ():
        shard, _ = model.shard(ui)
        master = master_of_unit(model, ui)
        if master.data_ptr() != shard.data_ptr():
            copies.append((shard, master))
    return copies


def copy_masters(copies):
    """After a step: the compute shards take their masters' new values (rounded to bf16)."""
    for shard, master in copies:
        shard.copy_(master.to(shard.dtype))


class ShardedOptimizer(ModuleOptimizer):
    """torch optimizer class `cls` (one of ELEMENTWISE) on this rank's pieces of `model`'s
    parameters; `params`: torch's params or param groups (None: all of the module's);
    `defaults`: cls's options. `skip_matrices`: leave out the whole-matrix tensors (Muon and
    Shampoo step them)."""

    def __init__(self, model, cls, params=None, skip_matrices=False, **defaults):
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"ShardedOptimizer: {cls!r} is not a torch.optim.Optimizer class")
        if cls not in ELEMENTWISE:
            raise ValueError(
                f"ShardedOptimizer: {cls.__name__} is not an elementwise optimizer (one whose "
                "update of an element needs only that element's gradient and state), so it "
                "cannot run on shards; supported: "
                + ", ".join(f"torch.optim.{c.__name__}" for c in ELEMENTWISE)
                + " (and ShardedMuon, ShardedShampoo, ShardedAdam8bit)")
        options = options_of(cls)
        unknown = sorted(set(defaults) - set(options))
        if unknown:
            raise ValueError(f"ShardedOptimizer: torch.optim.{cls.__name__} has no option "
                             f"'{unknown[0]}' (its options: {', '.join(sorted(options))})")
        # The options as cls keeps them in its groups (AdamW adds decoupled_weight_decay, for
        # one): state dicts then have the keys of torch's own, which FSDP2's loads expect.
        options = dict(cls([torch.zeros(1, requires_grad=True)], **defaults).defaults)
        self._given = defaults  # what cls's constructor takes
        self.cls, self.skip_matrices = cls, skip_matrices
        self._built = False
        super().__init__(model, params, options)
        self._tag = f"{type(self).__name__}:{cls.__name__}"
        self.copies = master_copies(model)
        self._ranges = piece_ranges(model, skip_matrices)
        self.pieces = []  # (parameter index, piece of the master, piece of the gradient shard)
        self.where = []  # (unit, lo, hi): each piece's elements of the optimizer range
        self._inner_of = []  # param group index -> its inner group's index, or None
        self.opt = None  # cls over the pieces; None while this rank has none
        inner = [self._inner_group(gi) for gi in range(len(self.param_groups))]
        made = [g for g in inner if g is not None]
        # One construction with every group: some optimizers (Adagrad) make their state there.
        self.opt = self.cls(made, **self._given) if made else None
        at = iter(range(len(made)))
        self._inner_of = [None if g is None else next(at) for g in inner]
        self._built = True
        self._layout()
        self._steps = None  # each piece's step count, in the pool (recovery in place)
        if model.recovery.enabled:
            self._pool_steps()

    recovers = True

    def _pool_steps(self):
        """Where the job recovers lost ranks in place: each piece's step count and its other
        per-piece scalars (NAdam's mu_product, ASGD's eta and mu) in state tensors, and after a
        recovery, CLS's state of each piece made from the module's state tensors (the pool's)
        and those scalars."""
        keys, other = state_keys(self.cls, self._given)
        for key, v in other.items():
            if not (torch.is_tensor(v) and v.dim() == 0 and v.is_floating_point()):
                raise ValueError(f"{self._tag}: state '{key}' is neither elementwise nor a "
                                 "floating-point scalar, so a recovery in place could not "
                                 "restore it (docs/recovery.md); use another optimizer or no "
                                 "recovery")
        m = self.model
        count = max(len(self.pieces), 1)
        self._steps = m.optimizer_state(self._tag, "step", -1, count, torch.float64)
        # Each scalar in float64, which holds its fp32 (or fp64) value exactly.
        self._scalars = {key: (m.optimizer_state(self._tag, key, -1, count, torch.float64),
                               v.dtype) for key, v in other.items()}
        if m.recovery.state_in_place:
            # Made now, at their final size, so that the first step's journal names them (a
            # re-cut after it reads them: recut.py).
            dtypes = {ui: piece.dtype for (_, piece, _), (ui, _, _) in zip(self.pieces,
                                                                           self.where)}
            for ui, dtype in dtypes.items():
                for key in keys:
                    m.optimizer_state(self._tag, key, ui, self._unit_numel[ui], dtype)
        if m.resume_step <= 0 or self.opt is None:
            return
        recut = m.recovery.recut_step(_pool.optimizer_prefix(self._tag))
        if recut is not None and not bool(self._steps.any()):
            self._steps.fill_(recut)  # a re-cut's pieces: the count it agreed on (recut.py)
        for i, ((_, piece, _), (ui, lo, hi), at) in enumerate(
                zip(self.pieces, self.where, self._home_at)):
            n = float(self._steps[i])
            if n <= 0:
                continue
            st = {key: m.optimizer_state(self._tag, key, ui, self._unit_numel[ui],
                                         piece.dtype)[at:at + hi - lo] for key in keys}
            st["step"] = torch.tensor(n, dtype=torch.float32)
            for key, (t, dtype) in self._scalars.items():
                st[key] = torch.tensor(float(t[i]), dtype=dtype)
            self.opt.state[piece] = st
        self._homed = len(self.opt.state)

    def _count_steps(self):
        for i, (_, piece, _) in enumerate(self.pieces):
            st = self.opt.state.get(piece)
            self._steps[i] = float(st["step"]) if st and "step" in st else 0.0
            for key, (t, _) in self._scalars.items():
                t[i] = float(st[key]) if st and key in st else 0.0

    # -- pieces ------------------------------------------------------------------------------

    def _groups_changed(self):
        if self._built:  # a group added after construction
            g = self._inner_group(len(self.param_groups) - 1)
            if g is not None and self.opt is None:
                self.opt = self.cls([g], **self._given)
            elif g is not None:
                self.opt.add_param_group(g)
            self._inner_of.append(None if g is None else len(self.opt.param_groups) - 1)
            self._layout()

    def _inner_group(self, gi):
        """The inner group of param group `gi`: its parameters' pieces on this rank with its
        options (None where this rank holds none)."""
        group = self.param_groups[gi]
        tensors = []
        for p in group["params"]:
            index = self.model.param_index(p)
            for ui, lo, hi in self._ranges.get(index, ()):
                piece = torch.nn.Parameter(master_of_unit(self.model, ui)[lo:hi],
                                           requires_grad=False)
                self.pieces.append((index, piece, self.model.shard(ui)[1][lo:hi]))
                self.where.append((ui, lo, hi))
                tensors.append(piece)
        if not tensors:
            return None
        inner = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        return dict(inner, params=tensors)

    def _layout(self):
        """Each piece's place in the module's state tensors: its unit's pieces of this optimizer
        back to back."""
        self._home_at, self._unit_numel = [], {}
        self._by_index = {}  # parameter index -> [(piece, its unit, lo, hi)], in tensor order
        # Where a shrink may re-cut the shards, each piece's state lies at its own offset of the
        # optimizer range instead (RankRecovery.state_in_place; recovery/recut.py).
        in_place = self.model.recovery.state_in_place
        for (index, piece, _), (ui, lo, hi) in zip(self.pieces, self.where):
            at = lo if in_place else self._unit_numel.get(ui, 0)
            self._home_at.append(at)
            self._unit_numel[ui] = self.model.os_elems[ui] if in_place else at + hi - lo
            self._by_index.setdefault(index, []).append((piece, ui, lo, hi))
        self._homed = -1  # the pieces with state when they were last homed (-1: not yet)

    def _home(self):
        """Moves every elementwise state tensor of the pieces into the module's state tensors
        (those CLS allocated at a first step, or a load put there); CLS then updates them in
        place."""
        if self.opt is None:
            return
        self._homed = len(self.opt.state)
        for (_, piece, _), (ui, lo, hi), at in zip(self.pieces, self.where, self._home_at):
            st = self.opt.state.get(piece)
            if not st:
                continue
            for key, t in st.items():
                if not torch.is_tensor(t) or t.shape != piece.shape:
                    continue  # a scalar (the step count)
                home = self.model.optimizer_state(self._tag, key, ui, self._unit_numel[ui],
                                                  t.dtype)[at:at + hi - lo]
                if t.data_ptr() != home.data_ptr():
                    home.copy_(t)
                    st[key] = home

    # -- steps -------------------------------------------------------------------------------

    _closure_why = "an elementwise optimizer needs no re-evaluation of the loss"

    def step(self, closure=None, gather=True):
        """Steps this rank's optimizer range, then (unless `gather` is False: the caller
        gathers once its own updates are in) AMSP's update gather."""
        return super().step(closure, gather=gather)

    def _step_all(self, model, gather=True):
        if self.opt is not None:
            has = self.model.has_grad
            for index, piece, grad in self.pieces:
                piece.grad = grad if has[index] else None
            for group, inner in zip(self.param_groups, self._inner_of):
                if inner is not None:
                    target = self.opt.param_groups[inner]
                    for k, v in group.items():
                        if k not in ("params", "param_names"):
                            target[k] = v
            self.opt.step()
            if len(self.opt.state) != self._homed:
                self._home()  # pieces stepped for the first time (their state is then CLS's)
            if self._steps is not None:
                self._count_steps()
        copy_masters(self.copies)
        if gather:
            self.model.gather_updates()

    # -- state -------------------------------------------------------------------------------

    def _pieces_of(self, index):
        return [(piece, hi - lo) for piece, _, lo, hi in self._by_index.get(index, ())]

    def param_state(self, index):
        pieces = self._pieces_of(index)
        states = [self.opt.state.get(piece) for piece, _ in pieces] if self.opt else []
        if not states or not all(states):
            return {}
        out = {}
        for key, t in states[0].items():
            if torch.is_tensor(t) and t.shape == pieces[0][0].shape:
                out[key] = torch.cat([st[key].reshape(-1) for st in states])
            else:
                out[key] = t.clone() if torch.is_tensor(t) else t
        return out

    def init_state(self):
        """Makes the state of every piece that has none, as FSDP2 does before a load
        (torch.distributed.checkpoint.state_dict): a step with zero gradients at lr 0, which
        leaves the parameters as they are; a load then overwrites every state value."""
        if self.opt is None or all(self.opt.state.get(piece) for _, piece, _ in self.pieces):
            return
        lrs = [g["lr"] for g in self.opt.param_groups]
        for _, piece, _ in self.pieces:
            piece.grad = torch.zeros_like(piece)
        for g in self.opt.param_groups:
            g["lr"] = 0.0
        self.opt.step()
        for g, lr in zip(self.opt.param_groups, lrs):
            g["lr"] = lr
        for _, piece, _ in self.pieces:
            piece.grad = None
        self._home()

    def dcp_state(self, index):
        """{key: [(flat start in the parameter, tensor)]} of parameter `index`'s elementwise
        state on this rank (views of the state: a checkpoint reads and writes them in place),
        and {key: scalar tensor} of its scalars (the step count), or ({}, {})."""
        elementwise, scalars = {}, {}
        for piece, ui, lo, _ in self._by_index.get(index, ()):
            st = self.opt.state.get(piece)
            if not st:
                continue
            start = self.model.piece_start(ui, lo, index)
            for key, t in st.items():
                if torch.is_tensor(t) and t.shape == piece.shape:
                    elementwise.setdefault(key, []).append((start, t))
                elif key not in scalars:
                    scalars[key] = t.detach().clone() if torch.is_tensor(t) else \
                        torch.tensor(float(t))
        return elementwise, scalars

    def dcp_set_scalars(self, index, scalars):
        """Sets the scalars of parameter `index` (what dcp_state gave, loaded) on its pieces."""
        for piece, _, _, _ in self._by_index.get(index, ()):
            st = self.opt.state.get(piece)
            for key, v in scalars.items() if st else ():
                st[key] = v.clone() if torch.is_tensor(st.get(key)) else type(st[key])(v)

    def set_param_state(self, index, state):
        pieces = self._pieces_of(index)
        total = sum(n for _, n in pieces)
        name = self.model.unit_param_name(index)
        for key, v in state.items():
            if torch.is_tensor(v) and v.dim() >= 1 and v.numel() != total:
                raise ValueError(
                    f"{self._tag}.load_state_dict: state '{key}' of parameter '{name}' has "
                    f"{v.numel()} elements, this rank holds {total} of it (state_dict() holds "
                    "each rank's own elements: load it under the same plan, or use "
                    "ragshard.checkpoint.load_dcp across plans)")
        at = 0
        for piece, n in pieces:
            st = {}
            for key, v in state.items():
                if torch.is_tensor(v) and v.dim() >= 1:
                    st[key] = v.reshape(-1)[at:at + n].to(piece.dtype).clone()
                else:
                    st[key] = v.clone() if torch.is_tensor(v) else v
            self.opt.state[piece] = st
            at += n
        self._home()


class ShardedAdamW(ShardedOptimizer):
    """torch.optim.AdamW on this rank's shards (ShardedOptimizer's AdamW case); `params`:
    torch's params or param groups (None: all of the module's)."""

    def __init__(self, model, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, skip_matrices=False, **options):
        super().__init__(model, torch.optim.AdamW, params, skip_matrices, lr=lr, betas=betas,
                         eps=eps, weight_decay=weight_decay, **options)
