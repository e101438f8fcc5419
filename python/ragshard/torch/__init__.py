"""fully_shard for PyTorch on ragshard.

    import ragshard, ragshard.torch as rt
    client = ragshard.connect()
    model = rt.fully_shard(model, client, units=lambda m: list(m.layers))
    opt = rt.ShardedAdamW(model, lr=1e-3, weight_decay=0.01)
    for batch in data:
        loss = model(batch).mean(); loss.backward()
        model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

One FSDP unit per submodule chosen by the policy `units(module)`; parameters outside every unit
form a last unit, "root" (as FSDP's root module). What persists is the daemon's shards: each
rank's parameter shard and gradient shard, on which the optimizers work. A unit's parameters are
views into its unsharded buffer only while it is unsharded (from `unshard` to `reshard`); in
between they hold no storage, as FSDP1's do, so a use outside the unit's forward is an error,
never a read of released memory. Its `.grad` are views into this rank's unsharded gradient
buffer from the start of its backward (AccumulateGrad adds into them in place) to its
reduce-scatter, and None otherwise. Nothing is copied in or out of the collectives.

Hooks, with the mechanisms FSDP2 uses:
* forward pre-hook: unshard the unit (and prefetch the next ones), and pass the unit's inputs
  that require gradients through an identity autograd function whose backward is the unit's
  post-backward (FSDP2's RegisterPostBackwardFunction);
* forward post-hook: reshard when `reshard_after_forward`, and register a multi-grad hook
  (`torch.autograd.graph.register_multi_grad_hook`, mode "any") on the unit's outputs so that
  the backward pass unshards it again (prefetching the unit before it), and allocates its
  gradient buffer, before its gradients are computed; tensors that autograd saves from a unit's
  parameters are packed as (unit, offset) by `torch.autograd.graph.saved_tensors_hooks` and
  unpacked from the unit's buffer of the moment, since a re-unshard may place it elsewhere;
* post-backward: once the gradients of the unit's inputs are computed (for each forward of
  the unit since the last backward), the unit is resharded and its gradients reduce-scattered
  (avg) into the gradient shard, which releases them. Which parameters got a gradient does not
  matter: those that got none contribute zeros. A callback queued at the end of the backward
  pass does the same, in unit order, for the units whose inputs needed no gradient (or that
  did not run), then reduces the used-parameter flags and waits. Every rank therefore issues
  the same operations in the same order, whatever its data reached.

Gradients with PyTorch's meaning: `zero_grad(set_to_none=True)` (the default, on the module
and on the optimizers) forgets which parameters have a gradient; after a backward, a parameter
has one if any rank's backward reached it (the ranks OR their flags through a small
reduce-scatter, DDP's rule for unused parameters). The optimizers step only parameters that
have a gradient; with `set_to_none=False` a parameter keeps its (zeroed) gradient and is
stepped with zero, as torch.optim does.

Mixed precision: `param_dtype="bf16"` gathers and computes in bf16 with fp32 master shards in
the optimizer, gradients reduced in fp32 (FSDP2's MixedPrecisionPolicy(bf16, fp32)); the
default is fp32 throughout.
"""
import collections
import contextlib
import json
import math
import os

import torch

from torch.utils import _pytree as pytree

from .. import plan_of, quant
from .._core import plan_local
from .optim import ShardedAdamW, ShardedMuon, newton_schulz
from .params import Saved, adopt, set_live, storageless
from .views import as_tensor

