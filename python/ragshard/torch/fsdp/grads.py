"""The gradients of a fully_shard module's parameters as torch's own functions see them.

After a backward pass that reduced a unit's gradients, each of its parameters that has a gradient
(PyTorch's `.grad is not None`: ShardedModule.has_grad, the same on every rank) holds in `.grad`
a ShardGrad: a tensor of the parameter's shape and dtype whose elements live on the ranks, this
rank's piece of them a view of its gradient shard. As FSDP2's DTensor gradients do, it lets
torch's clipping run on the global gradient, with no torch function replaced:

* torch.linalg.vector_norm, torch.norm, Tensor.norm and torch._foreach_norm of a ShardGrad give a
  PartialNorm, this rank's part of that tensor's norm (no communication);
* torch.stack of such norms (and of plain ones, of tensors every rank holds whole) gives a
  NormStack; its vector_norm (or norm) is a collective: the ranks combine their parts through the
  module's control units, and every rank gets the global norm as a plain tensor;
* mul_, div_, clamp_, clamp_min_, clamp_max_, zero_ and their torch._foreach_ forms act on this
  rank's piece, each element once per copy of it;

so torch.nn.utils.clip_grad_norm_ (any norm_type), get_total_norm with clip_grads_with_norm_, and
clip_grad_value_ give torch's results over the global gradient, with torch's foreach,
error_if_nonfinite and NaN behaviour (they are torch's own code). Anything else on a ShardGrad
raises an error naming the parameter: no operation silently sees only this rank's piece.

Every element of an optimizer range is held by several ranks where there are replicas (HSDP,
AMSP's os groups) or where local ranks share memory (`ShardLayout.steps`): only the ranks that step
a copy contribute to a norm, and each sum is divided by the number of such copies.
"""
import math
import struct

import torch

__all__ = ["ShardGrad", "PartialNorm", "NormStack", "GradNorms"]

# What reads no element: metadata, hashing, and properties other than `data`.
_META = frozenset({
    "__get__", "size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "__hash__", "get_device", "type", "__len__",
    "__format__", "__reduce_ex__", "requires_grad_", "_is_view", "storage_offset",
})


