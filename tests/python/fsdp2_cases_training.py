"""The training idioms of fsdp2_cases.py: units, gradient accumulation, tied weights, freezing,
unused parameters, several forwards, hooks, nested inputs, eval, every clipping path and the
state dicts. Each case_<name>(m) runs case <name> over Mode `m`; it returns (the model, each
step's loss, what else it records)."""
import math
import os
import sys

import torch

from fsdp2_case_models import (ROWS, STEPS, Both, Net, NestedNet, batch, ce, plain,  # noqa: F401
                               train, units_of, value)


def case_units_nested(m):
    """Several units, one nested in another (blocks[0].up inside blocks[0])."""
    net = Net()
    net, model, opt = plain(m, net, [net.blocks[0].up] + list(net.blocks))
    return model, train(m, model, opt), {}


def case_accum_backward(m):
    """Gradient accumulation by repeated backward: 3 micro-batches, one step."""
    net, model, opt = plain(m)
    return model, train(m, model, opt, steps=3, micro=3), {}


def case_accum_no_sync(m):
    """Accumulation without reduction (set_requires_gradient_sync(False)) but for the last
    micro-batch of each step."""
    net, model, opt = plain(m)
    losses = train(m, model, opt, steps=3, micro=3, before=lambda s, i: m.api(
        net, "set_requires_gradient_sync", i == 2))
    return model, losses, {}


def case_accum_mixed(m):
    """Both ways in one step: reduced, not reduced, reduced."""
    net, model, opt = plain(m)
    losses = train(m, model, opt, steps=3, micro=3, before=lambda s, i: m.api(
        net, "set_requires_gradient_sync", i != 1))
    return model, losses, {}


def case_accum_across_steps(m):
    """zero_grad only every second step: the next backward adds to the gradient the step used,
    as in PyTorch."""
    net, model, opt = plain(m)
    return model, train(m, model, opt, steps=4, micro=2, zero_every=2), {}


def case_accum_reshard_after_backward(m):
    """set_reshard_after_backward(False) on the micro-batches but the last (FSDP2's way to
    skip re-gathering between them), with reduction off for them too."""
    net, model, opt = plain(m)

    def before(step, i):
        last = i == 2
        m.api(net, "set_requires_gradient_sync", last)
        m.api(net, "set_reshard_after_backward", last)
    return model, train(m, model, opt, steps=3, micro=3, before=before), {}


