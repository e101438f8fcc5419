"""fully_shard's hooks, with the mechanisms FSDP2 uses (see the package docstring): unshard and
prefetch before a unit's forward and backward, reshard after, and the post-backward that
reduce-scatters a unit's gradients (adding them to what its gradient shard holds) once the
gradients of its inputs are computed.

Order against the user's hooks, as FSDP2's: the unshard before a unit's forward runs before
every forward pre-hook the user registers on it, whenever registered (ragshard's pre-hook is
prepended, and kept first: `order()`), and the reshard after its forward after every forward
hook of the user's; where the user registers full backward pre-hooks or backward hooks on a
unit, a backward pre-hook of ragshard's, first of them, unshards it for its backward, and the
post-backward runs once the gradients of its inputs are computed, after the user's backward
hooks. Tensor hooks the user registers on a unit's outputs come after ragshard's, registered when
its forward ended."""
import collections

import torch
from torch.utils import _pytree as pytree



class UnitHooks:
    """A ShardedModule's forward and backward hooks, installed at construction on `wrapper` (the
    ShardedModule) and `module` (the wrapped module), its units' submodules, the modules
    borrowing tied weights, and the parameters' gradient accumulation.

    `units`: the ModuleUnits; `gathers`: the UnitGathers that unshard and reshard; `binding`:
    the UnitBuffers that hold the gradients; `client`: the attached ragshard.Client (the
    reduce-scatters); `grad_use`: the GradUse that notes which parameters got a gradient;
    `grads`: the ShardGrads that become the parameters' .grad after a reduction; `trace`: the
    Trace; `settings`: the UnitSettings; `prefetch`: the default prefetch depth; `replicas`: the
    gradients' replicas (HSDP: all-reduced after each reduce-scatter); `pack`, `unpack`: the
    saved-tensor hooks that save a unit's parameters by place.

    Attributes: `reduce_scatters`, a Counter of the gradient reduce-scatters by unit name;
    `accumulating`, a Counter of those that added into a shard that held a gradient."""

    def __init__(self, wrapper, module, units, gathers, binding, client, grad_use, grads, trace,
                 settings, prefetch, replicas, pack, unpack):
        self._units, self._gathers, self._binding = units, gathers, binding
        self._client, self._grad_use, self._grads = client, grad_use, grads
        self._trace, self._settings = trace, settings
        self._prefetch, self._replicas = prefetch, replicas
        self._saved_hooks = (pack, unpack)
        self.reduce_scatters = collections.Counter()
        self.accumulating = collections.Counter()
        n = len(units)
        self._forwards = [0] * n  # forwards with autograd since the backward
        self._inputs_done = [0] * n  # of them, those whose inputs' grads came
        self._reduced = set()
        self._backward_started = False
        self._backward_begun = set()  # units whose backward pre-hook ran in this backward
        self._pending = {}  # (kind, unit) -> a reduce-scatter or all-reduce in flight
        # Whether each unit's gradient shard may hold a gradient (since the last zero_grad):
        # the next reduce-scatter then adds into it instead of replacing it.
        self.holds = [False] * n
        self._root_depth = 0  # nesting of the root's forward (the wrapper and the module)
        self._outside = []  # per unit call outside the root's forward: saved-tensor hooks pushed
        self._ours = []  # (module, kind, handle id): ragshard's hooks, kept in their places
        self._bw_hooked = set()  # id of each unit submodule given a backward pre-hook
        self._unhooked = []  # (unit, parameter) without the post-accumulate-grad hook yet
        self._install(wrapper, module)

    # -- installation and order ----------------------------------------------------------------

    def _keep(self, m, kind, handle):
        self._ours.append((m, kind, handle.id))

    def _install(self, wrapper, module):
        for m in (wrapper, module):
            self._keep(m, "pre", m.register_forward_pre_hook(self._root_pre_forward,
                                                             prepend=True, with_kwargs=True))
            self._keep(m, "post", m.register_forward_hook(self._root_post_forward,
                                                          always_call=True))
        for ui, (_, subs, _) in enumerate(self._units.groups):
            if subs is None:
                continue
            # A group of units: gathered before the first runs, resharded after the last.
            self._keep(subs[0], "pre", subs[0].register_forward_pre_hook(
                lambda m, args, kwargs, ui=ui: self._pre_forward((ui,), args, kwargs),
                prepend=True, with_kwargs=True))
            self._keep(subs[-1], "post", subs[-1].register_forward_hook(
                lambda m, inp, out, ui=ui: self._post_forward((ui,), out), always_call=True))
        # Tied weights (units.find_ties): a module that uses parameters of other units gathers
        # those units for its forward and its backward, and counts as one more forward of each,
        # so that their post-backward (one reduce-scatter) waits for this use's gradients too.
        unit_of = {id(p): ui for ui, (_, _, params) in enumerate(self._units.groups)
                   for _, p in params}
        for sub, tied, inside in self._units.borrowers:
            owners = tuple(sorted({unit_of[id(p)] for p in tied}))
            self._keep(sub, "pre", sub.register_forward_pre_hook(
                lambda m, args, kwargs, o=owners: self._pre_forward(o, args, kwargs,
                                                                    prefetch=False),
                prepend=True, with_kwargs=True))
            self._keep(sub, "post", sub.register_forward_hook(
                lambda m, inp, out, o=owners, r=inside: self._post_forward(o, out, reshard=r),
                always_call=True))
        self._unhooked = [(ui, p) for ui, (_, _, params) in enumerate(self._units.groups)
                          for _, p in params]
        self._hook_new_grads()

    def _hook_new_grads(self):
        """The post-accumulate-grad hook on every parameter that requires a gradient now and has
        none yet (requires_grad may change at any time, before or after wrapping)."""
        if not self._unhooked:
            return
        left = []
        for ui, p in self._unhooked:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, ui=ui: self._grad_ready(ui, p))
            else:
                left.append((ui, p))
        self._unhooked = left

    def _hook_backward_of_units(self):
        """A backward pre-hook of ragshard's, first, on each unit submodule that has backward
        hooks of the user's (its full backward pre-hooks see the unit unsharded)."""
        for ui, (_, subs, _) in enumerate(self._units.groups):
            for sub in subs or ():
                if id(sub) in self._bw_hooked or not (sub._backward_pre_hooks or
                                                      sub._backward_hooks):
                    continue
                self._bw_hooked.add(id(sub))
                self._keep(sub, "backward_pre", sub.register_full_backward_pre_hook(
                    lambda m, grad_output, ui=ui: self._pre_backward(ui), prepend=True))

    def order(self):
        """Puts ragshard's hooks back in their places: its pre-hooks first, its post-hooks last
        (after hooks the user registered since)."""
        for m, kind, hid in self._ours:
            hooks = {"pre": m._forward_pre_hooks, "post": m._forward_hooks,
                     "backward_pre": m._backward_pre_hooks}[kind]
            if hid not in hooks:
                continue
            if kind == "post":
                if next(reversed(hooks)) != hid:
                    hooks.move_to_end(hid)
            elif next(iter(hooks)) != hid:
                hooks.move_to_end(hid, last=False)

    def prepare(self):
        """Before a forward: ragshard's hooks in their places, and on what they must cover."""
        self._hook_new_grads()
        self._hook_backward_of_units()
        self.order()

    # -- settings --------------------------------------------------------------------------------

    @property
    def reduce_gradients(self):
        """False while no unit reduce-scatters its gradients (no_sync)."""
        return any(self._settings.sync)

    def zero_grad(self):
        """The gradient shards were zeroed: the next reduce-scatters replace them."""
        self.holds = [False] * len(self.holds)

    # -- forward ---------------------------------------------------------------------------------

    def _root_pre_forward(self, module, args, kwargs):
        self._root_depth += 1
        if self._root_depth > 1:
            return self._settings.cast_forward_inputs(args, kwargs)
        # Popped by the post-hook, which runs also when the forward raises (always_call).
        torch._C._autograd._push_saved_tensors_default_hooks(*self._saved_hooks)
        cast = self._settings.cast_forward_inputs(args, kwargs)
        self.prepare()
        if torch.is_grad_enabled():
            self._trace.step()
        root = self._units.root
        if root is not None:
            self._unshard(root)
        self._prefetch_forward(root, range(self._prefetch))
        return cast

    def _root_post_forward(self, module, args, out):
        self._root_depth -= 1
        if self._root_depth > 0:
            return None
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if out is None:
            return None  # the forward raised (always_call): nothing to hook
        out = self._settings.cast_output(out)
        root = self._units.root
        if root is not None and torch.is_grad_enabled():
            # The root's gradients are allocated before the first of them is computed.
            if self._settings.reshard_after_forward[root] is True:
                self._gathers.reshard(root)
            self._hook_backward(root, out)
        return out

    def _unshard(self, ui):
        event = self._settings.post_optim_event
        if event is not None:  # set_post_optim_event: the step's work, before the gather
            self._settings.post_optim_event = None
            event.synchronize()
        self._gathers.unshard(ui)

    def _prefetch_forward(self, ui, default):
        explicit = self._settings.forward_prefetch[ui] if ui is not None else None
        for j in explicit if explicit is not None else default:
            self._gathers.prefetch(j)

    def _pre_forward(self, units, args, kwargs, prefetch=True):
        """Before the forward of a unit (or of a module using tied `units`)."""
        cast = self._settings.cast_forward_inputs(args, kwargs)
        if cast is not None:
            args, kwargs = cast
        if self._root_depth == 0 and not _recomputing():
            # A unit called by itself, outside the root's forward: its parameters are saved for
            # backward by place too, and the user's hooks come after ragshard's.
            torch._C._autograd._push_saved_tensors_default_hooks(*self._saved_hooks)
            self._outside.append(units)
            self.prepare()
        if _recomputing():
            # Activation checkpointing recomputes the unit's forward inside the backward: the
            # unit is unsharded for it, with its gradient buffer (the hook on its outputs has
            # usually done both already), and stays so until its post-backward. After a
            # non-reentrant checkpoint's first forward, the backward runs through that
            # forward's graph, whose post-backward node is in place: the recompute is not
            # another forward (FSDP2 skips its hooks the same way). A reentrant checkpoint
            # ran the first forward without autograd, and the backward runs through the
            # recompute's graph: the recompute is the forward whose backward follows.
            for ui in units:
                self._pre_backward(ui)
                self._gathers.unshard(ui)  # (also where its backward needs no unshard)
            if all(self._forwards[ui] for ui in units):
                return cast
        else:
            for ui in units:
                self._unshard(ui)
            if prefetch:
                self._prefetch_forward(units[0], range(units[0] + 1,
                                                       units[0] + 1 + self._prefetch))
            for ui in units:
                self._trace.begins("forward", ui)
            if not torch.is_grad_enabled():
                return cast
        for ui in units:
            self._forwards[ui] += 1
        # The unit's post-backward runs once the gradients of these inputs are computed: after
        # every gradient of the unit's parameters, whichever of them this rank's data reached.
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not where:
            return cast  # the callback at the end of the backward pass runs it
        outs = _PostBackward.apply(self, units, *(flat[i] for i in where))
        for i, x in zip(where, outs):
            flat[i] = x
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, units, out, reshard=True):
        """After the forward of a unit (or of a module using tied `units`; `reshard` False
        keeps them unsharded for the backward)."""
        if self._outside and self._outside[-1] == units:
            self._outside.pop()
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if _recomputing() or out is None:
            return None  # the backward about to run needs the units (or the forward raised)
        for ui in units:
            self._trace.ends("forward", ui)
            if not torch.is_grad_enabled():
                self._gathers.reshard(ui)  # no backward follows
                continue
            raf = self._settings.reshard_after_forward[ui] if reshard else False
            if raf is True:
                self._gathers.reshard(ui)
            elif raf is not False:
                self._gathers.reshard(ui, keep=raf)  # the storage goes; the group keeps it
            self._hook_backward(ui, out)
        return out

    # -- backward --------------------------------------------------------------------------------

    def _hook_backward(self, ui, out):
        tensors = [o for o in pytree.tree_leaves(out) if torch.is_tensor(o) and o.requires_grad]
        if tensors:
            # Once per backward through this forward's outputs, before the unit's gradients.
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grad, ui=ui: self._pre_backward(ui), mode="any")

    def _pre_backward(self, ui):
        self._start_backward()
        if ui in self._backward_begun:
            return
        self._backward_begun.add(ui)
        if self._settings.unshard_in_backward[ui]:
            self._unshard(ui)
        explicit = self._settings.backward_prefetch[ui]
        for j in explicit if explicit is not None else \
                range(ui - 1, ui - 1 - self._prefetch, -1):
            self._gathers.prefetch(j)  # the units whose backward comes next
        if not any(p.requires_grad for p, _, _ in self._units.views[ui]):
            return
        self._binding.allocate_grads(ui)
        self._trace.begins("backward", ui)

    def _start_backward(self):
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _grad_ready(self, ui, p):
        self._start_backward()
        if ui in self._reduced and self._settings.sync[ui]:
            raise RuntimeError(
                f"ragshard: unit '{self._units.name(ui)}' received a gradient after its "
                "reduce-scatter in this backward pass; its gradients would be lost")
        self._grad_use.mark(self._units.index_of(p))

    def inputs_grad_ready(self, ui):
        """The backward of one forward of unit `ui` reached its inputs."""
        self._inputs_done[ui] += 1
        if self._inputs_done[ui] == self._forwards[ui]:
            self._post_backward(ui)

    def _post_backward(self, ui):
        """Reshards unit `ui` (unless set_reshard_after_backward(False)) and reduce-scatters its
        gradients into its gradient shard, adding to what it holds, which releases them (where
        its gradient sync is off they stay, accumulating)."""
        if ui in self._reduced:
            return
        self._reduced.add(ui)
        self._trace.ends("backward", ui)
        s = self._settings
        if s.reshard_after_backward[ui]:
            self._gathers.reshard(ui)
        if not s.sync[ui]:
            return
        self._binding.allocate_grads(ui)  # a unit that got no gradient reduces zeros
        if s.grad_scale[ui] != 1.0:  # set_gradient_divide_factor: the mean's scale changed
            self._binding.scale_grads(ui, s.grad_scale[ui])
        name = self._units.name(ui)
        self._pending[("reduce", ui)] = self._client.reduce_scatter(ui, "avg",
                                                                    accumulate=self.holds[ui])
        self.reduce_scatters[name] += 1
        self.accumulating[name] += self.holds[ui]
        self.holds[ui] = True
        if self._replicas > 1 and s.all_reduce[ui]:
            # HSDP: the shard's average over the replicas, started now so that the daemon runs it
            # (after this unit's reduce-scatter, in order) while backward goes on. A shard that
            # skipped it (set_requires_all_reduce(False)) holds this replica's sum so far, which
            # the next one averages with the rest.
            self._pending[("replicas", ui)] = self._client.all_reduce(ui, "avg")
        self._binding.drop_grads(ui)

    def _finish_backward(self):
        n = len(self._units)
        for ui in range(n):
            self._post_backward(ui)
        reduced = [ui for ui in range(n) if self._settings.sync[ui]]
        self._backward_started = False
        self._reduced = set()
        self._backward_begun = set()
        self._forwards = [0] * n
        self._inputs_done = [0] * n
        self._gathers.drop_prefetches()  # backward prefetches that no backward used
        if reduced:
            self._grad_use.reduce()
        for key in list(self._pending):
            self._pending.pop(key).wait()
        self._gathers.wait_releases()
        self._grads.publish(reduced)


def _recomputing():
    """True inside a backward pass with gradients enabled: a forward run there is activation
    checkpointing's recompute (torch.utils.checkpoint)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward, reached once the inputs' gradients are
    computed, is the unit's post-backward (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, hooks, units, *inputs):
        ctx.hooks, ctx.units = hooks, units
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        for ui in ctx.units:
            ctx.hooks.inputs_grad_ready(ui)
        return (None, None) + grads
