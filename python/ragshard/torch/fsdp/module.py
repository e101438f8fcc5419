"""ShardedModule: a module whose parameters live in ragshard's buffers (see the package
docstring), made of parts that it owns and builds with what each needs (ShardedModule's
docstring lists them); its public methods delegate to them."""
import contextlib
import os

import torch

from ... import Client, Env, Error, plan_of
from ..recovery.rank import RankRecovery, attach, journaled
from .api import FSDPMethods, HookOrder, adopt_unit_modules, fsdp2_options
from .buffers import UnitBuffers
from .control import ControlUnits, GradUse, control_inventory
from .gathers import UnitGathers
from .grads import GradNorms, ShardGrads
from .hooks import UnitHooks
from .layout import ShardLayout
from .meta import adopt_meta
from .params import adopt
from .quantized import QuantizedGathers, plan_quantized_units
from .shards import RankShards
from .settings import UnitSettings
from .state import ModuleState
from .trace import Trace
from .units import ModuleUnits, find_ties, group_units, policy_units, unit_inventory
from .views import DTYPES


def _delegate(cls, owner, table):
    """Read-only properties of `cls`, each reading the attribute of the same name of the part
    `owner` names; `table` has a line "name: its doc" a property."""
    for line in table.strip().splitlines():
        name, doc = (part.strip() for part in line.split(":", 1))
        setattr(cls, name, property(lambda self, n=name: getattr(getattr(self, owner), n),
                                    doc=doc))