__all__ = ["fully_shard", "ShardedModule", "ShardedAdamW", "ShardedMuon", "newton_schulz"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tensor(array, dtype):
    """A torch tensor of `dtype` ("fp32" or "bf16") over a numpy view of a daemon buffer,
    without copying. numpy has no bfloat16: bf16 buffers arrive as uint16 arrays and are
    viewed as bfloat16."""
    t = as_tensor(array)
    want = _DTYPES[dtype]
    if t.dtype == want:
        return t
    if t.element_size() != want.itemsize:
        raise RuntimeError(f"a daemon buffer of {t.dtype} cannot hold {dtype} elements")
    return t.view(want)


class ShardedModule(torch.nn.Module):
    """`module` with its parameters in ragshard buffers; see the module docstring."""

    def __init__(self, module, client, units, granule=None, optimizer=None, param_dtype="fp32",
                 reshard_after_forward=True, prefetch=None, register=True, quantize=None,
                 world=None):
        super().__init__()
        if param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype: '{param_dtype}' is not one of fp32, bf16")
        if quantize not in (None, "int8", "fp8"):
            raise ValueError(f"quantize: '{quantize}' is not one of None, int8, fp8")
        if quantize and param_dtype != "fp32":
            raise ValueError("quantize: needs param_dtype fp32 (fp32 masters, quantized gathers)")
        self.quantize = quantize
        self.module = module
        self.client = client
        self.param_dtype = param_dtype
        # FSDP2's meanings: True reshards after forward, False keeps the unit unsharded until
        # its backward, an int n > 1 reshards to groups of n local ranks (the ranks per node:
        # the backward's unshard then stays within the node).
        if reshard_after_forward is not True and reshard_after_forward is not False and (
                not isinstance(reshard_after_forward, int) or reshard_after_forward < 1):
            raise ValueError(f"reshard_after_forward: {reshard_after_forward!r} is not True, "
                             "False or a positive int")
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self._no_sync = False
        granule = granule or (lambda name, p: "rows:128" if p.dim() >= 2 else "element")
        optimizer = optimizer or (lambda name, p: "elementwise")
        names = {id(p): n for n, p in module.named_parameters()}
        # Units: the policy's submodules, then "root" for the parameters left over.
        seen = set()
        self._units = []  # (name, module or None, [(fqn, param)])
        for sub in units(module):
            sub_name = next((n for n, m in module.named_modules() if m is sub), None)
            if sub_name is None:
                raise ValueError(f"fully_shard: unit {type(sub).__name__} is not a submodule of "
                                 "the module")
            if type(sub).forward is torch.nn.Module.forward:
                # A container (ModuleList, ModuleDict): its forward is never called, so its
                # hooks would never gather it.
                raise ValueError(
                    f"fully_shard: unit '{sub_name}' is a {type(sub).__name__}, whose forward is "
                    f"never called (its children are called one by one); pass its children as "
                    f"units instead, e.g. units=lambda m: list(m.{sub_name or 'layers'})")
            params = [(names[id(p)], p) for p in sub.parameters() if id(p) not in seen]
            seen.update(id(p) for _, p in params)
            if params:
                self._units.append((sub_name, sub, params))
        rest = [(n, p) for n, p in module.named_parameters() if id(p) not in seen]
        if rest:
            self._units.append(("root", None, rest))
        # A unit of W fp32 elements for scalar all-reductions (gradient clipping), and one of
        # W x P for the used-parameter flags of P parameters (each rank's shard of the sum is
        # the count of ranks that used each parameter).
        world = world or int(os.environ.get("RAGSHARD_WORLD_SIZE") or
                             os.environ.get("WORLD_SIZE") or 0) or None
        self._nparams = sum(len(params) for _, _, params in self._units)
        if quantize and not world:
            raise ValueError("quantize: the world size is needed before registering (world=)")
        inventory = {"units": []}
        for uname, _, params in self._units:
            inventory["units"].append({"name": uname, "tensors": [
                {"name": n, "shape": list(p.shape), "dtype": param_dtype,
                 "granule": granule(n, p) if p.dim() >= 2 else "element",
                 "optimizer": optimizer(n, p) if p.dim() == 2 else "elementwise"}
                for n, p in params]})
        inventory["units"].append({"name": "__ragshard_scalars__", "tensors": [
            {"name": "__ragshard_scalars__.norm", "shape": [world or 1], "dtype": "fp32"}]})
        inventory["units"].append({"name": "__ragshard_used__", "tensors": [
            {"name": "__ragshard_used__.flags", "shape": [(world or 1) * max(self._nparams, 1)],
             "dtype": "fp32"}]})
        # Quantized gathers: one byte unit per unit, sized from the plan the planner will make
        # (planning is deterministic): rank r's slice holds the codes of its shard (a byte per
        # element) and then one fp32 scale per block of its shard.
        self._q = {}
        if quantize:
            local = json.loads(plan_local(json.dumps(inventory), world))
            for ui, up in enumerate(local["units"][:len(self._units)]):
                s = int(up["shard_elems"])
                blocks = max(quant.shard_block_ids(up, r, s)[1] for r in range(world))
                s4 = (s + 3) // 4 * 4
                sq = (s4 + 4 * blocks + 15) // 16 * 16
                self._q[ui] = {"S": s, "S4": s4, "SQ": sq, "B": blocks,
                               "index": len(inventory["units"])}
                inventory["units"].append({"name": up["unit"] + ".__q", "tensors": [
                    {"name": up["unit"] + ".__q.bytes", "shape": [world * sq],
                     "dtype": "uint8"}]})
        if register:
            client.register(json.dumps(inventory), True)
        client.attach()
        self.plan = plan_of(client)
        self._group_units()
        if self.prefetch is None:
            # Policy auto chose a prefetch depth with the rest of the strategy; else 1.
            executed = self.plan.get("strategy", {}).get("executed", "")
            self.prefetch = 0 if "prefetch=0" in executed.split(",") else 1
        # The number of units unsharded ahead of the one in use (True is 1): with the unit in
        # use, the bound on units in flight.
        self.prefetch = int(self.prefetch)
        if self.prefetch < 0:
            raise ValueError(f"prefetch: {self.prefetch} is negative")
        self.world = client.world_size
        self.rank = client.rank
        # HSDP: the plan is for a shard group of `world` ranks, repeated `replicas` times; this
        # rank holds shard position `pos` of its group.
        self.replicas = client.replicas
        self.pos = self.rank % self.world
        by_name, packed = {}, {}
        for ui, up in enumerate(self.plan["units"]):
            owned = {}  # an owner's matrices, packed in plan order in its owner buffer
            for t in up["tensors"]:
                by_name[t["name"]] = (ui, int(t["offset"]), int(t["numel"]), t)
                if t.get("optimizer") == "OPTIMIZER_MATRIX":
                    owner = int(t.get("owner_rank", -1))
                    packed[t["name"]] = owned.get(owner, 0)
                    owned[owner] = packed[t["name"]] + int(t["numel"])
        self._scalar_unit = len(self._units)
        self._flags_unit = len(self._units) + 1
        self.shard_elems = [client.shard_elems(u) for u in range(len(self.plan["units"]))]
        # This rank writes its own shard; the parameters become views of the unsharded buffers
        # while their unit is unsharded.
        self.matrices = []  # _Matrix of each matrix tensor
        self._pieces = {}  # unit -> [_Piece]: the parameters' pieces in this rank's shard
        # Which parameters have a gradient, by index in unit order (PyTorch's grad not None),
        # the same on every rank; and those this rank's backward reached since the last
        # reduction of the flags.
        self.has_grad = [False] * self._nparams
        self._used = set()
        self._views = {}  # unit -> [(param, offset, numel)]
        self._full = {}  # unit -> its unsharded buffer, while unsharded
        self._by_storage = {}  # the data address of an unsharded buffer -> its unit
        self._grads = set()  # units whose gradient buffers are allocated
        self._empty = {}  # unit -> its parameters' shapes as tensors with no storage
        # fp32 master shards kept by the module: bf16 parameters, or quantized gathers (whose
        # unsharded buffer holds dequantized values). The optimizers step them.
        masters = {}
        self._index = {}  # id(parameter) -> its index in unit order
        for ui, (uname, _, params) in enumerate(self._units):
            if self.plan["units"][ui]["unit"] != uname:
                raise RuntimeError(f"plan unit {ui} is {self.plan['units'][ui]['unit']}, "
                                   f"expected {uname}")
            shard = _tensor(client.param_shard(ui), param_dtype)
            s = self.shard_elems[ui]
            lo, hi = self.pos * s, (self.pos + 1) * s
            # With a parameter dtype below fp32, the optimizer's fp32 master shard starts from
            # the exact initial values (as FSDP2's sharded parameters), not from their rounding.
            exact = torch.zeros(s) if param_dtype != "fp32" else None
            self._views[ui] = []
            self._pieces[ui] = []
            for n, p in params:
                _, off, numel, t = by_name[n]
                index = len(self._index)
                self._index[id(p)] = index
                matrix = t.get("optimizer") == "OPTIMIZER_MATRIX"
                a, b = max(off, lo), min(off + numel, hi)
                if a < b:
                    mine = p.detach().reshape(-1)[a - off:b - off]
                    shard[a - lo:b - lo].copy_(mine.to(shard.dtype))
                    if exact is not None:
                        exact[a - lo:b - lo] = mine.float()
                    self._pieces[ui].append(_Piece(index, a - lo, b - lo, matrix))
                self._views[ui].append((p, off, numel))
                p.grad = None
                adopt(p, n, uname)
                if matrix:
                    self.matrices.append(_Matrix(ui, off, numel, tuple(p.shape),
                                                 int(t.get("owner_rank", -1)), packed[n], index))
            if exact is not None:
                masters[ui] = exact
            self._empty[ui] = [storageless(p.shape, _DTYPES[param_dtype]) for p, _, _ in
                               self._views[ui]]
            self._free(ui)
        self.masters = masters
        if self.shard_elems[self._flags_unit] < self._nparams:
            raise ValueError("fully_shard: the world size is needed before registering (pass "
                             "world=, or set RAGSHARD_WORLD_SIZE)")
        for ui, q in self._q.items():
            if self.shard_elems[ui] != q["S"] or \
                    self.shard_elems[q["index"]] != q["SQ"]:
                raise RuntimeError(
                    f"quantize: the job's plan differs from the local plan for unit {ui} "
                    f"(shard {self.shard_elems[ui]} vs {q['S']}); create the job with the "
                    "default policy (ragged) and alignment")
            ids = [quant.shard_block_ids(self.plan["units"][ui], r, q["S"])[0]
                   for r in range(self.world)]
            q["own_ids"] = ids[self.pos]
            q["all_ids"] = torch.cat([torch.where(i >= 0, i + r * q["B"], i)
                                      for r, i in enumerate(ids)])
            # The exact fp32 master of this rank's shard: the unsharded buffer's slots hold
            # dequantized values once a quantized gather has run.
            self.masters[ui] = as_tensor(client.param_shard(ui)).clone()
        self.gathered_bytes = {"quantized": 0, "full": 0}
        self.checkpoint_writing = None  # an asynchronous checkpoint save writing the state
        self._handles = {}
        self._backward_started = False
        self._install_hooks()

    def _group_units(self):
        """Policy auto may cover several consecutive units with one plan unit (its "members"):
        such a group is gathered before its first member's forward, resharded after its last
        member's, and reduce-scattered once every parameter of the group has its gradient."""
        groups, i = [], 0
        plan_units = self.plan["units"]
        for up in plan_units:
            if i >= len(self._units):
                break
            members = list(up.get("members") or [up["unit"]])
            here = [u[0] for u in self._units[i:i + len(members)]]
            if here != members:
                raise RuntimeError(f"plan unit {up['unit']} covers {members}; this module's units "
                                   f"there are {here} (do all ranks wrap the same model?)")
            if len(members) > 1 and self._q:
                raise ValueError("quantize: needs one plan unit per module unit; create the job "
                                 "with policy ragged")
            subs = [u[1] for u in self._units[i:i + len(members)]]
            params = [p for u in self._units[i:i + len(members)] for p in u[2]]
            groups.append((up["unit"], None if subs[0] is None else subs, params))
            i += len(members)
        if i != len(self._units):
            raise RuntimeError(f"the plan covers {i} of this module's {len(self._units)} units")
        self._units = groups

    # -- buffers -----------------------------------------------------------------------------

    def _bind(self, ui):
        """Points unit `ui`'s parameters into its unsharded buffer (once it is unsharded)."""
        full = _tensor(self.client.unsharded(ui), self.param_dtype)
        self._full[ui] = full
        self._by_storage[full.untyped_storage().data_ptr()] = ui
        for p, off, numel in self._views[ui]:
            p.data = full[off:off + numel].view(p.shape)
            set_live(p, True)

    def _free(self, ui):
        """Leaves unit `ui`'s parameters without storage (once it is resharded)."""
        full = self._full.pop(ui, None)
        if full is not None:
            self._by_storage.pop(full.untyped_storage().data_ptr(), None)
        for (p, _, _), empty in zip(self._views[ui], self._empty[ui]):
            set_live(p, False)
            p.data = empty

    def _bind_grads(self, ui):
        """Points unit `ui`'s .grad into this rank's gradient buffer (once allocated)."""
        grad = _tensor(self.client.grad(ui), self.param_dtype)
        self._grads.add(ui)
        for p, off, numel in self._views[ui]:
            if p.requires_grad:
                p.grad = grad[off:off + numel].view(p.shape)

    def _drop_grads(self, ui):
        self._grads.discard(ui)
        for p, _, _ in self._views[ui]:
            p.grad = None

    def _allocate_grads(self, ui):
        if ui not in self._grads:
            self.client.allocate_grad(ui).wait()
        self._bind_grads(ui)  # again after zero_grad(set_to_none=True) under no_sync

    def _reshard(self, ui, keep=0):
        if ui in self._full:
            self.client.reshard(ui, 0 if ui in self._q else keep).wait()
            self._free(ui)

    def _pack(self, t):
        """saved_tensors_hooks: a tensor that lies in a unit's unsharded buffer is saved as its
        place in the unit, since backward may find the unit unsharded at another address."""
        try:
            ui = self._by_storage.get(t.untyped_storage().data_ptr())
        except RuntimeError:
            return t
        if ui is None:
            return t
        return Saved(ui, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, x):
        if not isinstance(x, Saved):
            return x
        full = self._full.get(x.unit)
        if full is None:
            raise RuntimeError(f"ragshard: backward needs the parameters of unit "
                               f"'{self._units[x.unit][0]}' while it is resharded (was its "
                               "backward reached without its forward's outputs?)")
        return full.as_strided(x.size, x.stride, x.offset)

    # -- hooks -------------------------------------------------------------------------------

    def _unshard(self, ui):
        if ui in self._full:
            return
        if ui in self._q:
            self.unshard(ui, self.quantize)
            return
        h = self._handles.pop(("unshard", ui), None) or self.client.unshard(ui)
        h.wait()
        self._bind(ui)

    def unshard(self, ui, quantize=None):
        """All-gathers unit `ui`; with quantize="int8" or "fp8" each rank sends its shard as
        block-quantized codes and scales (about a quarter of the bytes) and every rank
        dequantizes the whole unit into the unsharded buffer."""
        q = self._q.get(ui)
        if quantize is None or q is None:
            if quantize is not None:
                raise ValueError(f"unit {ui} was not set up for quantized gathers")
            self.client.unshard(ui).wait()
            self._bind(ui)
            return
        if quantize != self.quantize:
            raise ValueError(f"quantize: this module gathers {self.quantize}, not {quantize}")
        codes, scales = quant.quantize(self.masters[ui], q["own_ids"], q["B"], quantize)
        qi = q["index"]
        mine = as_tensor(self.client.param_shard(qi))
        mine[:q["S"]] = codes.view(torch.uint8)
        if q["B"]:
            mine[q["S4"]:q["S4"] + 4 * q["B"]] = scales.contiguous().view(torch.uint8)
        self.client.unshard(qi).wait()
        allq = as_tensor(self.client.unsharded(qi)).view(self.world, q["SQ"])
        codes_all = allq[:, :q["S"]].reshape(-1)
        scales_all = allq[:, q["S4"]:q["S4"] + 4 * q["B"]].contiguous().view(
            torch.float32).reshape(-1)
        self.client.allocate_unsharded(ui).wait()
        full = as_tensor(self.client.unsharded(ui))
        full.copy_(quant.dequantize(codes_all, scales_all, q["all_ids"], quantize))
        self.client.reshard(qi).wait()
        self._bind(ui)
        self.gathered_bytes["quantized"] += self.world * q["SQ"]
        self.gathered_bytes["full"] += self.world * q["S"] * 4

    def _prefetch(self, ui):
        if self._q or not self.prefetch:
            return  # quantized gathers run when the unit needs them
        if 0 <= ui < len(self._units) and ui != self._root and ui not in self._full and \
                ("unshard", ui) not in self._handles:
            self._handles[("unshard", ui)] = self.client.unshard(ui)

    def _install_hooks(self):
        root = len(self._units) - 1 if self._units and self._units[-1][1] is None else None
        self._root = root
        self.module.register_forward_pre_hook(self._root_pre_forward)
        for ui, (_, subs, params) in enumerate(self._units):
            if subs is None:
                continue
            # A group of units: gathered before the first runs, resharded after the last.
            subs[0].register_forward_pre_hook(
                lambda m, args, kwargs, ui=ui: self._pre_forward(ui, args, kwargs),
                with_kwargs=True)
            subs[-1].register_forward_hook(lambda m, inp, out, ui=ui: self._post_forward(ui, out))
        for ui, (_, _, params) in enumerate(self._units):
            for _, p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda p, ui=ui: self._grad_ready(ui, p))
        self._forwards = [0] * len(self._units)  # forwards with autograd since the backward
        self._inputs_done = [0] * len(self._units)  # of them, those whose inputs' grads came
        self._reduced = set()

    def _root_pre_forward(self, module, inputs):
        if self._root is not None:
            self._unshard(self._root)
        for j in range(self.prefetch):
            self._prefetch(j)

    def _pre_forward(self, ui, args, kwargs):
        self._unshard(ui)
        for j in range(1, self.prefetch + 1):
            self._prefetch(ui + j)
        if not torch.is_grad_enabled():
            return None
        self._forwards[ui] += 1
        # The unit's post-backward runs once the gradients of these inputs are computed: after
        # every gradient of the unit's parameters, whichever of them this rank's data reached.
        flat, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
        if not where:
            return None  # the callback at the end of the backward pass runs it
        outs = _PostBackward.apply(self, ui, *(flat[i] for i in where))
        for i, x in zip(where, outs):
            flat[i] = x
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, ui, out):
        if not torch.is_grad_enabled():
            self._reshard(ui)  # no backward follows
            return out
        raf = self.reshard_after_forward
        if raf is True:
            self._reshard(ui)
        elif raf is not False:
            self._reshard(ui, keep=raf)  # the parameters' storage goes; the group keeps the unit
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
        self._reshard(ui)
        if self._no_sync:
            return
        self._allocate_grads(ui)  # a unit that got no gradient reduces zeros
        self._handles[("reduce", ui)] = self.client.reduce_scatter(ui, "avg")
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
        if not self._no_sync:
            self._reduce_used_flags()
        for key in [k for k in self._handles if k[0] == "reduce"]:
            self._handles.pop(key).wait()
        if self.replicas > 1 and not self._no_sync:
            # HSDP: average the gradient shards over the replicas of the shard group.
            handles = [self.client.all_reduce(ui, "avg") for ui in range(len(self._units))]
            for h in handles:
                h.wait()

    def _reduce_used_flags(self):
        """Every rank learns which parameters any rank's backward reached since the last
        reduction: each writes its flags (1.0 for used) into every rank's slot of the flags
        unit's gradient, so the reduced shard counts the ranks that used each parameter."""
        u, n = self._flags_unit, self._nparams
        self.client.allocate_grad(u).wait()
        slots = as_tensor(self.client.grad(u)).view(-1, self.shard_elems[u])
        if self._used:
            slots[:, list(self._used)] = 1.0
        self.client.reduce_scatter(u, "sum").wait()
        if self.replicas > 1:
            self.client.all_reduce(u, "sum").wait()
        counts = as_tensor(self.client.grad_shard(u))[:n]
        for i in torch.nonzero(counts > 0).flatten().tolist():
            self.has_grad[i] = True
        self._used = set()

    # -- user API ----------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._root is not None:
            # The root's gradients are allocated before the first of them is computed.
            self._hook_backward(self._root, out)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside add into the gradient buffers without
        reduce-scattering; the first backward outside reduces the accumulated sum."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def zero_grad(self, set_to_none=True):
        """PyTorch's zero_grad: zeroes the gradient shards and the gradients accumulated under
        no_sync (outside a backward the unsharded gradients are released and .grad is None).
        With set_to_none (the default), parameters also stop having a gradient until a backward
        reaches them (`has_grad`), so the optimizers leave them alone; without, they keep a zero
        gradient and are stepped with it."""
        for ui in self._grads:
            for p, _, _ in self._views[ui]:
                if p.grad is not None:
                    p.grad.zero_()
                    if set_to_none:
                        p.grad = None  # bound again when the next backward reaches the unit
        for ui in self.units():
            as_tensor(self.client.grad_shard(ui)).zero_()
        if set_to_none:
            self.has_grad = [False] * self._nparams
            self._used = set()

    def pieces(self, ui):
        """The parameters' pieces in this rank's shard of unit `ui` (_Piece: parameter index,
        shard elements [lo, hi), whether a matrix)."""
        return self._pieces[ui]

    def shard(self, ui):
        """The fp32 (or bf16) parameter shard of unit `ui` and its fp32 gradient shard."""
        return (_tensor(self.client.param_shard(ui), self.param_dtype),
                as_tensor(self.client.grad_shard(ui)))

    def units(self):
        return range(len(self._units))

    def unit_params(self, ui):
        """[(name, parameter)] of unit `ui`, in plan order."""
        return self._units[ui][2]

    def unit_views(self, ui):
        """[(parameter, offset, numel)] of unit `ui`: where each lies in the unit."""
        return self._views[ui]

    def param_index(self, p):
        """The index of parameter `p` in unit order (that of `has_grad` and of the pieces)."""
        return self._index[id(p)]

    def all_reduce_scalar(self, value):
        """The sum over ranks of one float per rank (through the scalar unit's reduce-scatter:
        every element of this rank's gradient holds `value`, so every element of the reduced
        shard holds the sum)."""
        u = self._scalar_unit
        self.client.allocate_grad(u).wait()
        as_tensor(self.client.grad(u)).fill_(float(value))
        self.client.reduce_scatter(u, "sum").wait()
        if self.replicas > 1:
            self.client.all_reduce(u, "sum").wait()
        return float(as_tensor(self.client.grad_shard(u))[0])

    def clip_grad_norm_(self, max_norm):
        """Clips the gradient shards by the global norm over all shards; returns that norm."""
        local = 0.0
        for ui in self.units():
            g = as_tensor(self.client.grad_shard(ui))
            local += float(g.double().pow(2).sum())
        total = math.sqrt(self.all_reduce_scalar(local))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for ui in self.units():
                as_tensor(self.client.grad_shard(ui)).mul_(coef)
        return total

    def state_dict(self, *args, **kwargs):
        """FSDP's full state dict: every parameter unsharded, as fp32 (a collective: every rank
        calls it, as full_state), and the module's buffers, under the module's own names."""
        out = self.full_state()
        for n, b in self.module.named_buffers():
            out[n] = b.detach().clone()
        return out

    def wait_for_checkpoint_write(self):
        """Waits until an asynchronous checkpoint save has written this rank's part: the
        shards, masters and optimizer state must not change before (the optimizers' step calls
        it). Raises the save's error if it failed."""
        handle = self.checkpoint_writing
        if handle is not None:
            self.checkpoint_writing = None
            handle.wait_written()

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads a plain (unsharded) state_dict, as `state_dict()` returns or torch.save of the
        plain model holds: each rank copies its pieces of every parameter into its shards (and
        fp32 masters), and the buffers whole. Every rank calls it; no collective runs. Returns
        (missing_keys, unexpected_keys), as torch's."""
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported (the parameters "
                             "live in the daemon's buffers)")
        from ..checkpoint import _state
        self.wait_for_checkpoint_write()
        names = {pc.name for pc in _state.pieces(self)} | \
            {n for ui in self.units() for n, _ in self.unit_params(ui)}
        buffers = dict(self.module.named_buffers())
        missing = sorted((names | set(buffers)) - set(state_dict))
        unexpected = sorted(set(state_dict) - names - set(buffers))
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]}")
        for ui in self.units():
            for n, p in self.unit_params(ui):
                if n in state_dict and tuple(state_dict[n].shape) != tuple(p.shape):
                    raise RuntimeError(f"load_state_dict: '{n}' has shape "
                                       f"{list(state_dict[n].shape)}, the model's is "
                                       f"{list(p.shape)}")
        for pc in _state.pieces(self):
            if pc.name in state_dict:
                flat = state_dict[pc.name].detach().reshape(-1)
                _state.set_param_values(self, pc, flat[pc.start:pc.start + pc.hi - pc.lo].cpu())
        for n, b in buffers.items():
            if n in state_dict and b is not None:
                b.data.copy_(state_dict[n])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_state(self):
        """{name: fp32 tensor} of every parameter, unsharded (for checks; one all-gather per
        unit). The values are those the forward computes with: with param_dtype bf16, the bf16
        rounding of the fp32 masters."""
        out = {}
        for ui, (_, _, params) in enumerate(self._units):
            if ui in self._q:  # the exact fp32 values, not the last dequantized ones
                as_tensor(self.client.param_shard(ui)).copy_(self.masters[ui])
            was = ui in self._full
            self.client.unshard(ui).wait()
            self._bind(ui)
            for n, p in params:
                out[n] = p.detach().float().cpu().clone()
            if not was:
                self._reshard(ui)
        return out


_Piece = collections.namedtuple("_Piece", "index lo hi matrix")
_Piece.__doc__ = "The part of parameter `index` in this rank's shard: elements [lo, hi)."
_Matrix = collections.namedtuple("_Matrix", "unit offset numel shape owner packed index")
_Matrix.__doc__ = ("A matrix tensor for Muon: its place in the unit, its owner rank and its "
                   "offset in the owner's packed buffer.")


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward, reached once the inputs' gradients are
    computed, is the unit's post-backward (FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, module, ui, *inputs):
        ctx.module, ctx.ui = module, ui
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._inputs_grad_ready(ctx.ui)
        return (None, None) + grads


def fully_shard(module, client, units, **kwargs):
    """Shards `module` over the job of `client`: see ShardedModule."""
    return ShardedModule(module, client, units, **kwargs)