def case_accum_muon(m):
    """Accumulation by repeated backward under Muon (the blocks' matrices through their
    owners), zero_grad every second step (the gradients the step sent through the owners are
    the next backward's to add to)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "examples"))
    net = Net()
    matrices = [p for n, p in net.named_parameters() if p.dim() == 2 and n.startswith("blocks")]
    if m.name == "ragshard":
        import ragshard.torch as rt
        ids = {id(p) for p in matrices}
        names = {n for n, p in net.named_parameters() if id(p) in ids}
        model = m.wrap(net, units_of(net),
                       optimizer=lambda n, p: "matrix" if n in names else "elementwise")
        m.model_for_mean = model
        opt = rt.ShardedMuon(model, lr=0.02, adamw_lr=1e-2)
    else:
        import reference_optim
        model = m.wrap(net, units_of(net))
        m.model_for_mean = model
        opt = Both(reference_optim.Muon(matrices, lr=0.02),
                    torch.optim.AdamW([p for p in net.parameters()
                                       if all(p is not q for q in matrices)], lr=1e-2,
                                      weight_decay=0.0))
    return model, train(m, model, opt, steps=4, micro=2, zero_every=2), {}


def case_tied(m):
    """The head's weight is the embedding's, the embedding a unit of its own (ragshard gathers
    it for the head too); FSDP2 needs a tie in one module, so there both stay in the root."""
    net = Net(tie=True)
    units = ([net.embed] if m.name == "ragshard" else []) + units_of(net)
    net, model, opt = plain(m, net, units)
    return model, train(m, model, opt), {}


def case_frozen_then_unfrozen(m):
    """blocks[1] frozen before wrapping, trained from step 2 on."""
    net = Net()
    for p in net.blocks[1].parameters():
        p.requires_grad_(False)
    net, model, opt = plain(m, net)

    def before(step, i):
        if step == 2:
            for p in net.blocks[1].parameters():
                p.requires_grad_(True)
    return model, train(m, model, opt, before=before), {}


def case_unfrozen_then_frozen(m):
    """blocks[1].up trained until step 2, frozen from then on (its values must not move)."""
    net, model, opt = plain(m)

    def before(step, i):
        if step == 2:
            for p in net.blocks[1].up.parameters():
                p.requires_grad_(False)
    return model, train(m, model, opt, before=before), {}


def case_unused(m):
    """A unit that no forward calls (net.extra) and parameters no forward uses (each block's
    spare): no gradient, never stepped."""
    net = Net(extra_block=True)
    net, model, opt = plain(m, net, units_of(net) + [net.extra])
    return model, train(m, model, opt), {}


def case_multi_forward(m):
    """Two forwards (each half of the rows) before one backward."""
    net, model, opt = plain(m)
    losses = []
    for step in range(STEPS):
        x, y = m.data(step)
        if m.name == "reference":  # the ranks' halves, in one process
            h = ROWS // 2
            parts = [(x[r * ROWS:r * ROWS + h], x[r * ROWS + h:(r + 1) * ROWS],
                      y[r * ROWS:r * ROWS + h], y[r * ROWS + h:(r + 1) * ROWS])
                     for r in range(m.world)]
            loss = sum((ce(model(a), c) + ce(model(b), d)) / 2 for a, b, c, d in parts) / m.world
        else:
            h = ROWS // 2
            loss = (ce(model(x[:h]), y[:h]) + ce(model(x[h:]), y[h:])) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(m.mean(loss.detach()))
    return model, losses, {}


def _hooks(block, seen, post_first=False):
    """Hooks on `block` that read its parameters and change the numbers. `post_first`: the
    forward hook prepended (FSDP2 reshards in its own forward hook, registered at fully_shard:
    a user's hook registered later that reads the parameters must come first; ragshard keeps
    its reshard after the user's forward hooks whenever they were registered)."""
    def pre(mod, args):
        seen.append(value(mod.up.weight.sum()))
        return (args[0] + 0.01 * mod.up.bias.mean(),)

    def post(mod, args, out):
        return out * (1 + 0.1 * mod.down.bias.mean())

    def bw_pre(mod, grad_output):
        seen.append(value(mod.up.weight.abs().sum()))
        return (grad_output[0] * 0.9,)

    def bw(mod, grad_input, grad_output):
        seen.append(value(mod.down.weight.abs().sum()))
        return (grad_input[0] * 1.1,) if grad_input[0] is not None else None
    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post, prepend=post_first)
    block.register_full_backward_pre_hook(bw_pre)
    block.register_full_backward_hook(bw)


def case_hooks_before(m):
    """Forward pre-hook, forward hook, full backward pre-hook and backward hook registered on a
    unit before wrapping, each reading the unit's parameters."""
    net, seen = Net(), []
    _hooks(net.blocks[1], seen)
    net, model, opt = plain(m, net)
    return model, train(m, model, opt), {"seen": seen}


def case_hooks_after(m):
    """The same hooks, registered after wrapping."""
    net, seen = Net(), []
    net, model, opt = plain(m, net)
    _hooks(net.blocks[1], seen, post_first=m.name == "fsdp2")
    return model, train(m, model, opt), {"seen": seen}


def case_tensor_hooks(m):
    """A tensor hook on a unit's output that reads the unit's parameters in backward."""
    net, model, opt = plain(m)
    net.tensor_hook = (1, lambda g, b: g * (0.5 + 0.0 * b.up.weight.sum()))
    return model, train(m, model, opt), {}


def case_nested_io(m):
    """A unit taking a dict, a float and a string, returning a tuple with a dict, None and a
    list."""
    net = NestedNet()
    net, model, opt = plain(m, net, [net.blocks[0], net.nested, net.blocks[1]])
    return model, train(m, model, opt), {}


def case_train_eval(m):
    """Each step: a validation forward under eval() and no_grad(), then the training step."""
    net, model, opt = plain(m)
    vals = []

    def before(step, i):
        x, y = m.data(step, 7)
        model.eval()
        with torch.no_grad():
            vals.append(m.mean(ce(model(x), y)))
        model.train()
    return model, train(m, model, opt, before=before), {"val": vals}


def _clip(m, fn):
    net, model, opt = plain(m)
    norms = []
    return model, train(m, model, opt, after_backward=lambda s: norms.append(fn(net))), \
        {"norms": norms}


def case_clip_norm2(m):
    """clip_grad_norm_ at 0.5 (the 2-norm) after every backward."""
    return _clip(m, lambda net: value(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))