def _world_from_environment():
    """The world size ragshard.Env finds (ragshard.launch's, torchrun's or srun's variables),
    else RAGSHARD_WORLD_SIZE or WORLD_SIZE alone; None where there is none."""
    try:
        return Env().world_size
    except Error:
        return int(os.environ.get("RAGSHARD_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or
                   0) or None


class ShardedModule(FSDPMethods, HookOrder, torch.nn.Module):
    """`module` with its parameters in ragshard buffers; see the package docstring. It is the
    root of FSDP2's module API (fsdp_api.py): FSDPModule's methods, which on the root act on the
    parameters outside every unit and, with `recurse`, on every unit; each unit's submodule has
    them too, for its own unit.

    Its parts, each an object built with what it needs (attributes are private; the public API
    below delegates to them):
    * `layout` (ShardLayout, layout.py): this rank's place in the job's plan, read once;
    * `_units` (ModuleUnits, units.py): the units as the plan groups them, and the parameters;
    * `_shards` (RankShards, shards.py): this rank's shards, pieces, masters and optimizer state;
    * `_binding` (UnitBuffers, buffers.py): parameters and gradients bound to the buffers;
    * `_quantized` (QuantizedGathers, quantized.py) and `_gathers` (UnitGathers, gathers.py):
      unshard, prefetch and reshard;
    * `_control` (ControlUnits) and `_grad_use` (GradUse), control.py: sums over ranks, and
      which parameters have a gradient;
    * `_unit_hooks` (UnitHooks, hooks.py) with `_trace` (Trace, trace.py) and `_settings`
      (UnitSettings, settings.py): the forward and backward hooks, and what each unit does;
    * `_grads` (ShardGrads, grads.py): the parameters' .grad after a backward;
    * `_state` (ModuleState, state.py): state dicts.

    FSDP2's arguments (`mesh`, `shard_placement_fn`, `mp_policy`, `offload_policy`,
    `ignored_params`; fsdp_api.fsdp2_options) do what FSDP2's do or are refused by name."""

    def __init__(self, module, client, units, granule=None, optimizer=None, param_dtype="fp32",
                 reshard_after_forward=True, prefetch=None, register=True, quantize=None,
                 world=None, init=None, strategy=None, *, mesh=None, shard_placement_fn=None,
                 mp_policy=None, offload_policy=None, ignored_params=None):
        super().__init__()
        param_dtype, reshard_after_forward, cast_inputs, output_dtype, ignored, offload = \
            fsdp2_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                          offload_policy, ignored_params, param_dtype)
        _check_options(param_dtype, quantize, reshard_after_forward)
        self.module = module
        self.param_dtype, self.quantize = param_dtype, quantize
        self._policy = (cast_inputs, output_dtype)
        # FSDP2's meanings: True reshards after forward, False keeps the unit unsharded until
        # its backward, an int n > 1 reshards to groups of n local ranks (the ranks per node:
        # the backward's unshard then stays within the node).
        self.reshard_after_forward = reshard_after_forward
        # A model built on the meta device: its values come from `init`, one tensor at a time.
        meta = adopt_meta(module, init)
        self._needs_load = bool(meta) and init == "empty"
        found = policy_units(module, units, ignored)
        world = world or _world_from_environment()
        if quantize and not world:
            raise ValueError("quantize: the world size is needed before registering (world=)")
        inventory, qsizes = _inventory(found, world, param_dtype, quantize, granule, optimizer,
                                       strategy)
        # A shrunk job's survivor (recovery/takeover.py): `held` is its salvage attachment to the
        # old job, and `shrink` says where the rank goes on (job, rank, world) and from where.
        self.client, held, shrink = attach(
            client, inventory, register,
            lambda w: _inventory(found, w, param_dtype, quantize, granule, optimizer, strategy)[0])
        self.layout = ShardLayout.read(self.client, plan_of(self.client))
        if offload and hasattr(self.client.param_shard(0), "__cuda_array_interface__"):
            raise ValueError("fully_shard: offload_policy=CPUOffloadPolicy() on the GPU backend: "
                             "ragshard keeps the shards in the daemon's GPU pool (on a host "
                             "backend they are in host memory, as CPU offload asks); drop it")
        self.prefetch = _prefetch_depth(prefetch, self.layout.plan)
        self._units = ModuleUnits(group_units(self.layout.plan, found, bool(qsizes)),
                                  find_ties(module, found), self.layout.places, param_dtype)
        self._shards = RankShards(self.client, param_dtype, self.layout, self._units)
        self._binding = UnitBuffers(self.client, param_dtype, self._units)
        # The rank's recovery state, its one owner (recovery/rank.py).
        self.recovery = RankRecovery(self.client, self.layout, self._shards, held, shrink)
        self._shard_values(meta, init, write=self.recovery.writes_initial_values)
        self._control = ControlUnits(self.client, self.layout, len(self._units),
                                     self._units.nparams)
        self._build_parts(qsizes)
        self.recovery.resume(self._control, self.units(),
                             lambda: journaled(self.client, self._shards, self.units(),
                                               self.steps))
        self.checkpoint_writing = None  # an asynchronous checkpoint save writing the state

    def _shard_values(self, meta, init, write=True):
        """Each unit's initial values into this rank's shards (unless `write` is False: an
        adopted rank's shards hold its trained values); its parameters then belong to the unit
        (named for errors, clipped with the module) and hold no storage."""
        for ui in range(len(self._units)):
            self._shards.fill(ui, meta, init, write)
            for n, p in self._units.params(ui):
                p.grad = None
                adopt(p, n, self._units.name(ui))
            self._binding.free(ui)

    @contextlib.contextmanager
    def optimizer_step(self):
        """An optimizer step: the optimizers step inside it. Units left unsharded (by
        set_reshard_after_backward(False), or the root after a forward without backward) are
        resharded first, so that no forward after the step computes with their values from
        before it; where the job recovers lost ranks in place the step is one transaction over
        this rank's state (RankRecovery.transaction)."""
        self._reshard_stale()
        with self.recovery.transaction():
            yield

    def _build_parts(self, qsizes):
        """The gathers, hooks and whole-model operations over the shards and their binding."""
        client, layout, units = self.client, self.layout, self._units
        self._quantized = QuantizedGathers(client, self.quantize, qsizes, layout, self._binding,
                                           self._shards)
        self._gathers = UnitGathers(client, self._binding, self._quantized, units,
                                    self.prefetch)
        self._grad_use = GradUse(self._control, units.nparams)
        self._grads = ShardGrads(units, self._shards, self._grad_use,
                                 GradNorms(self._control, layout))
        self._trace = Trace(client, [name for name, _, _ in units.groups],
                            os.environ.get("RAGSHARD_TRACE"))
        cast_inputs, output_dtype = self._policy
        self._settings = UnitSettings(
            len(units), self.reshard_after_forward, units.root,
            param_dtype=DTYPES[self.param_dtype] if self.param_dtype != "fp32" else None,
            cast_inputs=cast_inputs, output_dtype=output_dtype)
        self._unit_hooks = UnitHooks(self, self.module, units, self._gathers, self._binding,
                                     client, self._grad_use, self._grads, self._trace,
                                     self._settings, self.prefetch, layout.replicas,
                                     self._binding.pack, self._binding.unpack)
        adopt_unit_modules(self)
        self._state = ModuleState(self.module, units, layout, self._shards, self._gathers,
                                  client)
        # Gathers (unshards bound to the parameters), gradient reduce-scatters by unit name, and
        # of those the ones that added into a gradient shard holding a gradient.
        self.op_counts = {"gather": self._binding.gathers,
                          "reduce_scatter": self._unit_hooks.reduce_scatters,
                          "accumulating": self._unit_hooks.accumulating}

    # The layout's and the parts' figures, and recovery's, read-only: _delegate below.
    recoverable = property(lambda self: self.recovery.enabled,
                           doc="Whether the job recovers lost ranks in place.")

    # -- user API ----------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """The wrapped module's forward; the hooks (hooks.py, on this module and the wrapped
        one) gather the root's parameters before it and save parameters for backward by
        place."""
        if self._needs_load:
            raise RuntimeError("fully_shard(init='empty'): the shards hold no values yet; load a "
                               "checkpoint (ragshard.checkpoint.load) or a state_dict first")
        return self.module(*args, **kwargs)

    # FSDP2's module API (fsdp_api.py): the root's scope and hooks.
    def _ragshard_scope(self):
        return self, self._units.root, list(range(len(self._units)))

    def _ragshard_hooks(self):
        return self.__dict__.get("_unit_hooks")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without reduction: backward passes inside add into the
        unsharded gradient buffers; the first backward outside reduce-scatters the sum (adding
        it to what the gradient shards hold). FSDP2's set_requires_gradient_sync(False) for the
        block's duration."""
        sync = list(self._settings.sync)
        self._settings.sync[:] = [False] * len(sync)
        try:
            yield
        finally:
            self._settings.sync[:] = sync

    def zero_grad(self, set_to_none=True):
        """PyTorch's zero_grad: zeroes the gradient shards' optimizer ranges and the gradients
        accumulated under no_sync (outside a backward the unsharded gradients are released).
        Backward passes add into the gradient shards until then, as into PyTorch's .grad. With
        set_to_none (the default), parameters also stop having a gradient (.grad None) until a
        backward reaches them (`has_grad`), so the optimizers leave them alone; without, they
        keep a zero gradient and are stepped with it."""
        self._binding.zero_grads(set_to_none)
        if self.steps:  # else the local rank that steps this memory zeroes it
            for ui in self.units():
                # The optimizer range (the whole shard when p = g = os): another local rank may
                # step the rest of a gradient shard it shares.
                self.shard(ui)[1].zero_()
        self._unit_hooks.zero_grad()
        if set_to_none:
            self._grad_use.forget()
            self._grads.forget()

    def all_reduce_scalar(self, value):
        """The sum over ranks of one float per rank (through the scalar unit's reduce-scatter:
        every element of this rank's gradient holds `value`, so every element of the reduced
        shard holds the sum)."""
        return self._control.all_reduce_scalar(value)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_ over this module's parameters (their .grad are
        ShardGrads: the global norm, grads.py); returns the norm. Every rank calls it."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type,
                                              error_if_nonfinite, foreach)

    def state_dict(self, *args, **kwargs):
        """The full state dict for export (save_pretrained, torch.save), as FSDP2's
        get_model_state_dict with full_state_dict=True and cpu_offload=True gives it: a
        collective (every rank calls it; one unit unsharded at a time), after which rank 0 holds
        every parameter as an fp32 CPU tensor under each of its names in the module's own
        state_dict (tied aliases too) and the persistent buffers, and the other ranks hold
        nothing ({}), not a copy of the whole model."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict, strict=True, assign=False, *, step=None):
        """Loads a plain (unsharded) state_dict, as `state_dict()` returns or torch.save of the
        plain model holds: each rank copies its pieces of every parameter into its optimizer
        range (and fp32 masters), and the buffers whole; with separate factors the update
        gather then fills the rest of each parameter shard. Every rank calls it. Returns
        (missing_keys, unexpected_keys), as torch's. Where the job recovers lost ranks in place
        the load is one transaction of the step journal; `step`: the training step the loaded
        state is at (None: the step it was at; docs/recovery.md, "Checkpoints")."""
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported (the parameters "
                             "live in the daemon's buffers)")
        self.wait_for_checkpoint_write()
        with self.recovery.load(step):
            keys, complete = self._state.load_state_dict(state_dict, strict)
        self._reshard_stale()
        if complete:
            self.mark_loaded()
        return keys

    def full_state(self, rank0_only=False):
        """{name: fp32 tensor} of every parameter, unsharded (one all-gather per unit, one unit
        at a time; every rank calls it). With param_dtype bf16 the values are the fp32 masters
        (as FSDP2's full state dict holds them), not their bf16 rounding that the forward
        computes with. `rank0_only`: the other ranks keep nothing and get {}."""
        return self._state.full_state(rank0_only)

    def mark_loaded(self):
        """Every parameter has its values (a checkpoint or state_dict loaded): a module made
        with init="empty" may run from now on."""
        self._needs_load = False

    def wait_for_checkpoint_write(self):
        """Waits until an asynchronous checkpoint save has written this rank's part: the
        shards, masters and optimizer state must not change before (the optimizers' step calls
        it). Raises the save's error if it failed."""
        handle = self.checkpoint_writing
        if handle is not None:
            self.checkpoint_writing = None
            handle.wait_written()

    # -- the optimizers' and checkpoints' interface (RankShards) -------------------------------

    def pieces(self, ui):
        """The parameters' pieces in this rank's optimizer range of unit `ui` (Piece: parameter
        index, elements [lo, hi) of the range, whether a matrix)."""
        return self._shards.pieces(ui)

    def shard(self, ui):
        """This rank's optimizer range of unit `ui`: its parameters (fp32 or bf16, in the
        parameter shard) and its fp32 gradients (in the gradient shard). With p = g = os that is
        the whole of both shards."""
        return self._shards.shard(ui)

    def master_of(self, ui):
        """The fp32 master of this rank's optimizer range of unit `ui` where the module keeps
        one apart from the shard (bf16 parameters, quantized gathers), else None."""
        return self._shards.master_of(ui)

    def gather_updates(self):
        """AMSP's update gather after an optimizer step (or a load) with separate factors: each
        rank's optimizer range reaches every parameter shard that holds it. Every rank calls
        it; nothing runs when p = g = os. Units left unsharded (the root after a forward
        without backward, set_reshard_after_backward(False)) are resharded: their unsharded
        values may predate what the shards now hold."""
        self._shards.gather_updates()
        self._reshard_stale()

    def _reshard_stale(self):
        """Reshards every unit unsharded now, or with a gather started ahead, before or after its
        shards change (a step, a load): the next forward gathers the new values."""
        self._gathers.drop_prefetches()
        for ui in self.units():
            if self._gathers.is_unsharded(ui):
                self._gathers.reshard(ui)

    def units(self):
        return self._shards.units()

    def unit_params(self, ui):
        """[(name, parameter)] of unit `ui`, in plan order."""
        return self._shards.unit_params(ui)

    def unit_views(self, ui):
        """[(parameter, offset, numel)] of unit `ui`: where each lies in the unit."""
        return self._shards.unit_views(ui)

    def param_index(self, p):
        """The index of parameter `p` in unit order (that of `has_grad` and of the pieces)."""
        return self._shards.param_index(p)

    def is_param(self, p):
        """True when `p` is one of the module's (sharded) parameters."""
        return self._units.index_of(p) is not None

    def piece_start(self, ui, lo, index):
        """The flat element of parameter `index` at element `lo` of this rank's optimizer range
        of unit `ui`."""
        return self._shards.piece_start(ui, lo, index)

    def unit_param_name(self, index):
        """The name of parameter `index` (unit order)."""
        return self._units.names[index]

    def optimizer_state(self, owner, key, ui, numel, dtype=torch.float32):
        """The module's tensor of `numel` elements that holds state `key` of optimizer `owner`
        for unit `ui` (zeros when new). The optimizers keep their state of this rank's pieces
        here rather than in tensors of their own, so that where it lives is the module's
        choice."""
        return self._shards.optimizer_state(owner, key, ui, numel, dtype)

    def optimizer_state_tensors(self):
        """Every tensor that optimizer_state has made (what the optimizers' state occupies)."""
        return self._shards.optimizer_state_tensors()

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The wrapped module's parameters under their own names (as FSDP2, which wraps in
        place): the names an optimizer's param groups and a state dict use."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)


