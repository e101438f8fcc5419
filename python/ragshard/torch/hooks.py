"""fully_shard's hooks, with the mechanisms FSDP2 uses (see the package docstring): unshard and
prefetch before a unit's forward and backward, reshard after, and the post-backward that
reduce-scatters a unit's gradients once the gradients of its inputs are computed.

With RAGSHARD_TRACE=DIR each rank records a timeline (DIR/rank<R>.json at exit): every operation
it waited for (issued, run by the daemon, waited; time.monotonic_ns(), the daemon's clock too),
each unit's forward and backward compute, and the start of each step's forward."""
import atexit
import json
import os
import time

import torch
from torch.utils import _pytree as pytree

from .views import as_tensor


class HooksMixin:
    """ShardedModule's forward and backward hooks."""

    def _install_hooks(self):
        root = len(self._units) - 1 if self._units and self._units[-1][1] is None else None
        self._root = root
        self.module.register_forward_pre_hook(self._root_pre_forward)
        for ui, (_, subs, params) in enumerate(self._units):
            if subs is None:
                continue
            # A group of units: gathered before the first runs, resharded after the last.
            subs[0].register_forward_pre_hook(
                lambda m, args, kwargs, ui=ui: self._pre_forward((ui,), args, kwargs),
                with_kwargs=True)
            subs[-1].register_forward_hook(
                lambda m, inp, out, ui=ui: self._post_forward((ui,), out))
        # Tied weights (ShardedModule._find_ties): a module that uses parameters of other units
        # gathers those units for its forward and its backward, and counts as one more forward
        # of each, so that their post-backward (one reduce-scatter) waits for this use's
        # gradients too.
        unit_of = {id(p): ui for ui, (_, _, params) in enumerate(self._units) for _, p in params}
        for sub, tied, inside in self._borrowers:
            owners = tuple(sorted({unit_of[id(p)] for p in tied}))
            sub.register_forward_pre_hook(
                lambda m, args, kwargs, o=owners: self._pre_forward(o, args, kwargs,
                                                                    prefetch=False),
                with_kwargs=True)
            sub.register_forward_hook(
                lambda m, inp, out, o=owners, r=inside: self._post_forward(o, out, reshard=r))
        for ui, (_, _, params) in enumerate(self._units):
            for _, p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda p, ui=ui: self._grad_ready(ui, p))
        self._forwards = [0] * len(self._units)  # forwards with autograd since the backward
        self._inputs_done = [0] * len(self._units)  # of them, those whose inputs' grads came
        self._reduced = set()

    def _start_trace(self, directory):
        """Records the timeline into the client's trace, written to DIRECTORY at exit."""
        self._computing = {}
        if not directory:
            return
        self.client.trace = []

        def write(client=self.client, path=os.path.join(directory, f"rank{self.client.rank}.json")):
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as f:
                json.dump({"units": [name for name, _, _ in self._units],
                           "events": client.trace}, f)
        atexit.register(write)

    def _compute_begins(self, phase, ui):
        if self.client.trace is not None:
            self._computing[(phase, ui)] = time.monotonic_ns()

    def _compute_ends(self, phase, ui):
        t0 = self._computing.pop((phase, ui), None) if self.client.trace is not None else None
        if t0 is not None:
            self.client.trace.append({"event": phase, "unit": ui, "start": t0,
                                      "end": time.monotonic_ns()})

    def _root_pre_forward(self, module, inputs):
        if self.client.trace is not None and torch.is_grad_enabled():
            self.client.trace.append({"event": "step", "t": time.monotonic_ns()})
        if self._root is not None:
            self._unshard(self._root)
        for j in range(self.prefetch):
            self._prefetch(j)

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
                self._unshard(ui)
            for j in range(1, self.prefetch + 1 if prefetch else 1):
                self._prefetch(units[0] + j)
            for ui in units:
                self._compute_begins("forward", ui)
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
            self._compute_ends("forward", ui)
            if not torch.is_grad_enabled():
                self._reshard(ui)  # no backward follows
                continue
            raf = self.reshard_after_forward if reshard else False
            if raf is True:
                self._reshard(ui)
            elif raf is not False:
                self._reshard(ui, keep=raf)  # the storage goes; the group keeps the unit
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
        self._unshard(ui)
        for j in range(1, self.prefetch + 1):
            self._prefetch(ui - j)  # the units whose backward comes next
        if not any(p.requires_grad for p, _, _ in self._views[ui]):
            return
        self._allocate_grads(ui)
        self._compute_begins("backward", ui)

    def _start_backward(self):
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _grad_ready(self, ui, p):
        self._start_backward()
        if ui in self._reduced and not self._no_sync:
            raise RuntimeError(
                f"ragshard: unit '{self._units[ui][0]}' received a gradient after its "
                "reduce-scatter in this backward pass; its gradients would be lost")
        self._used.add(self._index[id(p)])

    def _inputs_grad_ready(self, ui):
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
        self._compute_ends("backward", ui)
        self._reshard(ui)
        if self._no_sync:
            return
        self._allocate_grads(ui)  # a unit that got no gradient reduces zeros
        self._handles[("reduce", ui)] = self.client.reduce_scatter(ui, "avg")
        self.op_counts["reduce_scatter"][self._units[ui][0]] += 1
        if self.replicas > 1:
            # HSDP: the shard's average over the replicas, started now so that the daemon runs it
            # (after this unit's reduce-scatter, in order) while backward goes on.
            self._handles[("replicas", ui)] = self.client.all_reduce(ui, "avg")
        self._drop_grads(ui)

    def _finish_backward(self):
        for ui in range(len(self._units)):
            self._post_backward(ui)
        self._backward_started = False
        self._reduced = set()
        self._forwards = [0] * len(self._units)
        self._inputs_done = [0] * len(self._units)
        # Backward prefetches that no backward used.
        for key in [k for k in self._handles if k[0] == "unshard"]:
            self._handles.pop(key).wait()
            self._bind(key[1])
            self._reshard(key[1])
        self._q_drop_started()
        if not self._no_sync:
            self._reduce_used_flags()
        for key in [k for k in self._handles if k[0] in ("reduce", "replicas", "qreshard")]:
            self._handles.pop(key).wait()

    def _reduce_used_flags(self):
        """Every rank learns which parameters any rank's backward reached since the last
        reduction: each writes its flags (1.0 for used) into every rank's slot of the flags
        unit's gradient, so the reduced shard counts the ranks that used each parameter."""
        u, n = self._flags_unit, self._nparams
        self.client.allocate_grad(u).wait()
        slots = as_tensor(self.client.grad(u)).view(-1, self.grad_elems[u])
        if self._used:
            slots[:, list(self._used)] = 1.0
        self.client.reduce_scatter(u, "sum").wait()
        if self.replicas > 1:
            self.client.all_reduce(u, "sum").wait()
        counts = as_tensor(self.client.grad_shard(u))[:n]
        for i in torch.nonzero(counts > 0).flatten().tolist():
            self.has_grad[i] = True
        self._used = set()


def _recomputing():
    """True inside a backward pass with gradients enabled: a forward run there is activation
    checkpointing's recompute (torch.utils.checkpoint)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward, reached once the inputs' gradients are
    computed, is the unit's post-backward (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, module, units, *inputs):
        ctx.module, ctx.units = module, units
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        for ui in ctx.units:
            ctx.module._inputs_grad_ready(ui)
        return (None, None) + grads
