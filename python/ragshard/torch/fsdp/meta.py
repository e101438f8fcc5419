"""Meta-device initialization for fully_shard: a model built under `torch.device("meta")` holds
no values; fully_shard materializes only this rank's shard of each parameter.

`init(name, tensor)` returns the values of one parameter (or buffer) of the meta model, a CPU
tensor of its shape; fully_shard calls it one tensor at a time, keeps this rank's pieces and
drops the rest, so a rank's peak is its shards plus the largest tensor, never the full model.
With `init="empty"` the shards start at zero and the module refuses to run until a checkpoint
(`ragshard.checkpoint.load`) or a plain state_dict (`load_state_dict`) has been loaded.
"""
import ctypes
import ctypes.util

import torch

from .params import storageless

try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
    _TRIM = _LIBC.malloc_trim  # glibc
except (OSError, AttributeError, TypeError):
    _TRIM = None


def adopt_meta(module, init):
    """Replaces every meta parameter of `module` by a storage-less CPU parameter of the same
    shape, dtype and requires_grad (the same new object wherever the old one was tied), and
    every meta buffer by `init`'s values. Returns the ids of the new parameters, whose values
    fully_shard takes from `init`. Raises ValueError where the module has meta tensors and no
    `init`, or `init` is neither callable nor "empty"."""
    metas = [(n, p) for n, p in module.named_parameters() if p.is_meta]
    meta_buffers = [(n, b) for n, b in module.named_buffers() if b.is_meta]
    if not metas and not meta_buffers:
        if init is not None:
            raise ValueError("fully_shard: init= is for a module built on the meta device; "
                             "this one has no meta tensors")
        return set()
    if init is None:
        name = (metas or meta_buffers)[0][0]
        raise ValueError(f"fully_shard: '{name}' is on the meta device; pass init=fn (fn(name, "
                         "tensor) -> its values) or init='empty' (then load a checkpoint)")
    if not callable(init) and init != "empty":
        raise ValueError(f"fully_shard: init={init!r} is neither a function nor 'empty'")
    if meta_buffers and not callable(init):
        raise ValueError(f"fully_shard: buffer '{meta_buffers[0][0]}' is on the meta device; "
                         "init='empty' leaves only parameters to a load: pass init=fn")
    new = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(storageless(p.shape, p.dtype),
                                                    requires_grad=p.requires_grad)
                m._parameters[key] = new[id(p)]
    buffers = dict(meta_buffers)
    for mname, m in module.named_modules():
        for key, b in list(m._buffers.items()):
            fqn = f"{mname}.{key}" if mname else key
            if b is not None and b.is_meta:
                m._buffers[key] = values(init, fqn, buffers.get(fqn, b))
    return {id(p) for p in new.values()}


def values(init, name, tensor):
    """init(name, tensor), checked: a CPU tensor of the tensor's shape, as its dtype."""
    v = init(name, tensor)
    if not torch.is_tensor(v) or tuple(v.shape) != tuple(tensor.shape) or v.is_meta:
        got = tuple(v.shape) if torch.is_tensor(v) else type(v).__name__
        raise ValueError(f"fully_shard: init('{name}') returned {got}, not a CPU tensor of "
                         f"shape {tuple(tensor.shape)}")
    return v.detach().to(device="cpu", dtype=tensor.dtype)


def release_freed_memory():
    """Returns the heap's free pages to the system (glibc's malloc_trim; nothing elsewhere).
    After a whole tensor is freed, glibc keeps its pages for reuse once its mmap threshold has
    grown past the tensor's size, so without this a rank's private memory would grow by the
    heap's holes as init builds tensor after tensor."""
    if _TRIM is not None:
        _TRIM(0)
