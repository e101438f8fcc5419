"""The cases of fsdp2_cases.py for FSDP2's module API: reshard_after_forward, explicit prefetch,
the gradient divide factor, unshard/reshard, set_unshard_in_backward,
register_fsdp_forward_method, the hints, ignored_params, CPU offload, mixed precision; and the
accumulation cases of the other configurations (int8 gathers, HSDP, AMSP factors)."""
import torch
import torch.nn.functional as F

from fsdp2_case_models import Mlp, Net, ce, float_batch, plain, train, units_of


def case_reshard_after_forward_false(m):
    """reshard_after_forward=False: each unit kept unsharded from its forward to its backward."""
    net, model, opt = plain(m, reshard_after_forward=False)
    return model, train(m, model, opt), {}


def case_reshard_after_forward_int(m):
    """reshard_after_forward=2: after forward each unit is kept by groups of 2 ranks."""
    net, model, opt = plain(m, reshard_after_forward=2)
    return model, train(m, model, opt), {}


def case_set_reshard_after_forward(m):
    """set_reshard_after_forward(False) on one unit, True elsewhere."""
    net, model, opt = plain(m)
    m.api(net.blocks[1], "set_reshard_after_forward", False)
    return model, train(m, model, opt), {}


def case_explicit_prefetch(m):
    """set_modules_to_forward_prefetch / set_modules_to_backward_prefetch chains."""
    net, model, opt = plain(m)
    b = net.blocks
    for i in range(len(b) - 1):
        m.api(b[i], "set_modules_to_forward_prefetch", [b[i + 1]])
        m.api(b[i + 1], "set_modules_to_backward_prefetch", [b[i]])
    return model, train(m, model, opt), {}


def case_divide_factor(m):
    """set_gradient_divide_factor(1.0) on every module: the gradients' sum over the ranks, not
    their mean (plain SGD, whose step shows the scale; the reference's learning rate is W times
    larger). set_force_sum_reduction_for_comms too."""
    lr = 0.02 * (m.world if m.name == "reference" else 1)
    net, model, opt = plain(m, opt_cls=torch.optim.SGD, opt_kw={"lr": lr})
    for mod in units_of(net) + [net]:
        m.api(mod, "set_gradient_divide_factor", 1.0)
        # (gloo has no pre-multiplied sum: FSDP2 sums and divides by itself with this)
        m.api(mod, "set_force_sum_reduction_for_comms", True)
    return model, train(m, model, opt), {}


def case_unshard_reshard(m):
    """unshard() (and unshard(async_op=True).wait()) outside forward makes the full parameters
    readable; reshard() releases them."""
    net, model, opt = plain(m)
    sums = []

    def after(step):
        if m.name == "reference":
            sums.append(float(net.blocks[0].up.weight.detach().sum()))
            sums.append(float(net.blocks[1].down.weight.detach().sum()))
            return
        net.blocks[0].unshard()
        sums.append(float(net.blocks[0].up.weight.detach().sum()))
        net.blocks[0].reshard()
        handle = net.blocks[1].unshard(async_op=True)
        handle.wait()
        sums.append(float(net.blocks[1].down.weight.detach().sum()))
        net.blocks[1].reshard()
    return model, train(m, model, opt, after_backward=after), {"sums": sums}


def case_unshard_in_backward(m):
    """The embedding as a unit whose backward needs no gather (set_unshard_in_backward)."""
    net = Net()
    net, model, opt = plain(m, net, [net.embed] + units_of(net))
    m.api(net.embed, "set_unshard_in_backward", False)
    return model, train(m, model, opt), {}


def case_forward_method(m):
    """A unit method other than forward, registered with register_fsdp_forward_method."""
    net = Net()
    net.call_twice = True
    net, model, opt = plain(m, net)
    if m.name == "ragshard":
        from ragshard.torch import register_fsdp_forward_method
        register_fsdp_forward_method(net.blocks[1], "twice")
    elif m.name == "fsdp2":
        from torch.distributed.fsdp import register_fsdp_forward_method
        register_fsdp_forward_method(net.blocks[1], "twice")
    return model, train(m, model, opt), {}