_delegate(ShardedModule, "layout", """
    plan: The job's plan.
    world: The job's world size W.
    rank: This rank.
    replicas: W / |g| (ShardLayout).
    pos: The parameter shard's position.
    gpos: The gradient shard's position.
    ospos: The optimizer range's position.
    steps: Whether this rank steps its range.
    os_group: This rank's os group.
    shard_elems: Each unit's shard.
    grad_elems: Each gradient shard.
    os_elems: Each optimizer range's size.
    os_at: Each range's place (ShardLayout).
    factored: Whether the factors differ.
    group_sizes: (|p|, |g|, |os|).""")
_delegate(ShardedModule, "_shards", """
    masters: {unit: fp32 master} kept apart from the shards (RankShards).
    matrices: A Matrix per whole-matrix tensor (Muon's and Shampoo's).""")
_delegate(ShardedModule, "_grad_use", """
    has_grad: Whether each parameter has a gradient, by index (GradUse).""")
_delegate(ShardedModule, "_binding", """
    peak_unsharded: The most units unsharded at once on this rank so far.""")
_delegate(ShardedModule, "_quantized", """
    gathered_bytes: Bytes the quantized gathers moved, and the fp32 figure.""")
# Recovery (RankRecovery, `recovery`, owns the state; these read it).
_delegate(ShardedModule, "recovery", """
    redundancy: The job's redundancy across nodes ('' none).
    resume_step: Completed optimizer steps this rank's state holds (0: new).
    shrink: Where a shrink's successor came from ({job, rank, world, from_job, ...}), or None.""")


