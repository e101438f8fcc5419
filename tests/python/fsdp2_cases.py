"""FSDP2's training scenarios, written for ragshard's suite (tests/python/test_fsdp2_cases.py),
after the kinds of case PyTorch's own FSDP2 tests cover (test/distributed/_composable/fsdp/):
each case trains a small decoder STEPS steps with AdamW (or what the case says) in one of three
modes, on the same global batch:

    ragshard-launch ... fsdp2_cases.py --mode ragshard --jobs PREFIX --cases A,B --out DIR
        ragshard, rank r of W (its rows of each batch); case C runs in job PREFIX-C (and
        PREFIX-C-b where it builds a second model), created beforehand
    RANK=r WORLD_SIZE=W python fsdp2_cases.py --mode fsdp2 --store FILE --cases ... --out DIR
        torch's FSDP2 over gloo on a CPU mesh (--hsdp: a (2, W/2) mesh, HSDP)
    python fsdp2_cases.py --mode reference --world W --cases ... --out DIR
        one process, plain PyTorch, the whole global batch at once

Rank 0 writes DIR/<case>.json (each step's loss averaged over the ranks, and what the case
records besides) and DIR/<case>.pt (the final parameters, whole). The cases call FSDP2's API
(set_requires_gradient_sync, unshard, ...) on the model's own modules in both distributed modes
(ragshard gives its units and the wrapped module FSDP2's methods); the reference does what
they mean in one process (nothing, mostly).
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

VOCAB, DIM, SEQ, ROWS = 32, 16, 8, 2  # ROWS: sequences per rank per micro-batch
STEPS = 4


class Block(torch.nn.Module):
    def __init__(self, d=DIM, use_spare=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.spare = torch.nn.Linear(d, d)  # unused unless `use_spare`: no gradient
        self.use_spare = use_spare

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(x))))
        if self.use_spare:
            h = h + self.spare(x)
        return x + h

    def twice(self, x):
        """A method other than forward (register_fsdp_forward_method's case)."""
        return self.forward(self.forward(x))


class Net(torch.nn.Module):
    def __init__(self, blocks=3, tie=False, extra_block=False, use_spare=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block(use_spare=use_spare) for _ in range(blocks))
        self.extra = Block() if extra_block else None  # a unit no forward calls
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.tensor_hook = None  # (block index, function of the grad and the block)
        self.call_twice = False

    def forward(self, idx):
        x = self.embed(idx)
        for i, b in enumerate(self.blocks):
            x = b.twice(x) if self.call_twice and i == 1 else b(x)
            if self.tensor_hook is not None and self.tensor_hook[0] == i and x.requires_grad:
                x.register_hook(lambda g, b=b: self.tensor_hook[1](g, b))
        return self.head(self.norm(x))


class Mlp(torch.nn.Module):
    """Float inputs (mixed precision casts them)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(DIM, DIM),
                                                              torch.nn.GELU())
                                          for _ in range(2))
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class Nested(torch.nn.Module):
    """A unit with non-tensor and nested inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, inputs, scale=1.0, tag="x"):
        y = self.block(inputs["x"]) * scale
        return y, {"aux": inputs["x"].mean() * 0.0 + y.mean(), "none": None, "tag": tag}, [1, 2]


class NestedNet(Net):
    def __init__(self):
        super().__init__(blocks=2)
        self.nested = Nested()

    def forward(self, idx):
        x = self.embed(idx)
        x = self.blocks[0](x)
        y, extra, _ = self.nested({"x": x, "unused": 3}, scale=0.5, tag="t")
        assert extra["none"] is None and extra["tag"] == "t"
        x = self.blocks[1](y) + 0.1 * extra["aux"]
        return self.head(self.norm(x))


def batch(step, micro=0, world=1):
    g = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=g)
    return idx, (idx * 3 + 1) % VOCAB


def float_batch(step, micro=0, world=1):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(world * ROWS, DIM, generator=g)
    return x, x.sum(-1, keepdim=True).sin()


