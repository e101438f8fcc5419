"""ShardedModule: a module whose parameters live in ragshard's buffers (see the package
docstring), made of parts that it owns and builds with what each needs (ShardedModule's
docstring lists them); its public methods delegate to them."""
import contextlib
import json
import os
import sys

import torch

from .. import Client, Env, Error, connect, plan_of
from .buffers import UnitBuffers
from .control import ControlUnits, GradUse, control_inventory
from .fsdp_api import FSDPMethods, HookOrder, adopt_unit_modules, fsdp2_options
from .gathers import UnitGathers
from .grads import GradNorms, ShardGrads
from .hooks import UnitHooks
from .layout import ShardLayout
from .meta import adopt_meta
from .params import adopt
from .quantized import QuantizedGathers, plan_quantized_units
from .recovery import (PoolState, StepJournal, agree_on_committed, rebuild_state,
                       redundancy_step, shard_tensors)
from .shards import RankShards
from .._shrink import SHRINK_EXIT, follow, whole_copies
from .recut import in_place, recut_step
from .settings import UnitSettings
from .shrink import release, salvage, salvage_to_release, take_over
from .state import ModuleState
from .trace import Trace
from .units import ModuleUnits, find_ties, group_units, policy_units, unit_inventory
from .views import DTYPES, as_tensor


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
        # A shrunk job's survivor (shrink.py): `held` is its salvage attachment to the old job,
        # and `shrink` says where the rank goes on (job, rank, world) and from where.
        self.shrink = None
        self.client, held = self._attach(
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
        self.recoverable = self.client.recoverable
        adopted = self.recoverable and self.client.adopted
        # A lost node's replacement (docs/recovery.md, "A lost node"): its state is rebuilt from
        # the other nodes' redundancy below, not initialized.
        replacement = self.recoverable and self.client.replacement
        self.redundancy = self.client.redundancy if self.recoverable else ""
        # Whether each step's state is protected into parity or copies ("hsdp": the other
        # replica groups hold it already).
        self._protects = self.redundancy not in ("", "hsdp")
        # Whether a shrink may re-cut this job's shards (recut.py; state_in_place).
        self._may_recut = whole_copies(self.redundancy) and self.layout.replicas == 1 and \
            not self.layout.factored and \
            self.client.job_info().get("options", {}).get("on_node_loss") == "shrink"
        self._in_place = None
        if self.recoverable:
            _check_recoverable(param_dtype, quantize)
            self._shards.pool = PoolState(self.client)
        self._shard_values(meta, init, write=not (adopted or replacement))
        self._control = ControlUnits(self.client, self.layout, len(self._units),
                                     self._units.nparams)
        self._build_parts(qsizes)
        # Completed optimizer steps that this rank's state holds: 0 for a new job; after a
        # recovery in place, the last step every rank completed (the script resumes there).
        self.resume_step = 0
        self._journal = None
        self._recut = None  # a shrink's successor: whether it re-cut (state_in_place)
        if self.recoverable:
            self._journal = StepJournal(self._shards.pool, self._journaled)
            held = self._shrink_pending(held, replacement)
            try:
                if held is not None:
                    self.resume_step, moved, recut = take_over(
                        held, self.client, plan_of(held), self.layout.plan, self._control,
                        self._journal, self.units(),
                        self.client.job_info(held.job)["survivor_ranks"])
                    self._recut[0] = int(recut)
                    self._taken[1:] = torch.tensor([moved, self.shrink["from_world"]])
                    self._taken[0] = 1 + self.resume_step
                    # Once every rank has copied (a barrier), no take-over is done again: the
                    # shrunk job's buffers on each node go back to its pool.
                    self._control.all_reduce_scalar(0.0)
                    release(held)
                elif adopted or replacement:  # (a successor's own recovery: its own state)
                    self._recover(replacement)
            finally:
                if held is not None:
                    held.close()
            if self._taken is not None:  # (after _recover: a replacement's mark is rebuilt)
                self.shrink = self._shrink_from_mark()
            if self._protects and self._journal.committed == 0 and \
                    self._control.all_reduce_scalar(self._lacks_parity(0)) > 0:
                # Step 0, the state every rank starts from (a node lost before the first step
                # commits is rebuilt to it), unless every node holds it already (a recovery
                # back to step 0: protecting it again would put a second parity beside it).
                self.client.protect().wait()
        self.checkpoint_writing = None  # an asynchronous checkpoint save writing the state

    def _attach(self, client, inventory, register, inventory_at):
        """Registers `inventory` (unless `register` is False) and attaches; without a client,
        connects from the environment, once the module is known to be shardable. Returns the
        client and None; where the job shrank (shrink.py), a client of this rank in the job
        that goes on (registered with `inventory_at(its world size)`) and a salvage attachment
        to the job that holds the rank's state."""
        client = client if client is not None else connect()
        try:
            if register:
                client.register(json.dumps(inventory), True)
            client.attach()
            return client, None
        except Error as e:
            refused = e
        try:
            live = follow(client.job_info, client.job, client.rank, decided=True)
        except Error as e:
            if "shrank without" in str(e):  # this rank's node was lost, and came back late
                print(f"ragshard: {e}; exiting with {SHRINK_EXIT}", file=sys.stderr, flush=True)
                sys.exit(SHRINK_EXIT)
            live = None  # the planner's answer is not a shrink's: the refusal stands
        if live is None:
            raise refused
        job, rank, held_job, held_rank = live
        held = client.for_job(held_job, held_rank)
        try:
            held.attach(salvage=True)
        except Error as e:
            if not str(e).startswith("NOT_FOUND"):
                held.close()
                raise
            # Released once every rank took it over: the successor's marks say so (else the
            # take-over fails naming the job, in _shrink_pending).
            held.close()
            held = None
        world = client.job_info(job)["world_size"]
        new = client.for_job(job, rank)
        new.register(json.dumps(inventory_at(world)), True)
        new.attach()
        self.shrink = {"job": job, "rank": rank, "world": world, "from_job": held_job,
                       "from_rank": held_rank,
                       "from_world": client.job_info(held_job)["world_size"]}
        client.close()  # (the caller's client of the shrunk job: self.client replaces it)
        return new, held

    def _shrink_pending(self, held, replacement):
        """In a shrink's successor job (shrink.py), the salvage attachment to take the state
        over from until every rank has (a mark in each rank's pool, agreed by a sum): a rank
        restarted in the middle of a take-over makes every rank do it again, from `held` (the
        attachment `_attach` made) or one made here to the job the successor came from. None
        once every rank took the state over, and in a job that is no shrink's successor."""
        self._taken = self._recut = None
        info = self.client.job_info()
        pred = info.get("predecessor_job_id")
        if not pred:
            return held
        self._successor = (pred, info["world_size"])
        # [1 + the step taken over (0: not yet), the bytes copied, the world size of the job it
        # came from]: a rank restarted later in the successor (a recovery there) still says
        # where the shrink happened (`shrink`), even once that job is deleted. A replacement's
        # mark comes back with the rest of its state (rebuilt from redundancy): it does not vote.
        self._taken, _ = self._shards.pool.tensor("shrink/taken", 3, torch.int64)
        self._recut, _ = self._shards.pool.tensor("shrink/recut", 1, torch.int64)  # recut.py
        taken = bool(int(self._taken[0])) or replacement
        if self._control.all_reduce_scalar(0.0 if taken else 1.0) == 0.0:
            # Every rank took the state over. This node may still hold the shrunk job's buffers
            # (every local rank died between the barrier and its release): released here; a
            # daemon that released them already answers NOT_FOUND.
            if held is None:
                held = salvage_to_release(self.client, pred)
            if held is not None:
                release(held)
                held.close()
            return None
        if held is None:
            held, self.shrink = salvage(self.client, pred)
        return held

    @property
    def state_in_place(self):
        """Whether the optimizers keep their elementwise state in shard coordinates (each
        piece's state at its offset in the optimizer range, rather than packed): in a job whose
        shards a shrink may re-cut (on_node_loss shrink, one shard group, no separate factors,
        whole copies of each node: redundancy replica or parity:1), and in a shrink's successor
        as in the job it came from, or after a re-cut (recut.py; kept in the pool)."""
        if self._in_place is None:
            self._in_place = self.recoverable and in_place(self._shards.pool, self._may_recut)
        return self._in_place

    def recut_step(self, prefix):
        """The step count that a re-cut agreed on for optimizer state `prefix` ("opt/<tag>"),
        or None where the job did not come from a re-cut."""
        if self._recut is None or int(self._recut[0]) != 1:
            return None
        return recut_step(self._shards.pool, prefix)

    def _shrink_from_mark(self):
        """ShardedModule.shrink in a shrink's successor, from this rank's mark (shrink/taken)
        and the planner's survivor_ranks (None once the job it came from is deleted)."""
        pred, world = self._successor
        step, moved, from_world = (int(x) for x in self._taken)
        from_rank = (self.shrink or {}).get("from_rank")
        if from_rank is None:
            try:
                from_rank = self.client.job_info(pred)["survivor_ranks"][self.client.rank]
            except (Error, KeyError, IndexError):
                from_rank = None
        return {"job": self.client.job, "rank": self.client.rank, "world": world,
                "from_job": pred, "from_rank": from_rank, "from_world": from_world,
                "step": step - 1, "bytes": moved}

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

    def _journaled(self):
        """{name: tensor} of the state an optimizer step changes on this rank: its parameter
        shards (where it steps them) and the optimizers' state."""
        out = shard_tensors(self.client, self.units()) if self.steps else {}
        out.update(self._shards.named_state())
        return out

    def _lacks_parity(self, step):
        """1.0 where this rank's node holds no parity of `step` (JobStats.parity_steps)."""
        return 0.0 if step in self.client.stats().get("parity_steps", []) else 1.0

    def _recover(self, replacement=False):
        """A recovered rank (docs/recovery.md): agrees with the others on the last step all of
        them completed, brings its state back to it, and drops the interrupted step's
        gradients. A replacement node's rank has no state: it takes no part in the agreement,
        and its state is rebuilt from the others' redundancy (`rebuild_state`). With redundancy,
        the ranks may roll forward one step instead (`redundancy_step`)."""
        have = not replacement
        step = agree_on_committed(self._control, self._journal.committed, have=have)
        if self._protects:
            step = redundancy_step(self.client, self._control, self._journal, step, have=have)
        if have:
            self._journal.roll_to(step)
        if self.redundancy:
            rebuild_state(self.client, replacement, self._journal, step)
        self.resume_step = step
        for ui in self.units():
            as_tensor(self.client.grad_shard(ui)).zero_()

    @contextlib.contextmanager
    def optimizer_step(self):
        """An optimizer step as one transaction over this rank's state (StepJournal) where the
        job recovers lost ranks in place. The optimizers step inside it. Units left unsharded
        by set_reshard_after_backward(False) are resharded first: no forward after the step
        computes with their values from before it."""
        self._reshard_stale()
        if self._journal is None:
            yield
            return
        self._journal.begin()
        outermost = self._journal.depth == 1
        try:
            yield
            if self._protects and outermost:
                # This step's state once whole (a nested step, ShardedMuon's AdamW, is part of
                # it), before it commits: docs/recovery.md, "One parity held".
                self.client.protect().wait()
        except BaseException:
            self._journal.abandon()
            raise
        self._journal.commit()

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

    # -- the layout and the parts' figures, read-only ----------------------------------------

    plan = property(lambda self: self.layout.plan, doc="The job's plan.")
    world = property(lambda self: self.layout.world, doc="The job's world size W.")
    rank = property(lambda self: self.layout.rank, doc="This rank.")
    replicas = property(lambda self: self.layout.replicas, doc="W / |g| (ShardLayout).")
    pos = property(lambda self: self.layout.pos, doc="The parameter shard's position.")
    gpos = property(lambda self: self.layout.gpos, doc="The gradient shard's position.")
    ospos = property(lambda self: self.layout.ospos, doc="The optimizer range's position.")
    steps = property(lambda self: self.layout.steps, doc="Whether this rank steps its range.")
    os_group = property(lambda self: self.layout.os_group, doc="This rank's os group.")
    shard_elems = property(lambda self: self.layout.shard_elems, doc="Each unit's shard.")
    grad_elems = property(lambda self: self.layout.grad_elems, doc="Each gradient shard.")
    os_elems = property(lambda self: self.layout.os_elems, doc="Each optimizer range's size.")
    os_at = property(lambda self: self.layout.os_at, doc="Each range's place (ShardLayout).")
    factored = property(lambda self: self.layout.factored, doc="Whether the factors differ.")
    group_sizes = property(lambda self: self.layout.group_sizes, doc="(|p|, |g|, |os|).")
    masters = property(lambda self: self._shards.masters,
                       doc="{unit: fp32 master} kept apart from the shards (RankShards).")
    matrices = property(lambda self: self._shards.matrices,
                        doc="A Matrix per whole-matrix tensor (Muon's and Shampoo's).")
    has_grad = property(lambda self: self._grad_use.has_grad,
                        doc="Whether each parameter has a gradient, by index (GradUse).")
    peak_unsharded = property(lambda self: self._binding.peak_unsharded,
                              doc="The most units unsharded at once on this rank so far.")
    gathered_bytes = property(lambda self: self._quantized.gathered_bytes,
                              doc="Bytes the quantized gathers moved, and the fp32 figure.")

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

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads a plain (unsharded) state_dict, as `state_dict()` returns or torch.save of the
        plain model holds: each rank copies its pieces of every parameter into its optimizer
        range (and fp32 masters), and the buffers whole; with separate factors the update
        gather then fills the rest of each parameter shard. Every rank calls it. Returns
        (missing_keys, unexpected_keys), as torch's."""
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported (the parameters "
                             "live in the daemon's buffers)")
        self.wait_for_checkpoint_write()
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


def _check_recoverable(param_dtype, quantize):
    """Recovery in place keeps the state of fp32 training in the pool; bf16 parameters and
    quantized gathers keep fp32 masters in the rank, which a lost process would take along."""
    if param_dtype != "fp32" or quantize:
        raise ValueError(
            f"fully_shard: the job recovers lost ranks in place, which keeps every rank's "
            f"state in its daemon's pool; param_dtype '{param_dtype}'"
            f"{' with quantize ' + repr(quantize) if quantize else ''} keeps fp32 masters in "
            "the rank process (docs/recovery.md): train in fp32, or create the job without a "
            "recovery deadline")


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
