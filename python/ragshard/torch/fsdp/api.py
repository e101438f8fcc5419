"""FSDP2's module API on a fully_shard module: fully_shard's FSDP2 arguments, and the methods of
FSDP2's FSDPModule on the ShardedModule (the root) and on each unit's submodule, whose class
becomes a subclass of its own with these methods, as FSDP2 swaps the classes of the modules it
shards. Each does what FSDP2's does under the same name, or refuses by name with what to use
instead (docs/porting.md, "FSDP2's module API", has the table).

Scope, as FSDP2's: `unshard`, `reshard`, `set_unshard_in_backward`, the prefetch lists and the
gradient divide factor act on the module's own unit (the root: the parameters outside every
unit); the `set_*` methods with `recurse` act on it and on every unit inside it (the root: all of
them)."""
import warnings
import weakref

import torch

__all__ = ["FSDPMethods", "HookOrder", "UnshardHandle", "fsdp2_options", "adopt_unit_modules",
           "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """unshard(async_op=True)'s handle, as FSDP2's: `wait()` until the parameters are unsharded
    (the next forward waits for it too)."""

    def __init__(self, wait=None):
        self._wait = wait

    def wait(self):
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()


def fsdp2_options(mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                  ignored_params, param_dtype):
    """fully_shard's FSDP2 arguments as ragshard's: (param_dtype, reshard_after_forward,
    cast_forward_inputs, output_dtype, ignored parameter ids, cpu offload asked). Raises
    ValueError naming an argument ragshard does not take, with what to use instead."""
    if mesh is not None:
        raise ValueError("fully_shard: mesh= is FSDP2's process-group mesh; ragshard's mesh is "
                         "the job's (its world size, and --replicate R at job creation for "
                         "HSDP), set by the planner: drop mesh=")
    if shard_placement_fn is not None:
        raise ValueError("fully_shard: shard_placement_fn= places FSDP2's per-tensor dim "
                         "shards; ragshard cuts each unit's flat buffer on whole granules "
                         "instead: pass granule=(lambda name, p: 'rows:128' | 'element' | "
                         "'whole')")
    if reshard_after_forward is None:
        reshard_after_forward = True  # FSDP2's None: True for units, False for the root
    cast_inputs, output_dtype = True, None
    if mp_policy is not None:
        dtypes = {None: None, torch.float32: "fp32", torch.bfloat16: "bf16"}
        want = mp_policy.param_dtype
        if want not in dtypes:
            raise ValueError(f"fully_shard: mp_policy.param_dtype {want} is not supported; "
                             "ragshard gathers torch.float32 or torch.bfloat16")
        if mp_policy.reduce_dtype not in (None, torch.float32):
            raise ValueError(f"fully_shard: mp_policy.reduce_dtype {mp_policy.reduce_dtype}: "
                             "ragshard's daemon reduces gradients in fp32 always; pass "
                             "reduce_dtype=torch.float32 (or None)")
        if dtypes[want] is not None:
            if param_dtype not in ("fp32", dtypes[want]):
                raise ValueError(f"fully_shard: param_dtype='{param_dtype}' and mp_policy's "
                                 f"{want} disagree; give one of them")
            param_dtype = dtypes[want]
        cast_inputs = bool(mp_policy.cast_forward_inputs)
        output_dtype = mp_policy.output_dtype
    offload = False
    if offload_policy is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy
        offload = isinstance(offload_policy, CPUOffloadPolicy)
    ignored = {id(p) for p in ignored_params or ()}
    return param_dtype, reshard_after_forward, cast_inputs, output_dtype, ignored, offload


def _units_under(sharded, module):
    """The units whose submodules lie in `module`'s subtree (all of them for the root)."""
    if module is sharded or module is sharded.module:
        return list(range(len(sharded._units)))
    inside = {id(m) for m in module.modules()}
    return [ui for ui, (_, subs, _) in enumerate(sharded._units.groups)
            if subs is not None and any(id(s) in inside for s in subs)]


def unit_of_module(sharded, module):
    """The unit of `module` (a unit's submodule, the root module or the ShardedModule: the root
    unit, None where every parameter is in a unit); TypeError for another module."""
    if module is sharded or module is sharded.module:
        return sharded._units.root
    for ui, (_, subs, _) in enumerate(sharded._units.groups):
        if subs is not None and any(s is module for s in subs):
            return ui
    raise TypeError(f"ragshard: {type(module).__name__} is not a unit of this fully_shard "
                    "module (one of units=(...)'s submodules, or the module itself)")


class FSDPMethods:
    """FSDP2's FSDPModule methods. `_ragshard_scope()` gives (the ShardedModule, this module's
    own unit or None, the units of its subtree)."""

    def _ragshard_scope(self):
        raise NotImplementedError

    def _units_of(self, recurse):
        sharded, own, under = self._ragshard_scope()
        return sharded, (under if recurse else [own] if own is not None else [])

    def unshard(self, async_op=False):
        """All-gathers this module's unit (the root: the parameters outside every unit); with
        `async_op`, starts it and returns an UnshardHandle whose wait() binds the parameters."""
        sharded, own, _ = self._ragshard_scope()
        if own is None:
            return UnshardHandle() if async_op else None
        gathers = sharded._gathers
        if not async_op:
            sharded._unit_hooks._unshard(own)
            return None
        gathers.start(own)
        return UnshardHandle(lambda: sharded._unit_hooks._unshard(own))

    def reshard(self):
        """Releases this module's unit's unsharded parameters (they hold no storage again)."""
        sharded, own, _ = self._ragshard_scope()
        if own is not None:
            sharded._gathers.reshard(own)

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backward passes accumulate this module's gradients unreduced (no_sync);
        True: the next backward reduce-scatters the sum into the gradient shards."""
        sharded, units = self._units_of(recurse)
        for ui in units:
            sharded._settings.sync[ui] = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: False skips the all-reduce over the replicas after the reduce-scatter (each
        replica accumulates its own sum; the next backward with it True averages them)."""
        sharded, units = self._units_of(recurse)
        for ui in units:
            sharded._settings.all_reduce[ui] = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """True, False, or n > 1 (reshard to groups of n local ranks), as fully_shard's."""
        from .module import check_reshard_after_forward
        check_reshard_after_forward(reshard_after_forward)
        sharded, units = self._units_of(recurse)
        for ui in units:
            sharded._settings.reshard_after_forward[ui] = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False keeps the units unsharded after their backward (no gather in the next
        micro-batch's forward); the next optimizer step reshards them, so no forward computes
        with parameters from before the step."""
        sharded, units = self._units_of(recurse)
        for ui in units:
            sharded._settings.reshard_after_backward[ui] = bool(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward):
        """False: this module's parameters are not needed by its backward (an embedding's),
        which then skips their gather."""
        sharded, own, _ = self._ragshard_scope()
        if own is not None:
            sharded._settings.unshard_in_backward[own] = bool(unshard_in_backward)

    def _prefetch_list(self, modules, kind):
        sharded, own, _ = self._ragshard_scope()
        units = [unit_of_module(sharded, m) for m in modules]
        if own is not None:
            getattr(sharded._settings, kind)[own] = [u for u in units if u is not None]

    def set_modules_to_forward_prefetch(self, modules):
        """The units whose unshard starts when this module's forward begins (instead of the
        next `prefetch` ones)."""
        self._prefetch_list(modules, "forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules):
        """The units whose unshard starts when this module's backward begins."""
        self._prefetch_list(modules, "backward_prefetch")

    def set_gradient_divide_factor(self, factor):
        """The reduction of this module's gradients divides their sum by `factor` instead of
        the world size (1: the sum)."""
        factor = float(factor)
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: {factor} is not a positive number")
        sharded, own, _ = self._ragshard_scope()
        if own is not None:
            sharded._settings.grad_scale[own] = sharded.world / factor

    def set_reduce_scatter_divide_factor(self, factor):
        warnings.warn("FSDPModule.set_reduce_scatter_divide_factor is deprecated and will be "
                      "removed in a future release. Use set_gradient_divide_factor instead.",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable):
        """Accepted: ragshard's reductions sum in fp32 and divide once, which is what this asks
        of NCCL's (no number changes)."""
        sharded, own, _ = self._ragshard_scope()
        if own is not None:
            sharded._settings.force_sum[own] = bool(enable)

    def set_is_last_backward(self, is_last_backward):
        """Accepted: every ragshard backward waits for its reductions and drops unused
        prefetches, which is what FSDP2 does on the last one."""
        sharded, _, _ = self._ragshard_scope()
        sharded._settings.is_last_backward = bool(is_last_backward)

    def set_post_optim_event(self, event):
        """The next unshard waits for `event` (the optimizer step's end)."""
        sharded, _, _ = self._ragshard_scope()
        sharded._settings.post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        """Accepted: ragshard's collectives always work in the daemon's pool buffers, what this
        asks FSDP2's to do."""

    def set_all_reduce_hook(self, hook, *, stream=None):
        raise NotImplementedError(
            "set_all_reduce_hook: ragshard's daemon runs the HSDP all-reduce of the gradient "
            "shards; skip it with set_requires_all_reduce(False), and work on the reduced "
            "gradients after the backward (p.grad, a ShardGrad) instead of in a hook")

    def set_custom_all_gather(self, comm):
        raise NotImplementedError(
            "set_custom_all_gather: ragshard's daemon runs the all-gathers into its pool "
            "buffers; for quantized gathers use fully_shard(..., quantize='int8' or 'fp8')")

    def set_custom_reduce_scatter(self, comm):
        raise NotImplementedError(
            "set_custom_reduce_scatter: ragshard's daemon runs the reduce-scatters (fp32 "
            "accumulation); use set_gradient_divide_factor for the scale")


