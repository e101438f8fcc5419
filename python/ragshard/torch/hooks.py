"""fully_shard's hooks, with the mechanisms FSDP2 uses (see the package docstring): unshard and
prefetch before a unit's forward and backward, reshard after, and the post-backward that
reduce-scatters a unit's gradients once the gradients of its inputs are computed."""
import collections

import torch
from torch.utils import _pytree as pytree


class UnitHooks:
    """A ShardedModule's forward and backward hooks, installed at construction on `module` (the
    wrapped module), its units' submodules, the modules borrowing tied weights, and the
    parameters' gradient accumulation.

    `units`: the ModuleUnits; `gathers`: the UnitGathers that unshard and reshard; `binding`:
    the UnitBuffers that hold the gradients; `client`: the attached ragshard.Client (the
    reduce-scatters); `grad_use`: the GradUse that notes which parameters got a gradient;
    `trace`: the Trace; `reshard_after_forward` and `prefetch`: fully_shard's options;
    `replicas`: the gradients' replicas (HSDP: all-reduced after each reduce-scatter).

    Attributes: `reduce_gradients`, False under no_sync (backward passes accumulate into the
    gradient buffers); `reduce_scatters`, a Counter of the gradient reduce-scatters by unit
    name."""

    def __init__(self, module, units, gathers, binding, client, grad_use, trace,
                 reshard_after_forward, prefetch, replicas):
        self._units, self._gathers, self._binding = units, gathers, binding
        self._client, self._grad_use, self._trace = client, grad_use, trace
        self._raf, self._prefetch, self._replicas = reshard_after_forward, prefetch, replicas
        self.reduce_gradients = True
        self.reduce_scatters = collections.Counter()
        n = len(units)
        self._forwards = [0] * n  # forwards with autograd since the backward
        self._inputs_done = [0] * n  # of them, those whose inputs' grads came
        self._reduced = set()
        self._backward_started = False
        self._pending = {}  # (kind, unit) -> a reduce-scatter or all-reduce in flight
        self._install(module)

    def _install(self, module):
        module.register_forward_pre_hook(self._root_pre_forward)
        for ui, (_, subs, params) in enumerate(self._units.groups):
            if subs is None:
                continue
            # A group of units: gathered before the first runs, resharded after the last.
            subs[0].register_forward_pre_hook(
                lambda m, args, kwargs, ui=ui: self._pre_forward((ui,), args, kwargs),
                with_kwargs=True)
            subs[-1].register_forward_hook(
                lambda m, inp, out, ui=ui: self._post_forward((ui,), out))
        # Tied weights (units.find_ties): a module that uses parameters of other units gathers
        # those units for its forward and its backward, and counts as one more forward of each,
        # so that their post-backward (one reduce-scatter) waits for this use's gradients too.
        unit_of = {id(p): ui for ui, (_, _, params) in enumerate(self._units.groups)
                   for _, p in params}
        for sub, tied, inside in self._units.borrowers:
            owners = tuple(sorted({unit_of[id(p)] for p in tied}))
            sub.register_forward_pre_hook(
                lambda m, args, kwargs, o=owners: self._pre_forward(o, args, kwargs,
                                                                    prefetch=False),
                with_kwargs=True)
            sub.register_forward_hook(
                lambda m, inp, out, o=owners, r=inside: self._post_forward(o, out, reshard=r))
        for ui, (_, _, params) in enumerate(self._units.groups):
            for _, p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda p, ui=ui: self._grad_ready(ui, p))

    def _root_pre_forward(self, module, inputs):
        if torch.is_grad_enabled():
            self._trace.step()
        if self._units.root is not None:
            self._gathers.unshard(self._units.root)
        for j in range(self._prefetch):
            self._gathers.prefetch(j)

    def after_root_forward(self, out):
        """After the wrapped module's forward with autograd: the root's gradients are allocated
        before the first of them is computed."""
        if self._units.root is not None:
            self._hook_backward(self._units.root, out)

    def _pre_forward(self, units, args, kwargs, prefetch=True):
        """Before the forward of a unit (or of a module using tied `units`)."""
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
            if all(self._forwards[ui] for ui in units):
                return None
        else:
            for ui in units:
                self._gathers.unshard(ui)
            for j in range(1, self._prefetch + 1 if prefetch else 1):
                self._gathers.prefetch(units[0] + j)
            for ui in units:
                self._trace.begins("forward", ui)
            if not torch.is_grad_enabled():
                return None
        for ui in units:
            self._forwards[ui] += 1
        # The unit's post-backward runs once the gradients of these inputs are computed: after
        # every gradient of the unit's parameters, whichever of them this rank's data reached.
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not where:
            return None  # the callback at the end of the backward pass runs it
        outs = _PostBackward.apply(self, units, *(flat[i] for i in where))
        for i, x in zip(where, outs):
            flat[i] = x
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, units, out, reshard=True):
        """After the forward of a unit (or of a module using tied `units`; `reshard` False
        keeps them unsharded for the backward)."""
        if _recomputing():
            return out  # the backward about to run needs the units
        for ui in units:
            self._trace.ends("forward", ui)
            if not torch.is_grad_enabled():
                self._gathers.reshard(ui)  # no backward follows
                continue
            raf = self._raf if reshard else False
            if raf is True:
                self._gathers.reshard(ui)
            elif raf is not False:
                self._gathers.reshard(ui, keep=raf)  # the storage goes; the group keeps it
            self._hook_backward(ui, out)
        return out

    def _hook_backward(self, ui, out):
        tensors = [o for o in pytree.tree_leaves(out) if torch.is_tensor(o) and o.requires_grad]
        if tensors:
            # Once per backward through this forward's outputs, before the unit's gradients.
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grad, ui=ui: self._pre_backward(ui), mode="any")

    def _pre_backward(self, ui):
        self._start_backward()
        self._gathers.unshard(ui)
        for j in range(1, self._prefetch + 1):
            self._gathers.prefetch(ui - j)  # the units whose backward comes next
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
        if ui in self._reduced and self.reduce_gradients:
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
        """Reshards unit `ui` and reduce-scatters its gradients, which releases them (under
        no_sync they stay, accumulating)."""
        if ui in self._reduced:
            return
        self._reduced.add(ui)
        self._trace.ends("backward", ui)
        self._gathers.reshard(ui)
        if not self.reduce_gradients:
            return
        self._binding.allocate_grads(ui)  # a unit that got no gradient reduces zeros
        self._pending[("reduce", ui)] = self._client.reduce_scatter(ui, "avg")
        self.reduce_scatters[self._units.name(ui)] += 1
        if self._replicas > 1:
            # HSDP: the shard's average over the replicas, started now so that the daemon runs it
            # (after this unit's reduce-scatter, in order) while backward goes on.
            self._pending[("replicas", ui)] = self._client.all_reduce(ui, "avg")
        self._binding.drop_grads(ui)

    def _finish_backward(self):
        n = len(self._units)
        for ui in range(n):
            self._post_backward(ui)
        self._backward_started = False
        self._reduced = set()
        self._forwards = [0] * n
        self._inputs_done = [0] * n
        self._gathers.drop_prefetches()  # backward prefetches that no backward used
        if self.reduce_gradients:
            self._grad_use.reduce()
        for key in list(self._pending):
            self._pending.pop(key).wait()
        self._gathers.wait_releases()


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
