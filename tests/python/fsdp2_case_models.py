"""What the cases of fsdp2_cases.py share: the models, the data, the loss, and the training
loop most of them run (`train`, over a Mode: fsdp2_cases.py)."""

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


class Both:
    """Two optimizers stepped and zeroed as one."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()