def value(t):
    """A float of tensor `t` as every rank sees it: FSDP2's DTensors (a norm, a sharded
    parameter) through full_tensor(), as FSDP2 scripts read them."""
    t = t.detach()
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def ce(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


# -- the modes --------------------------------------------------------------------------------

class Mode:
    """What differs between the modes; the cases are written against it."""
    name = ""

    def __init__(self, args):
        self.args = args
        self.rank, self.world = 0, 1
        self.jobs = 0  # models built so far in this case

    def rows(self, t):
        """This rank's rows of a global batch (all of them in one process)."""
        return t[self.rank * ROWS:(self.rank + 1) * ROWS] if self.name != "reference" else t

    def data(self, step, micro=0, kind=batch):
        x, y = kind(step, micro, self.world)
        return self.rows(x), self.rows(y)

    def api(self, module, name, *args, **kwargs):
        """FSDP2's method `name` of `module`; nothing in one process."""
        if self.name != "reference":
            return getattr(module, name)(*args, **kwargs)
        return None


class Reference(Mode):
    name = "reference"

    def __init__(self, args):
        super().__init__(args)
        self.world = args.world

    def wrap(self, net, units, **kwargs):
        return net  # (mixed precision: the fp32 model, from which both bf16 runs differ)

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        return cls(list(model.parameters()) if params is None else params, **kw)

    def mean(self, v):
        return float(v)

    def full(self, model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def barrier(self, model):
        pass

    def end(self, model):
        pass


class Ragshard(Mode):
    name = "ragshard"

    def __init__(self, args):
        super().__init__(args)
        import ragshard
        self.env = ragshard.Env()
        self.rank, self.world = self.env.rank, self.env.world_size
        self.case = ""

    def wrap(self, net, units, **kwargs):
        import ragshard
        import ragshard.torch as rt
        job = f"{self.args.jobs}-{self.case}" + ("-b" if self.jobs else "")
        self.jobs += 1
        client = ragshard.Client(self.env.planner, self.env.socket, job, self.env.rank,
                                 self.env.node, 120000, self.env.token_file)
        return rt.fully_shard(net, client, units=lambda m: list(units), **kwargs)

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        import ragshard.torch as rt
        if cls == "muon":
            return rt.ShardedMuon(model, **kw)
        return rt.ShardedOptimizer(model, cls, params, **kw)

    def mean(self, v):
        return self.model_for_mean.all_reduce_scalar(float(v)) / self.world

    def full(self, model):
        return model.full_state(rank0_only=True)

    def barrier(self, model):
        model.all_reduce_scalar(0.0)

    def end(self, model):
        model.client.close()


class Fsdp2(Mode):
    name = "fsdp2"

    def __init__(self, args):
        super().__init__(args)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        self.dist = dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="file://" + args.store, rank=self.rank,
                                world_size=self.world)
        if args.hsdp:
            self.mesh = init_device_mesh("cpu", (2, self.world // 2),
                                         mesh_dim_names=("replicate", "shard"))
        else:
            self.mesh = init_device_mesh("cpu", (self.world,))

    def wrap(self, net, units, **kwargs):
        import dataclasses
        from torch.distributed.fsdp import fully_shard
        inner = dict(kwargs)
        mp = kwargs.get("mp_policy")
        if mp is not None and mp.output_dtype is not None:
            # ragshard's one policy casts the root's outputs; FSDP2's root policy does that
            inner["mp_policy"] = dataclasses.replace(mp, output_dtype=None)
        for u in units:
            fully_shard(u, mesh=self.mesh, **inner)
        kwargs.pop("reshard_after_forward", None)  # the root's default, as ragshard's
        fully_shard(net, mesh=self.mesh, **kwargs)
        return net

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        return cls(list(model.parameters()) if params is None else params, **kw)

    def mean(self, v):
        t = torch.tensor([float(v)], dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t) / self.world

    def full(self, model):
        out = {}
        for n, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = full.detach().float().clone()
        return out if self.rank == 0 else {}

    def barrier(self, model):
        self.dist.barrier()

    def end(self, model):
        pass


# -- the cases --------------------------------------------------------------------------------

def units_of(net):
    return list(net.blocks)


def train(m, model, opt, steps=STEPS, micro=1, net=None, before=None, after_backward=None,
          kind=batch, loss_fn=None, zero_every=1):
    """The loop most cases share: `micro` micro-batches, each `(loss / micro).backward()`, then
    one step; `before(step, i)` before micro-batch i; `after_backward(step)` before the step.
    Returns each step's loss (mean over ranks)."""
    losses = []
    loss_fn = loss_fn or (lambda out, y: ce(out, y))
    for step in range(steps):
        total = 0.0
        for i in range(micro):
            if before is not None:
                before(step, i)
            x, y = m.data(step, i, kind)
            loss = loss_fn(model(x), y) / micro
            loss.backward()
            total += float(loss.detach())
        if after_backward is not None:
            after_backward(step)
        opt.step()
        if (step + 1) % zero_every == 0:
            opt.zero_grad()
        losses.append(m.mean(total))
    return losses


def plain(m, net=None, units=None, opt_cls=torch.optim.AdamW, opt_kw=None, **wrap):
    net = net or Net()
    model = m.wrap(net, units or units_of(net), **wrap)
    m.model_for_mean = model
    opt = m.optimizer(model, opt_cls, **(opt_kw or {"lr": 1e-2}))
    return net, model, opt


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
        opt = _Both(reference_optim.Muon(matrices, lr=0.02),
                    torch.optim.AdamW([p for p in net.parameters()
                                       if all(p is not q for q in matrices)], lr=1e-2,
                                      weight_decay=0.0))
    return model, train(m, model, opt, steps=4, micro=2, zero_every=2), {}


class _Both:
    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


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
    return _clip(m, lambda net: value(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))


def case_clip_inf(m):
    return _clip(m, lambda net: value(torch.nn.utils.clip_grad_norm_(
        net.parameters(), 0.05, norm_type=math.inf)))


def case_clip_p(m):
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


def case_reshard_after_forward_false(m):
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


CASES = {name[5:].replace("_", "-"): fn for name, fn in dict(globals()).items()
         if name.startswith("case_")}
# The cases that build a second model (a second ragshard job).
TWO_MODELS = {"state-dict-full", "state-dict-dcp"}
# The cases FSDP2 has no counterpart of here (run against the reference only).
RAGSHARD_ONLY = {"amsp-accum", "accum-muon", "quantized-accum", "quantized-once"}
# The cases of an HSDP job (a (2, W/2) mesh), and of AMSP factors.
HSDP = {"hsdp-accum", "hsdp-no-sync"}
AMSP = {"amsp-accum"}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ragshard", "fsdp2", "reference"], required=True)
    p.add_argument("--cases", required=True, help="comma-separated, of: " + ", ".join(CASES))
    p.add_argument("--jobs", default="", help="ragshard: job prefix")
    p.add_argument("--store", default="", help="fsdp2: the FileStore file")
    p.add_argument("--hsdp", action="store_true", help="fsdp2: a (2, W/2) mesh")
    p.add_argument("--world", type=int, default=4, help="reference: W")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    mode = {"ragshard": Ragshard, "fsdp2": Fsdp2, "reference": Reference}[a.mode](a)
    os.makedirs(a.out, exist_ok=True)
    for case in a.cases.split(","):
        torch.manual_seed(0)
        mode.case, mode.jobs = case, 0
        model, losses, extra = CASES[case](mode)
        state = mode.full(model)
        if mode.rank == 0:
            with open(os.path.join(a.out, case + ".json"), "w") as f:
                json.dump({"losses": losses, **extra}, f)
            torch.save(state, os.path.join(a.out, case + ".pt"))
        mode.end(model)
    if a.mode == "fsdp2":
        mode.dist.barrier()
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown under gloo


if __name__ == "__main__":
    main()