class HookOrder:
    """Keeps ragshard's hooks in their places when the user registers one (ragshard's unshard
    before the user's forward pre-hooks, its reshard after the user's forward hooks, its backward
    pre-hook before the user's), as FSDP2's hooks are. `_ragshard_hooks()`: the UnitHooks, or
    None before they exist."""

    def _ragshard_hooks(self):
        raise NotImplementedError

    def _placed(self, handle):
        hooks = self._ragshard_hooks()
        if hooks is not None:
            hooks.prepare()
        return handle

    def register_forward_pre_hook(self, *args, **kwargs):
        return self._placed(super().register_forward_pre_hook(*args, **kwargs))

    def register_forward_hook(self, *args, **kwargs):
        return self._placed(super().register_forward_hook(*args, **kwargs))

    def register_full_backward_pre_hook(self, *args, **kwargs):
        return self._placed(super().register_full_backward_pre_hook(*args, **kwargs))

    def register_full_backward_hook(self, *args, **kwargs):
        return self._placed(super().register_full_backward_hook(*args, **kwargs))


class UnitModule(FSDPMethods, HookOrder):
    """Mixed into the class of each unit's submodule and of the wrapped module: FSDP2's methods,
    and ragshard's hooks kept in their places."""

    def _sharded(self):
        sharded = self.__dict__["_ragshard_of"][0]()
        if sharded is None:
            raise RuntimeError("ragshard: the fully_shard module of this unit is gone")
        return sharded

    def _ragshard_scope(self):
        sharded = self._sharded()
        return sharded, self.__dict__["_ragshard_of"][1], _units_under(sharded, self)

    def _ragshard_hooks(self):
        sharded = self.__dict__["_ragshard_of"][0]()
        return getattr(sharded, "_unit_hooks", None) if sharded is not None else None