def case_clip_inf(m):
    """clip_grad_norm_ with norm_type inf, at 0.05."""
    return _clip(m, lambda net: value(torch.nn.utils.clip_grad_norm_(
        net.parameters(), 0.05, norm_type=math.inf)))


def case_clip_p(m):
    """clip_grad_norm_ with norm_type 3 and foreach=True."""
    return _clip(m, lambda net: value(torch.nn.utils.clip_grad_norm_(
        net.parameters(), 0.5, norm_type=3.0, foreach=True)))


def case_clip_total_norm(m):
    """get_total_norm and clip_grads_with_norm_ (torchtitan's path)."""
    def fn(net):
        params = list(net.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, total, None)
        return value(total)
    return _clip(m, fn)


def case_clip_value(m):
    """clip_grad_value_ at 0.02."""
    def fn(net):
        torch.nn.utils.clip_grad_value_(net.parameters(), 0.02)
        return 0.0
    return _clip(m, fn)


def case_clip_nonfinite(m):
    """A NaN gradient in step 1: error_if_nonfinite raises; without it, the norm is NaN."""
    net, model, opt = plain(m)
    losses, seen = [], []
    for step in range(3):
        x, y = m.data(step)
        loss = ce(model(x), y) * (math.nan if step == 1 else 1.0)
        loss.backward()
        if step == 1:
            try:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, error_if_nonfinite=True)
                seen.append("no error")
            except RuntimeError as e:
                seen.append("non-finite" if "non-finite" in str(e) else str(e))
            seen.append(math.isnan(value(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5))))
            opt.zero_grad()
            continue
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(m.mean(loss.detach()))
    return model, losses, {"seen": seen}


def case_state_dict_full(m):
    """After step 2 a full state dict (on rank 0) loads into a new model and optimizer, which
    go on; the reference goes on with a new optimizer."""
    net, model, opt = plain(m)
    losses = train(m, model, opt, steps=2)
    path = os.path.join(m.args.out, "state_dict_full.pt")
    if m.name == "ragshard":
        sd = model.state_dict()
    elif m.name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            get_model_state_dict
        sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    else:
        sd = {k: v.clone() for k, v in net.state_dict().items()}
    if m.rank == 0:
        torch.save(sd, path)
    m.barrier(model)
    sd = torch.load(path)
    m.end(model)
    net2 = Net()
    with torch.no_grad():
        for p in net2.parameters():
            p.zero_()  # the load must put every value
    if m.name == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, \
            set_model_state_dict
        net2, model2, opt2 = plain(m, net2)
        set_model_state_dict(net2, sd, options=StateDictOptions(full_state_dict=True))
    else:
        net2, model2, opt2 = plain(m, net2)
        model2.load_state_dict(sd)
    losses += [x for x in train(m, model2, opt2, steps=2, before=None)]
    return model2, losses, {}


def case_state_dict_dcp(m):
    """After step 2 a DCP checkpoint (model and optimizer) loads into a new model and optimizer,
    which go on; the reference goes on uninterrupted. Every parameter has a gradient (FSDP2's
    optimizer state dict of a new optimizer names the state of every parameter)."""
    net, model, opt = plain(m, Net(use_spare=True))
    losses = train(m, model, opt, steps=2)
    if m.name == "reference":
        return model, losses + _continue(m, model, opt, 2), {}
    path = os.path.join(m.args.out, "dcp-" + m.name)
    if m.name == "ragshard":
        from ragshard import checkpoint
        checkpoint.save_dcp(model, opt, path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, \
            get_optimizer_state_dict
        dcp.save({"model": get_model_state_dict(net),
                  "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    m.barrier(model)
    m.end(model)
    net2, model2, opt2 = plain(m, Net(use_spare=True))
    if m.name == "ragshard":
        from ragshard import checkpoint
        checkpoint.load_dcp(model2, opt2, path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, \
            get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict
        state = {"model": get_model_state_dict(net2),
                 "optim": get_optimizer_state_dict(net2, opt2)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(net2, state["model"])
        set_optimizer_state_dict(net2, opt2, state["optim"])
    return model2, losses + _continue(m, model2, opt2, 2), {}


def _continue(m, model, opt, start):
    losses = []
    for step in range(start, start + 2):
        x, y = m.data(step)
        loss = ce(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(m.mean(loss.detach()))
    return losses
