"""fully_shard for PyTorch on ragshard, in three subpackages: `fsdp` (fully_shard's mechanics),
`optimizers` and `recovery` (recovery in place); their public names are imported here.

    import ragshard.torch as rt
    model = rt.fully_shard(model, units=lambda m: list(m.layers))  # client from the environment
    decay = [p for p in model.parameters() if p.ndim >= 2]
    opt = rt.ShardedOptimizer(model, torch.optim.AdamW, [
        {"params": decay, "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
    for batch in data:
        loss = model(batch).mean(); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # torch's own, on ShardGrads
        opt.step(); sched.step(); opt.zero_grad()

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

ragshard's hooks keep FSDP2's order against the user's (fsdp/hooks.py): the unshard before any
forward pre-hook of the user's, the reshard after the user's forward hooks, the backward's
unshard before the user's backward pre-hooks, whenever the user registered them.

Gradients accumulate as PyTorch's .grad does: each backward adds its reduced gradients into the
gradient shard (the daemon's reduce-scatter with accumulate) until zero_grad, so several
`loss.backward()` calls before one `opt.step()` sum, with or without no_sync. After a backward,
each parameter with a gradient holds in `.grad` a ShardGrad (fsdp/grads.py): this rank's piece of the
global gradient, on which torch's own clip_grad_norm_, get_total_norm, clip_grads_with_norm_ and
clip_grad_value_ compute over every rank's pieces (as on FSDP2's DTensor gradients); nothing of
torch's is replaced.

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
from .fsdp import (ShardedModule, ShardGrad, UnshardHandle, fully_shard,
                   register_fsdp_forward_method, share_comm_ctx)
from .optimizers import (ELEMENTWISE, ShardedAdam8bit, ShardedAdamW, ShardedMuon,
                         ShardedOptimizer, ShardedShampoo, newton_schulz)

__all__ = ["fully_shard", "ShardedModule", "ShardedOptimizer", "ShardedAdamW", "ShardedMuon",
           "ShardedAdam8bit", "ShardedShampoo", "ELEMENTWISE", "newton_schulz", "ShardGrad",
           "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]