def _check_options(param_dtype, quantize, reshard_after_forward):
    if param_dtype not in DTYPES:
        raise ValueError(f"param_dtype: '{param_dtype}' is not one of fp32, bf16")
    if quantize not in (None, "int8", "fp8"):
        raise ValueError(f"quantize: '{quantize}' is not one of None, int8, fp8")
    if quantize and param_dtype != "fp32":
        raise ValueError("quantize: needs param_dtype fp32 (fp32 masters, quantized gathers)")
    check_reshard_after_forward(reshard_after_forward)


def check_reshard_after_forward(reshard_after_forward):
    if reshard_after_forward is not True and reshard_after_forward is not False and (
            not isinstance(reshard_after_forward, int) or reshard_after_forward < 1):
        raise ValueError(f"reshard_after_forward: {reshard_after_forward!r} is not True, "
                         "False or a positive int")


def _inventory(units, world, param_dtype, quantize, granule, optimizer, strategy):
    """(the inventory fully_shard registers, the quantized units' sizes): the module's units
    (policy_units), the two control units, and with `quantize` a byte unit per module unit,
    which follow the plans of a pinned AMSP strategy (`strategy`, else RAGSHARD_STRATEGY)."""
    granule = granule or (lambda name, p: "rows:128" if p.dim() >= 2 else "element")
    optimizer = optimizer or (lambda name, p: "elementwise")
    nparams = sum(len(params) for _, _, params in units)
    inventory = {"units": unit_inventory(units, param_dtype, granule, optimizer) +
                 control_inventory(world, nparams)}
    strategy = strategy if strategy is not None else os.environ.get("RAGSHARD_STRATEGY")
    qsizes = plan_quantized_units(inventory, len(units), world, strategy) if quantize else {}
    return inventory, qsizes