def case_hints(m):
    """FSDP2's hints that change no number: set_is_last_backward, set_force_sum_reduction_for_
    comms, set_allocate_memory_from_process_group_for_comm, share_comm_ctx."""
    net, model, opt = plain(m)
    for mod in units_of(net) + [net]:
        m.api(mod, "set_force_sum_reduction_for_comms", True)
        m.api(mod, "set_allocate_memory_from_process_group_for_comm", True)
    m.api(net, "set_is_last_backward", True)
    return model, train(m, model, opt), {}


def case_ignored(m):
    """ignored_params: the final norm's parameters, frozen, stay plain and whole on every
    rank."""
    net = Net()
    ignored = set(net.norm.parameters())
    for p in ignored:
        p.requires_grad_(False)
    kwargs = {"ignored_params": ignored} if m.name != "reference" else {}
    model = m.wrap(net, units_of(net), **kwargs)
    m.model_for_mean = model
    # (after wrapping: FSDP2's parameters are new objects)
    opt = m.optimizer(model, torch.optim.AdamW, [p for p in model.parameters()
                                                 if p.requires_grad], lr=1e-2)
    kinds = sorted({type(p).__name__ for p in ignored})
    return model, train(m, model, opt), {"ignored_kinds": kinds}


def case_cpu_offload(m):
    """offload_policy=CPUOffloadPolicy(): the shards in host memory (ragshard's host backends
    keep them there)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} \
        if m.name != "reference" else {}
    net, model, opt = plain(m, **kwargs)
    return model, train(m, model, opt), {}


def case_mp_bf16_accum(m):
    """bf16 parameters, fp32 reduction, accumulation by repeated backward (against FSDP2 with
    the same policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net, model, opt = plain(m, mp_policy=mp)
    return model, train(m, model, opt, steps=3, micro=3), {}


def case_mp_output(m):
    """Float inputs cast to bf16 (cast_forward_inputs) and fp32 outputs (output_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              output_dtype=torch.float32)
    net = Mlp()
    model = m.wrap(net, list(net.layers), mp_policy=mp)
    m.model_for_mean = model
    opt = m.optimizer(model, torch.optim.AdamW, lr=1e-2)
    dtypes = []

    def loss_fn(out, y):
        dtypes.append(str(out.dtype))
        return F.mse_loss(out, y)
    return model, train(m, model, opt, kind=float_batch, loss_fn=loss_fn), {"dtypes": dtypes}


def _quantized(m, micro):
    if m.name != "ragshard":
        raise ValueError("quantized gathers are ragshard's (compared with each other)")
    net = Net()
    model = m.wrap(net, units_of(net), quantize="int8")
    m.model_for_mean = model
    opt = m.optimizer(model, torch.optim.AdamW, lr=1e-2)
    if micro > 1:
        return model, train(m, model, opt, steps=3, micro=micro), {}
    losses = []
    for step in range(3):  # the same 3 micro-batches in one backward
        parts = [m.data(step, i) for i in range(3)]
        x, y = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
        loss = ce(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(m.mean(loss.detach()))
    return model, losses, {}


def case_quantized_accum(m):
    """int8 gathers, accumulation by repeated backward (against quantized-once)."""
    return _quantized(m, 3)


def case_quantized_once(m):
    """int8 gathers, the same micro-batches in one backward."""
    return _quantized(m, 1)


def case_hsdp_accum(m):
    """HSDP (2 replicas of 2): accumulation with the replicas' all-reduce skipped but for the
    last micro-batch (set_requires_all_reduce)."""
    net, model, opt = plain(m)
    return model, train(m, model, opt, steps=3, micro=3, before=lambda s, i: m.api(
        net, "set_requires_all_reduce", i == 2)), {}


def case_hsdp_no_sync(m):
    """HSDP: accumulation with reduction off but for the last micro-batch."""
    net, model, opt = plain(m)
    return model, train(m, model, opt, steps=3, micro=3, before=lambda s, i: m.api(
        net, "set_requires_gradient_sync", i == 2)), {}


def case_amsp_accum(m):
    """AMSP factors (a job with g != os): accumulation by repeated backward."""
    net, model, opt = plain(m)
    return model, train(m, model, opt, steps=3, micro=3), {}
