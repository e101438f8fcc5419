"""torch.nn.utils.clip_grad_norm_ on a ShardedModule's parameters: the module's own clipping.

A fully_shard parameter's `.grad` is None by the time a script clips (the gradients are in the
gradient shards after the backward's reduce-scatter), so torch's function would find no
gradient, return 0 and clip nothing. ragshard.torch therefore wraps it: given the parameters of
one ShardedModule (all of those that require gradients, as `model.parameters()` gives them),
it clips by the global norm over every rank's shards (`ShardedModule.clip_grad_norm_`) and
returns that norm as a tensor, as torch's does; any other parameters go to torch's function
unchanged. A subset of a module's parameters, parameters of two modules, or a norm other than 2
are refused by name rather than clipped wrongly.
"""
import math
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["install"]

_TORCH = torch.nn.utils.clip_grad.clip_grad_norm_
# id(parameter) -> (its weak reference, its ShardedModule's): kept apart from the parameter, so
# that pickling or copying a parameter carries nothing of ragshard's.
_OWNERS = {}


def own(p, module):
    """Marks parameter `p` as one of ShardedModule `module`'s."""
    _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(module))


def _owner(p):
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {}
    for p in params:
        module = _owner(p)
        if module is not None:
            owners[id(module)] = module
    if not owners:
        return _TORCH(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(owners) > 1 or any(_owner(p) is None for p in params):
        raise ValueError("clip_grad_norm_: the parameters mix a fully_shard module's with "
                         "others; clip each module by itself (model.clip_grad_norm_)")
    module = next(iter(owners.values()))
    given = {id(p) for p in params}
    left = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in given]
    if left:
        raise ValueError(f"clip_grad_norm_: a fully_shard module is clipped by the norm of all "
                         f"its gradients; '{left[0]}' and {len(left) - 1} more are not among "
                         "the parameters given (pass model.parameters())")
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} on a fully_shard module; "
                         "only the 2-norm is supported")
    total = module.clip_grad_norm_(float(max_norm))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order 2.0 for gradients from `parameters` is "
                           f"non-finite ({total}), so it cannot be clipped")
    return torch.tensor(total)


def install():
    """Puts the wrapper where scripts call torch's (torch.nn.utils and its clip_grad module)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
