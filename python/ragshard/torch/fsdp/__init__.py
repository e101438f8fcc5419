"""fully_shard's mechanics: the module whose parameters live in ragshard's buffers (module.py)
and its parts: the units and their inventory (units.py), this rank's place in the plan
(layout.py) and its shards (shards.py), the binding of parameters and gradients to the daemon's
buffers (buffers.py, params.py, views.py), the gathers (gathers.py, quantized.py), the hooks
(hooks.py, settings.py, trace.py), the sums over ranks (control.py), the gradients as torch sees
them (grads.py), the state dicts (state.py, pieces.py), meta-device initialization (meta.py),
and FSDP2's module API (api.py)."""
from .api import UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .grads import ShardGrad
from .module import ShardedModule, fully_shard

__all__ = ["ShardedModule", "fully_shard", "ShardGrad", "UnshardHandle",
           "register_fsdp_forward_method", "share_comm_ctx"]
