"""The parameters of a fully_shard unit, with and without storage.

While its unit is resharded a parameter holds no storage (as FSDP1 frees a flat parameter), and
its class is ShardedParameter, an nn.Parameter whose `__torch_function__` refuses every
computation on it then with an error that names the parameter and its unit, instead of reading
stale or released memory. What reads no element keeps working: its shape, dtype and
requires_grad, `.grad`, `named_parameters()`, printing the module.

While its unit is unsharded the parameter is of its own class again (nn.Parameter), so that its
forward and backward pay no Python `__torch_function__` per operation.
"""
import collections

import torch

__all__ = ["ShardedParameter", "storageless"]

# Tensor methods that read no element: attribute access, metadata, hooks, and what the binding
# itself does to a resharded parameter (re-pointing `.data`, packing saved tensors).
_METADATA = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "numel", "nelement", "stride",
    "storage_offset", "is_contiguous", "untyped_storage", "element_size", "is_floating_point",
    "is_complex", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "_is_view", "__hash__", "get_device", "type",
})


def _released(x):
    return type(x) is ShardedParameter


class ShardedParameter(torch.nn.Parameter):
    """A parameter of a fully_shard unit while the unit is resharded (set by fully_shard on the
    module's own parameters, so their identity is kept)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for a in (*args, *kwargs.values()):
                for x in (a if isinstance(a, (list, tuple)) else (a,)):
                    if _released(x):
                        raise RuntimeError(
                            f"ragshard: parameter '{x._ragshard_name}' is used while its unit "
                            f"'{x._ragshard_unit}' is resharded: it holds no storage outside "
                            "the unit's forward and backward (call the unit itself, "
                            "ShardedModule.full_state() for the values, or step it with a "
                            "ragshard optimizer: ragshard.torch.ShardedOptimizer)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def adopt(p, name, unit):
    """Makes `p` a parameter of unit `unit` (same object), named for errors; it keeps its class
    until it is first resharded (set_live)."""
    if type(p) is not ShardedParameter:
        p._ragshard_class = type(p)  # its class while its unit is unsharded
    p._ragshard_name, p._ragshard_unit = name, unit


def set_live(p, live):
    """Live: the parameter's own class; not live: ShardedParameter, which refuses computation.
    Changing the class of the same object keeps its identity (optimizers, hooks, names)."""
    p.__class__ = p._ragshard_class if live else ShardedParameter


def storageless(shape, dtype, device=None):
    """A tensor of `shape` whose storage holds nothing: any computation on it raises instead of
    reading memory."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


class Saved:
    """A tensor saved for backward as its place in a unit's unsharded buffer."""
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit, self.offset, self.size, self.stride = unit, offset, size, stride


Piece = collections.namedtuple("Piece", "index lo hi matrix")
Piece.__doc__ = "The part of parameter `index` in this rank's shard: elements [lo, hi)."
Matrix = collections.namedtuple("Matrix",
                                "unit offset numel shape owner packed index name kind block")
Matrix.__doc__ = ("A whole-matrix tensor (Muon's or Shampoo's): its place in the unit, its owner "
                  "rank, its offset in the owner's packed buffer, its name, its optimizer kind "
                  "('matrix' or 'shampoo') and Shampoo's block side (0: one block).")

WHOLE_MATRIX = {"OPTIMIZER_MATRIX": "matrix", "OPTIMIZER_SHAMPOO": "shampoo"}  # plan -> kind