_CLASSES = {}  # a module class -> its class under fully_shard


def _swap(module, sharded, ui):
    cls = type(module)
    if issubclass(cls, UnitModule):  # sharded before (a shrink's successor): its own class
        cls = cls.__bases__[1]
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (UnitModule, cls), {})
    module.__dict__["_ragshard_of"] = (weakref.ref(sharded), ui)
    module.__class__ = new


def adopt_unit_modules(sharded):
    """Gives each unit's submodules, and the wrapped module, FSDP2's methods (their classes
    become subclasses of their own, as FSDP2's fully_shard does)."""
    seen = set()
    for ui, (_, subs, _) in enumerate(sharded._units.groups):
        for sub in subs or ():
            _swap(sub, sharded, ui)
            seen.add(id(sub))
    if id(sharded.module) not in seen:  # (a module that is its own one unit keeps that unit)
        _swap(sharded.module, sharded, sharded._units.root)


def register_fsdp_forward_method(module, method_name):
    """FSDP2's register_fsdp_forward_method: `module.method_name(...)` (a method other than
    forward, e.g. generate) runs with the hooks of `module`'s forward: its unit unsharded before,
    resharded after; the root's when `module` is the root module or the ShardedModule."""
    scope = getattr(module, "_ragshard_scope", None)
    if scope is None:
        raise TypeError(f"register_fsdp_forward_method: {type(module).__name__} is not a "
                        "fully_shard module or one of its units")
    sharded, own, _ = scope()
    hooks = sharded._unit_hooks
    method = getattr(module, method_name)
    root = module is sharded or module is sharded.module

    def run(*args, **kwargs):
        if root:
            cast = hooks._root_pre_forward(module, args, kwargs)
            if cast is not None:
                args, kwargs = cast
            out = None
            try:
                out = method(*args, **kwargs)
            finally:
                done = hooks._root_post_forward(module, args, out)
            return done if done is not None else out
        if own is None:
            return method(*args, **kwargs)
        changed = hooks._pre_forward((own,), args, kwargs)
        if changed is not None:
            args, kwargs = changed
        out = method(*args, **kwargs)
        done = hooks._post_forward((own,), out)
        return done if done is not None else out
    object.__setattr__(module, method_name, run)


def share_comm_ctx(modules):
    """FSDP2's share_comm_ctx: accepted; every unit's collectives already run on the daemon's
    one context per job."""