def _prefetch_depth(prefetch, plan):
    """The number of units unsharded ahead of the one in use (True is 1): with the unit in use,
    the bound on units in flight. None: the depth the plan's strategy executes (its
    "prefetch=D"), else 1."""
    if prefetch is None:
        executed = plan.get("strategy", {}).get("executed", "")
        prefetch = 1
        for item in executed.split(","):
            key, _, value = item.partition("=")
            if key.strip() == "prefetch":
                try:
                    prefetch = int(value)
                except ValueError:
                    raise ValueError(f"prefetch: the plan's strategy '{executed}' has "
                                     f"'{item}', not a depth") from None
    prefetch = int(prefetch)
    if prefetch < 0:
        raise ValueError(f"prefetch: {prefetch} is negative")
    return prefetch


def fully_shard(module, client=None, units=None, **kwargs):
    """Shards `module` over the job of `client`: see ShardedModule. Without a client, connects
    from the environment (ragshard.connect(): ragshard-launch's, torchrun's or srun's
    variables), as FSDP2's fully_shard uses the default process group."""
    if units is None:
        if callable(client) and not isinstance(client, Client):
            client, units = None, client  # fully_shard(module, units) positionally
        else:
            raise TypeError("fully_shard: units= is required (a function of the module that "
                            "returns its FSDP units, e.g. lambda m: list(m.layers))")
    return ShardedModule(module, client, units, **kwargs)
