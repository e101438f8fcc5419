"""The per-unit settings of a fully_shard module, FSDP2's FSDPModule knobs by unit, and the
mixed-precision policy's casts of forward inputs and outputs. One object, owned by the module;
the hooks read it, the FSDPModule methods (fsdp_api.py) write it."""
import torch
from torch.utils import _pytree as pytree


class UnitSettings:
    """What each unit does around its forward and backward (lists indexed by unit).

    * sync: its backward reduce-scatters its gradients (FSDP2's set_requires_gradient_sync; the
      module's no_sync() turns every unit's off);
    * all_reduce: with HSDP replicas, the reduce-scatter is followed by the all-reduce over them
      (set_requires_all_reduce);
    * reshard_after_forward: True, False or n > 1 (groups of n local ranks);
    * reshard_after_backward: False keeps the unit unsharded after its backward, until the next
      optimizer step (set_reshard_after_backward);
    * unshard_in_backward: False skips its backward's unshard (set_unshard_in_backward);
    * forward_prefetch, backward_prefetch: None (the module's prefetch depth), or the units to
      prefetch when this one's forward or backward begins (set_modules_to_*_prefetch);
    * grad_scale: what its gradients are multiplied by before the reduction (mean over the W
      ranks): W / the divide factor of set_gradient_divide_factor, else 1.

    And the module's: `param_dtype` and `cast_inputs` (the mixed-precision policy casts the
    floating-point inputs of every unit's and the root's forward to it), `output_dtype` (casts
    the root's floating-point outputs: the policy of FSDP2's root module; on every unit, as a
    policy given to each fully_shard call of FSDP2 would, a unit's fp32 output would meet the
    next module's bf16 parameters), `post_optim_event` (waited for before the next unshard),
    `is_last_backward` and `force_sum` (FSDP2's hints, which change no number here)."""

    def __init__(self, n, reshard_after_forward, root, param_dtype=None, cast_inputs=True,
                 output_dtype=None):
        self.sync = [True] * n
        self.all_reduce = [True] * n
        # The root keeps its parameters from its forward to its backward, as FSDP2's root does
        # by default (its backward starts right after its forward).
        self.reshard_after_forward = [reshard_after_forward] * n
        if root is not None:
            self.reshard_after_forward[root] = False
        self.reshard_after_backward = [True] * n
        self.unshard_in_backward = [True] * n
        self.forward_prefetch = [None] * n
        self.backward_prefetch = [None] * n
        self.grad_scale = [1.0] * n
        self.param_dtype = param_dtype
        self.cast_inputs = cast_inputs and param_dtype is not None
        self.output_dtype = output_dtype
        self.post_optim_event = None
        self.is_last_backward = True
        self.force_sum = [False] * n

    def cast_forward_inputs(self, args, kwargs):
        """(args, kwargs) with floating-point tensors in the parameter dtype, where the policy
        says so; else None (unchanged)."""
        if not self.cast_inputs:
            return None
        return _cast(self.param_dtype, (args, kwargs))

    def cast_output(self, out):
        """`out` with floating-point tensors in output_dtype, where the policy sets one."""
        if self.output_dtype is None:
            return out
        return _cast(self.output_dtype, out)


def _cast(dtype, tree):
    def one(x):
        if torch.is_tensor(x) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x
    return pytree.tree_map(one, tree)