class _Spread(torch.Tensor):
    """A tensor whose values are spread over the ranks: no storage of its own; the operations
    ragshard defines on it are in _HANDLERS, every other one is refused by name."""

    @staticmethod
    def _wrap(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data:
            return args[0]
        if name in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(_refusal(name, args, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached by what bypasses __torch_function__ (autograd's AccumulateGrad, C++ code).
        raise RuntimeError(_refusal(str(func), args, kwargs or {}))

    def describe(self):
        """What the tensor is, for errors."""
        raise NotImplementedError

    def __repr__(self, *, tensor_contents=None):
        return f"<{type(self).__name__}: {self.describe()}>"


def _refusal(op, args, kwargs):
    x = next((a for a in _flat(args, kwargs) if isinstance(a, _Spread)), None)
    what = x.describe() if x is not None else "a ragshard gradient"
    return (f"ragshard: {op} on {what}: its elements are spread over the ranks (each holds its "
            "piece of the gradient shard); supported: the norms (torch.linalg.vector_norm, "
            "torch.norm, torch._foreach_norm, then torch.stack and a norm of the stack: the "
            "global norm on every rank), mul_, div_, clamp_, clamp_min_, clamp_max_, zero_ and "
            "their _foreach_ forms (torch.nn.utils' clipping functions), .local (this rank's "
            "piece) and full_tensor() of a norm")


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


class ShardGrad(_Spread):
    """The gradient of parameter `param` of a fully_shard module: `local` is this rank's piece
    (a view of its gradient shard's optimizer range, fp32, possibly empty); `norms` the
    module's GradNorms; `name` the parameter's."""

    @staticmethod
    def __new__(cls, param, local, norms, name):
        self = _Spread._wrap(cls, param.shape, param.dtype, param.device)
        self.local, self.norms, self.param_name = local, norms, name
        return self

    def describe(self):
        return (f"the gradient of '{self.param_name}', shape {list(self.shape)}, this rank's "
                f"piece {self.local.numel()} elements")

    def _writes(self):
        """Whether this rank applies in-place operations to its piece (the memory may be another
        local rank's to change: ShardLayout.steps)."""
        return self.norms.steps


class PartialNorm(_Spread):
    """This rank's part of the `ord`-norm of one sharded tensor: for a finite nonzero ord the sum
    of |x|^ord over its piece, for 0 the count of its nonzero elements, for ±inf the largest
    (smallest) |x| (None: no piece to count)."""

    @staticmethod
    def __new__(cls, norms, ord, part, name, device):
        self = _Spread._wrap(cls, (), torch.float32, device)
        self.norms, self.ord, self.part, self.param_name = norms, ord, part, name
        return self

    def describe(self):
        return f"the {self.ord}-norm of the gradient of '{self.param_name}' (a part on each rank)"

    def full_tensor(self):
        """The global norm (a collective: every rank calls it)."""
        return NormStack([self]).full_tensor()[0]


class NormStack(_Spread):
    """torch.stack of norms: PartialNorms of one module's gradients, and plain 0-dim tensors
    (norms of tensors every rank holds whole, counted once)."""

    @staticmethod
    def __new__(cls, entries):
        device = entries[0].device
        self = _Spread._wrap(cls, (len(entries),), torch.float32, device)
        self.entries = entries
        engines = {id(e.norms): e.norms for e in entries if isinstance(e, PartialNorm)}
        if len(engines) > 1:
            raise RuntimeError("ragshard: torch.stack of the gradient norms of two fully_shard "
                               "modules; compute each module's norm by itself and combine them")
        self.norms = next(iter(engines.values()))
        return self

    def full_tensor(self):
        """Each entry's global norm, as a plain fp32 tensor (a collective)."""
        return self.norms.combine(self.entries, None)

    def describe(self):
        return f"a stack of {len(self.entries)} gradient norms (parts on each rank)"


class GradNorms:
    """The collectives behind a module's ShardGrads: `control` (ControlUnits) sums over ranks,
    `layout` (ShardLayout) says whether this rank steps its copy of the optimizer range
    (`steps`) and how many ranks hold each os position."""

    def __init__(self, control, layout):
        self._control, self._layout = control, layout
        self.steps = layout.steps
        self._copies = None  # copies of each element that contribute (the stepping ranks')

    def part(self, local, ord, name, device):
        """A PartialNorm of `local` (this rank's piece) for norm order `ord`."""
        if not self.steps or local.numel() == 0:
            part = None
        elif ord == math.inf:
            part = float(local.abs().max())
        elif ord == -math.inf:
            part = float(local.abs().min())
        elif ord == 0:
            part = float((local != 0).sum())
        else:
            part = float(local.double().abs().pow(ord).sum())
        return PartialNorm(self, ord, part, name, device)

    def combine(self, entries, ord):
        """The `ord`-norm over `entries` (PartialNorms and plain norms) as every rank sees it,
        a plain fp32 0-dim tensor; `ord` None: each entry's global norm (a vector)."""
        parts = [e for e in entries if isinstance(e, PartialNorm)]
        extreme = {e.ord for e in parts if math.isinf(e.ord)}
        if extreme:
            return self._combine_extreme(entries, parts, extreme, ord)
        sums = self._control.all_reduce_sum(
            [1.0 if self.steps else 0.0] + [e.part or 0.0 for e in parts])
        copies = self._copies_from(sums[0])
        out, it = [], iter(sums[1:])
        for e in entries:
            if not isinstance(e, PartialNorm):
                out.append(float(e))
                continue
            total = next(it) / copies
            out.append(total if e.ord == 0 else _root(total, e.ord))
        values = torch.tensor(out, dtype=torch.float64)
        if ord is None:
            return values.float()
        return torch.linalg.vector_norm(values, ord).float()

    def _combine_extreme(self, entries, parts, extreme, ord):
        if len(extreme) > 1 or any(not math.isinf(e.ord) for e in parts) or \
                (ord is not None and ord != next(iter(extreme))) or \
                (ord is None and len(entries) > 1):
            raise RuntimeError("ragshard: the infinity norms of sharded gradients combine only "
                               "into the same infinity norm of them all (clip_grad_norm_'s "
                               "norm_type=inf); other mixtures are not supported")
        high = next(iter(extreme)) > 0
        mine = [e.part for e in parts if e.part is not None]
        local = (max(mine) if high else min(mine)) if mine else None
        found = self._control.all_reduce_extreme(local, high)
        plain = [float(e) for e in entries if not isinstance(e, PartialNorm)]
        values = [v for v in [found] + plain if v is not None]
        if not values:
            return torch.tensor(0.0 if high else math.inf)
        if any(math.isnan(v) for v in values):
            return torch.tensor(math.nan)
        return torch.tensor(max(values) if high else min(values), dtype=torch.float32)

    def _copies_from(self, stepping):
        """Copies of each element among the contributing ranks: the stepping ranks over |os|."""
        if self._copies is None:
            os_size = self._layout.group_sizes[2]
            self._copies = max(1.0, round(stepping) / os_size)
        return self._copies


def _root(total, ord):
    if total == math.inf or math.isnan(total):
        return total
    if ord < 0 and total == 0:
        return math.inf
    return total ** (1.0 / ord)


def float_key(value, high):
    """An integer whose order is that of `value` (≥ 0 or +inf) for a maximum (`high`), or the
    reverse for a minimum: the radix search of ControlUnits.all_reduce_extreme."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return bits if high else 0x7F800000 - bits


def key_float(key, high):
    bits = key if high else 0x7F800000 - key
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# -- the operations ragshard defines -----------------------------------------------------------

def _ord(p):
    if p in ("fro", None):
        return 2.0
    if isinstance(p, str):
        raise RuntimeError(f"ragshard: the '{p}' norm of a sharded gradient is not supported "
                           "(vector norms only)")
    return float(p)


def _norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if dim is not None or out is not None:
        raise RuntimeError(_refusal("a norm over dimensions (dim=) or into out=", (x,), {}))
    ord = _ord(ord)
    if isinstance(x, ShardGrad):
        return x.norms.part(x.local, ord, x.param_name, x.device)
    if isinstance(x, PartialNorm):
        x = NormStack([x])
    return x.norms.combine(x.entries, ord)


def _tensor_norm(x, p="fro", dim=None, keepdim=False, dtype=None, out=None):
    return _norm(x, p, dim, keepdim, dtype=dtype, out=out)


def _foreach_norm(tensors, ord=2, dtype=None):
    out = []
    for t in tensors:
        if isinstance(t, _Spread):
            out.append(_norm(t, ord))
        else:
            with torch._C.DisableTorchFunctionSubclass():
                out.append(torch.linalg.vector_norm(t, ord, dtype=dtype))
    return out


def _stack(tensors, dim=0, *, out=None):
    tensors = list(tensors)
    if out is not None or dim != 0 or any(isinstance(t, (ShardGrad, NormStack)) or
                                          (not isinstance(t, PartialNorm) and t.dim() != 0)
                                          for t in tensors):
        raise RuntimeError(_refusal("torch.stack (other than of 0-dim norms)", tensors, {}))
    return NormStack(tensors)


def _to(x, *args, **kwargs):
    return x  # norms and gradients stay where their pieces are


def _in_place(op):
    def apply(x, *args, **kwargs):
        if not isinstance(x, ShardGrad):
            raise RuntimeError(_refusal(op, (x,), {}))
        if x._writes() and x.local.numel():
            args = [a.to(x.local.device) if torch.is_tensor(a) else a for a in args]
            kwargs = {k: v.to(x.local.device) if torch.is_tensor(v) else v
                      for k, v in kwargs.items()}
            getattr(x.local, op)(*args, **kwargs)
        return x
    return apply


def _foreach(op):
    """torch._foreach_<op>_(tensors, other): ShardGrads by their pieces, the rest by torch."""
    def apply(tensors, *args, **kwargs):
        tensors = list(tensors)
        others = args[0] if args else None
        per = list(others) if isinstance(others, (list, tuple)) else None
        plain, plain_args = [], []
        for i, t in enumerate(tensors):
            arg = per[i] if per is not None else others
            if isinstance(t, ShardGrad):
                _in_place(op)(t, *([arg] if args else []), **kwargs)
            else:
                plain.append(t)
                plain_args.append(arg)
        if plain:
            fn = getattr(torch, f"_foreach_{op}")
            with torch._C.DisableTorchFunctionSubclass():
                if not args:
                    fn(plain, **kwargs)
                else:
                    fn(plain, plain_args if per is not None else others, **kwargs)
    return apply


_HANDLERS = {
    torch.linalg.vector_norm: _norm,
    torch.norm: _tensor_norm,
    torch.Tensor.norm: _tensor_norm,
    torch._foreach_norm: _foreach_norm,
    torch.stack: _stack,
    torch.Tensor.to: _to,
    torch.Tensor.detach: _to,
    torch.Tensor.__repr__: lambda x, *a, **k: x.__repr__(),
    torch.Tensor.__str__: lambda x, *a, **k: x.__repr__(),
}
for _op in ("mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "zero_"):
    _HANDLERS[getattr(torch.Tensor, _op)] = _in_place(_op)
for _op in ("mul_", "div_", "clamp_min_", "clamp_max_", "zero_"):
    _HANDLERS[getattr(torch, f"_foreach_{_op}")] = _foreach(_op)


class ShardGrads:
    """The ShardGrads of a fully_shard module's parameters: made once per parameter (views of
    the persistent gradient shards), put in `.grad` after each reduction for the parameters that
    have a gradient, taken away by zero_grad(set_to_none=True).

    `units`: the ModuleUnits; `shards`: the RankShards (the pieces and the optimizer ranges);
    `grad_use`: the GradUse (which parameters have a gradient); `norms`: the GradNorms."""

    def __init__(self, units, shards, grad_use, norms):
        self._units, self._shards, self._grad_use, self.norms = units, shards, grad_use, norms
        self._local = {}  # parameter index -> its piece of the gradient shard
        self._made = {}  # (parameter index, device) -> its ShardGrad

    def _grad_of(self, ui, index, p):
        if not self._local:
            for u in self._shards.units():
                grad = self._shards.shard(u)[1]
                for pc in self._shards.pieces(u):
                    self._local[pc.index] = grad[pc.lo:pc.hi]
        key = (index, p.device)
        g = self._made.get(key)
        if g is None:
            local = self._local.get(index)
            if local is None:  # no element of it on this rank
                local = self._shards.shard(ui)[1][:0]
            g = self._made[key] = ShardGrad(p, local, self.norms, self._units.names[index])
        return g

    def publish(self, units):
        """After a backward's reductions of `units`: their parameters' .grad, a ShardGrad where
        the parameter has a gradient, else None."""
        has = self._grad_use.has_grad
        for ui in units:
            for p, _, _ in self._units.views[ui]:
                index = self._units.index_of(p)
                p.grad = self._grad_of(ui, index, p) if has[index] else None

    def forget(self):
        """zero_grad(set_to_none=True): no parameter has a gradient."""
        for views in self._units.views:
            for p, _, _ in views:
                if isinstance(p.grad, ShardGrad):
                    p.grad = None
