"""ShardedModule: a module whose parameters live in ragshard's buffers (see the package
docstring). Its parts: buffers.py (binding), hooks.py (FSDP2's hooks), quantized.py (quantized
gathers), state.py (clipping and state dicts)."""
import collections
import contextlib
import json
import os

import torch

from .. import Client, Env, Error, connect, plan_of
from . import clip
from .buffers import BuffersMixin
from .meta import adopt_meta, release_freed_memory, values
from .hooks import HooksMixin
from .params import WHOLE_MATRIX, Matrix, Piece, adopt, storageless
from .quantized import QuantizedGatherMixin, plan_quantized_units
from .state import StateMixin
from .views import DTYPES, as_tensor, tensor_of


def _world_from_environment():
    """The world size ragshard.Env finds (ragshard.launch's, torchrun's or srun's variables),
    else RAGSHARD_WORLD_SIZE or WORLD_SIZE alone; None where there is none."""
    try:
        return Env().world_size
    except Error:
        return int(os.environ.get("RAGSHARD_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or
                   0) or None


class ShardedModule(BuffersMixin, HooksMixin, QuantizedGatherMixin, StateMixin, torch.nn.Module):
    """`module` with its parameters in ragshard buffers; see the package docstring."""

    def __init__(self, module, client, units, granule=None, optimizer=None, param_dtype="fp32",
                 reshard_after_forward=True, prefetch=None, register=True, quantize=None,
                 world=None, init=None, strategy=None):
        super().__init__()
        if param_dtype not in DTYPES:
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
        # A model built on the meta device: its values come from `init`, one tensor at a time.
        meta = adopt_meta(module, init)
        self._needs_load = bool(meta) and init == "empty"
        names = {id(p): n for n, p in module.named_parameters()}
        # Units: the policy's submodules, then "root" for the parameters left over.
        seen = set()
        self._units = []  # (name, module or None, [(fqn, param)])
        self._borrowers = []  # tied weights: (module, [other units' parameters], in a unit)
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
        self._find_ties(module)
        # A unit of W fp32 elements for scalar all-reductions (gradient clipping), and one of
        # W x P for the used-parameter flags of P parameters (each rank's shard of the sum is
        # the count of ranks that used each parameter).
        world = world or _world_from_environment()
        self._nparams = sum(len(params) for _, _, params in self._units)
        if quantize and not world:
            raise ValueError("quantize: the world size is needed before registering (world=)")
        inventory = {"units": []}
        for uname, _, params in self._units:
            inventory["units"].append({"name": uname, "tensors": [
                {"name": n, "shape": list(p.shape), "dtype": param_dtype,
                 "granule": granule(n, p),
                 "optimizer": optimizer(n, p) if p.dim() == 2 else "elementwise"}
                for n, p in params]})
        inventory["units"].append({"name": "__ragshard_scalars__", "tensors": [
            {"name": "__ragshard_scalars__.norm", "shape": [world or 1], "dtype": "fp32"}]})
        inventory["units"].append({"name": "__ragshard_used__", "tensors": [
            {"name": "__ragshard_used__.flags", "shape": [(world or 1) * max(self._nparams, 1)],
             "dtype": "fp32"}]})
        # Quantized gathers: one byte unit per module unit (quantized.py).
        # Under a pinned AMSP strategy the byte units follow its plans (quantized.py).
        strategy = strategy if strategy is not None else os.environ.get("RAGSHARD_STRATEGY")
        self._q = plan_quantized_units(inventory, len(self._units), world,
                                       strategy) if quantize else {}
        if client is None:
            # Connected from the environment once the module is known to be shardable.
            client = self.client = connect()
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
        # The job's AMSP factors (engine/sharding.h): the parameter shard is position `pos` of
        # the plan's `world` (p); the gradient shard is position `gpos` of the g layout, and
        # this rank's optimizer range position `ospos` of the os layout, inside both. With
        # p = g = os (HSDP or FSDP) the three are one shard of a group repeated `replicas`
        # times. `replicas` is W / |g|: the gradients' replicas, all-reduced.
        self.replicas = client.replicas
        nunits = len(self.plan["units"])
        layouts = [client.layout(u) for u in range(nunits)]
        self.pos, self.gpos, self.ospos = (layouts[0][k] for k in ("p", "g", "os"))
        # False where another local rank steps this rank's optimizer range in the same memory.
        self.steps = layouts[0]["steps"]
        self.os_group = layouts[0]["os_group"]  # group 0 holds every os position once
        self.shard_elems = [client.shard_elems(u) for u in range(nunits)]
        self.grad_elems = [lay["grad_elems"] for lay in layouts]
        # This rank's optimizer range of each unit: os_elems[u] elements at os_at[u] =
        # (offset in the parameter shard, offset in the gradient shard).
        self.os_elems = [lay["os_elems"] for lay in layouts]
        self.os_at = [(lay["os_param"], lay["os_grad"]) for lay in layouts]
        self.factored = self.os_elems != self.shard_elems
        sizes = {f["component"]: int(f["world_size"]) for f in self.plan.get("factors", [])}
        # |p|, |g|, |os|
        self.group_sizes = (self.world, sizes.get("g", self.world), sizes.get("os", self.world))
        by_name, packed = {}, {}
        os_units = next((f["units"] for f in self.plan.get("factors", [])
                         if f["component"] == "os"), self.plan["units"])
        for ui, (up, ou) in enumerate(zip(self.plan["units"], os_units)):
            owned = {}  # an owner's matrices, packed in plan order in its owner buffer
            for t, ot in zip(up["tensors"], ou["tensors"]):
                by_name[t["name"]] = (ui, int(t["offset"]), int(t["numel"]), ot)
                if ot.get("optimizer") in WHOLE_MATRIX:
                    owner = int(ot.get("owner_rank", -1))  # an os position
                    packed[t["name"]] = owned.get(owner, 0)
                    owned[owner] = packed[t["name"]] + int(t["numel"])
        self._scalar_unit = len(self._units)
        self._flags_unit = len(self._units) + 1
        # This rank writes its own shard; the parameters become views of the unsharded buffers
        # while their unit is unsharded.
        self.matrices = []  # Matrix of each whole-matrix tensor (Muon's and Shampoo's)
        self._pieces = {}  # unit -> [_Piece]: the parameters' pieces in this rank's shard
        # Which parameters have a gradient, by index in unit order (PyTorch's grad not None),
        # the same on every rank; and those this rank's backward reached since the last
        # reduction of the flags.
        self.has_grad = [False] * self._nparams
        self._used = set()
        self._views = {}  # unit -> [(param, offset, numel)]
        self._full = {}  # unit -> its unsharded buffer, while unsharded
        self.peak_unsharded = 0  # the most units unsharded at once on this rank so far
        # Gathers (unshards bound to the parameters) and gradient reduce-scatters by unit name.
        self.op_counts = {"gather": collections.Counter(), "reduce_scatter": collections.Counter()}
        self._by_storage = {}  # the data address of an unsharded buffer -> its unit
        self._grads = set()  # units whose gradient buffers are allocated
        self._empty = {}  # unit -> its parameters' shapes as tensors with no storage
        self._view_cache = {}  # (kind, unit) -> [(array, tensor, views)] (_views_of)
        # fp32 master shards kept by the module: bf16 parameters, or quantized gathers (whose
        # unsharded buffer holds dequantized values). The optimizers step them.
        masters = {}
        self._index = {}  # id(parameter) -> its index in unit order
        self._names = []  # index -> the parameter's name
        self._offsets = []  # index -> the parameter's offset in its unit
        self._optimizer_state = {}  # (optimizer, key, unit) -> tensor (optimizer_state)
        for ui, (uname, _, params) in enumerate(self._units):
            if self.plan["units"][ui]["unit"] != uname:
                raise RuntimeError(f"plan unit {ui} is {self.plan['units'][ui]['unit']}, "
                                   f"expected {uname}")
            shard = tensor_of(client.param_shard(ui), param_dtype)
            s = self.shard_elems[ui]
            lo, hi = self.pos * s, (self.pos + 1) * s
            # The optimizer range (the whole shard unless the factors differ).
            olo = self.ospos * self.os_elems[ui]
            ohi = olo + self.os_elems[ui]
            # With a parameter dtype below fp32, the optimizer's fp32 master of its range starts
            # from the exact initial values (as FSDP2's sharded parameters), not their rounding.
            exact = torch.zeros(ohi - olo) if param_dtype != "fp32" else None
            self._views[ui] = []
            self._pieces[ui] = []
            for n, p in params:
                _, off, numel, t = by_name[n]
                index = len(self._index)
                self._index[id(p)] = index
                self._names.append(n)
                self._offsets.append(off)
                matrix = t.get("optimizer") in WHOLE_MATRIX
                a, b = max(off, lo), min(off + numel, hi)
                if a < b:
                    if id(p) not in meta:
                        mine = p.detach().reshape(-1)[a - off:b - off]
                    elif callable(init):  # the whole tensor, only while its pieces are copied
                        mine = values(init, n, p).reshape(-1)[a - off:b - off]
                    else:
                        mine = torch.zeros(b - a)  # init="empty": a load follows
                    shard[a - lo:b - lo].copy_(mine.to(shard.dtype))
                    oa, ob = max(a, olo), min(b, ohi)
                    if oa < ob:
                        if exact is not None:
                            exact[oa - olo:ob - olo] = mine[oa - a:ob - a].float()
                        self._pieces[ui].append(Piece(index, oa - olo, ob - olo, matrix))
                    if id(p) in meta:
                        del mine
                        release_freed_memory()  # the whole tensor's pages, back to the system
                self._views[ui].append((p, off, numel))
                p.grad = None
                adopt(p, n, uname)
                clip.own(p, self)
                if matrix:
                    self.matrices.append(Matrix(
                        ui, off, numel, tuple(p.shape), int(t.get("owner_rank", -1)), packed[n],
                        index, n, WHOLE_MATRIX[t["optimizer"]], int(t.get("shampoo_block", 0))))
            if exact is not None:
                masters[ui] = exact
            self._empty[ui] = [storageless(p.shape, DTYPES[param_dtype]) for p, _, _ in
                               self._views[ui]]
            self._free(ui)
        self.masters = masters
        if self.grad_elems[self._flags_unit] < self._nparams:
            raise ValueError("fully_shard: the world size is needed before registering (pass "
                             "world=, or set RAGSHARD_WORLD_SIZE)")
        self._check_quantized_units()
        self.gathered_bytes = {"quantized": 0, "full": 0}
        self.checkpoint_writing = None  # an asynchronous checkpoint save writing the state
        self._handles = {}
        self._backward_started = False
        self._install_hooks()
        self._start_trace(os.environ.get("RAGSHARD_TRACE"))

    def _find_ties(self, module):
        """Tied weights: every module that holds, as its own parameter, one that a unit outside
        it owns (an output head holding the embedding's weight). Such a module gathers that
        unit for its forward and its backward. Inside a unit it reshards it after its forward
        as the unit does; outside every unit (in the root) it keeps it until the unit's
        post-backward, since its backward comes next (FSDP2 keeps its root unsharded after
        forward for the same reason)."""
        owner = {id(p): sub for _, sub, params in self._units if sub is not None
                 for _, p in params}
        subs = [sub for _, sub, _ in self._units if sub is not None]
        for m in module.modules():
            tied = [p for p in m.parameters(recurse=False)
                    if id(p) in owner and not _nested(m, owner[id(p)])]
            if tied:
                inside = any(any(x is m for x in sub.modules()) for sub in subs)
                self._borrowers.append((m, tied, inside))

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

    # -- user API ----------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._needs_load:
            raise RuntimeError("fully_shard(init='empty'): the shards hold no values yet; load a "
                               "checkpoint (ragshard.checkpoint.load) or a state_dict first")
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
        """PyTorch's zero_grad: zeroes the gradient shards' optimizer ranges and the gradients
        accumulated under no_sync (outside a backward the unsharded gradients are released and
        .grad is None). With set_to_none (the default), parameters also stop having a gradient until a backward
        reaches them (`has_grad`), so the optimizers leave them alone; without, they keep a zero
        gradient and are stepped with it."""
        for ui in self._grads:
            for p, _, _ in self._views[ui]:
                if p.grad is not None:
                    p.grad.zero_()
                    if set_to_none:
                        p.grad = None  # bound again when the next backward reaches the unit
        if self.steps:  # else the local rank that steps this memory zeroes it
            for ui in self.units():
                # The optimizer range (the whole shard when p = g = os): another local rank may
                # step the rest of a gradient shard it shares.
                self.shard(ui)[1].zero_()
        if set_to_none:
            self.has_grad = [False] * self._nparams
            self._used = set()

    def pieces(self, ui):
        """The parameters' pieces in this rank's optimizer range of unit `ui` (Piece: parameter
        index, elements [lo, hi) of the range, whether a matrix)."""
        return self._pieces[ui]

    def shard(self, ui):
        """This rank's optimizer range of unit `ui`: its parameters (fp32 or bf16, in the
        parameter shard) and its fp32 gradients (in the gradient shard). With p = g = os that is
        the whole of both shards."""
        (at_p, at_g), n = self.os_at[ui], self.os_elems[ui]
        return (tensor_of(self.client.param_shard(ui), self.param_dtype)[at_p:at_p + n],
                as_tensor(self.client.grad_shard(ui))[at_g:at_g + n])

    def master_of(self, ui):
        """The fp32 master of this rank's optimizer range of unit `ui` where the module keeps
        one apart from the shard (bf16 parameters, quantized gathers), else None."""
        m = self.masters.get(ui)
        if m is None or m.numel() == self.os_elems[ui]:
            return m
        at_p = self.os_at[ui][0]  # a master of the whole parameter shard (quantized gathers)
        return m[at_p:at_p + self.os_elems[ui]]

    def gather_updates(self):
        """AMSP's update gather after an optimizer step (or a load) with separate factors: each
        rank's optimizer range reaches every parameter shard that holds it. Every rank calls
        it; nothing runs when p = g = os."""
        if not self.factored:
            return
        handles = [self.client.update_gather(ui) for ui in self.units()]
        for h in handles:
            h.wait()
        for ui in self._q:
            # Quantized gathers quantize the whole shard: its exact values, before any
            # dequantized gather writes into the unsharded buffer that may map it.
            self.masters[ui].copy_(as_tensor(self.client.param_shard(ui)))

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

    def piece_start(self, ui, lo, index):
        """The flat element of parameter `index` at element `lo` of this rank's optimizer range
        of unit `ui`."""
        return self.ospos * self.os_elems[ui] + lo - self._offsets[index]

    def unit_param_name(self, index):
        """The name of parameter `index` (unit order)."""
        return self._names[index]

    def optimizer_state(self, owner, key, ui, numel, dtype=torch.float32):
        """The module's tensor of `numel` elements that holds state `key` of optimizer `owner`
        for unit `ui` (zeros when new). The optimizers keep their state of this rank's pieces
        here rather than in tensors of their own, so that where it lives is the module's
        choice."""
        k = (owner, key, ui)
        t = self._optimizer_state.get(k)
        if t is None or t.numel() != numel or t.dtype != dtype:
            t = self._optimizer_state[k] = torch.zeros(numel, dtype=dtype)
        return t

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The wrapped module's parameters under their own names (as FSDP2, which wraps in
        place): the names an optimizer's param groups and a state dict use."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)


def _nested(a, b):
    """True when module a contains module b or b contains a."""
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())


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
