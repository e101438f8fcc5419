"""Every ragshard optimizer as a torch optimizer, case by case (tests/python/test_optimizers.py):
each case trains examples/train_tiny.py's model for STEPS steps with two param groups of
different lr and weight_decay and a torch.optim.lr_scheduler, and writes every step's loss and
each group's lr, and the final parameters.

    ragshard-launch ... tests/python/optimizer_ranks.py --jobs PREFIX --out DIR   # job PREFIX-i
    python tests/python/optimizer_ranks.py --reference --out DIR

Through ragshard, case i runs in job PREFIX-i (created beforehand), each with its own
fully_shard of a freshly built model; the reference runs the same cases in one process with
torch's own optimizer (or examples/reference_optim.py's Muon, Shampoo and 8-bit Adam) on the
same micro-batch as every rank's (data()).
"""
import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import reference_optim  # noqa: E402
import train_tiny  # noqa: E402

STEPS = 5
VOCAB, DIM, LAYERS, HEADS, SEQ, ROWS = 32, 64, 2, 4, 16, 4  # ROWS: one micro-batch

# (optimizer, scheduler, {option: (group 0's, group 1's)}, other options)
CASES = [
    ("AdamW", "lambda", {"lr": (2e-2, 1e-2), "weight_decay": (0.1, 0.0)}, {}),
    ("Adam", "cosine", {"lr": (2e-2, 1e-2), "weight_decay": (0.01, 0.0)}, {}),
    ("SGD", "onecycle", {"lr": (5e-2, 2e-2), "weight_decay": (0.01, 0.0)},
     {"momentum": 0.9, "nesterov": True}),
    ("RMSprop", "linear", {"lr": (1e-2, 2e-2), "weight_decay": (0.01, 0.0)},
     {"momentum": 0.5, "alpha": 0.9}),
    ("Adagrad", "sequential", {"lr": (5e-2, 2e-2), "weight_decay": (0.01, 0.0)}, {}),
    ("Adamax", "lambda", {"lr": (2e-2, 1e-2), "weight_decay": (0.01, 0.0)}, {}),
    ("NAdam", "cosine", {"lr": (2e-2, 1e-2), "weight_decay": (0.01, 0.0)}, {}),
    ("RAdam", "onecycle", {"lr": (2e-2, 1e-2), "weight_decay": (0.01, 0.0)}, {}),
    ("ASGD", "linear", {"lr": (2e-2, 1e-2), "weight_decay": (0.01, 0.0)}, {"t0": 2}),
    # Rprop has no weight decay: its groups differ in lr and step-size bounds.
    ("Rprop", "sequential", {"lr": (2e-2, 1e-2), "step_sizes": ((1e-6, 50), (1e-5, 20))}, {}),
    ("ShardedMuon", "sequential", {"lr": (2e-2, 4e-2), "weight_decay": (0.1, 0.0),
                                   "adamw_lr": (1e-2, 2e-2), "adamw_weight_decay": (0.1, 0.0)},
     {}),
    ("ShardedShampoo", "linear", {"lr": (0.5, 1.0), "weight_decay": (0.01, 0.0),
                                  "adamw_lr": (1e-2, 2e-2),
                                  "adamw_weight_decay": (0.01, 0.0)},
     {"precondition_every": 2}),
    ("ShardedAdam8bit", "onecycle", {"lr": (2e-2, 1e-2), "weight_decay": (0.1, 0.0)}, {}),
]
WHOLE_MATRIX = {"ShardedMuon": "matrix", "ShardedShampoo": "shampoo"}


def model():
    net = train_tiny.TinyLM(VOCAB, DIM, LAYERS, HEADS, SEQ)
    init = train_tiny.seeded_init(net, 11)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(init(n, p))
    return net


def split(named, case):
    """The two groups' parameters: for the whole-matrix optimizers, layer 1 against the rest (so
    that both groups hold matrices and other parameters); else decay (>= 2 dims) against the
    rest."""
    if case in WHOLE_MATRIX:
        first = [p for n, p in named if not n.startswith("layers.1.")]
        return first, [p for n, p in named if n.startswith("layers.1.")]
    return [p for _, p in named if p.ndim >= 2], [p for _, p in named if p.ndim < 2]


def groups(named, case, options):
    return [dict({k: v[i] for k, v in options.items()}, params=ps)
            for i, ps in enumerate(split(named, case))]


def scheduler(opt, kind):
    s = torch.optim.lr_scheduler
    if kind == "lambda":  # two warmup steps, then cosine decay
        return s.LambdaLR(opt, lambda t: (t + 1) / 2 if t < 2 else
                          0.5 * (1 + math.cos(math.pi * (t - 2) / (2 * STEPS))))
    if kind == "cosine":
        return s.CosineAnnealingLR(opt, T_max=2 * STEPS)
    if kind == "onecycle":
        return s.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=STEPS,
                            div_factor=2.0, final_div_factor=1.0, cycle_momentum=True)
    if kind == "linear":
        return s.LinearLR(opt, start_factor=0.5, total_iters=3)
    assert kind == "sequential"
    return s.SequentialLR(opt, [s.LinearLR(opt, start_factor=0.5, total_iters=2),
                                s.CosineAnnealingLR(opt, T_max=2 * STEPS)], milestones=[2])


def sharded_optimizer(fsdp, case, options, extra):
    import ragshard.torch as rt
    gs = groups(list(fsdp.named_parameters()), case, options)
    if case.startswith("Sharded"):
        return getattr(rt, case)(fsdp, gs, **extra)
    return rt.ShardedOptimizer(fsdp, getattr(torch.optim, case), gs, **extra)


def reference_optimizers(net, case, options, extra):
    """The one-process optimizers of a case: torch's own, or reference_optim's with AdamW for the
    parameters that are not the whole-matrix optimizer's (the matrices of the blocks)."""
    named = list(net.named_parameters())
    if case not in WHOLE_MATRIX and case != "ShardedAdam8bit":
        return [getattr(torch.optim, case)(groups(named, case, options), **extra)]
    if case == "ShardedAdam8bit":
        return [reference_optim.Adam8bit(groups(named, case, options))]
    opts, matrices, others = [], [], []
    for ps in split(named, case):
        mine = {id(p) for p in ps}
        matrices.append([p for n, p in named if id(p) in mine and train_tiny_matrix(n, p)])
        others.append([p for n, p in named if id(p) in mine and not train_tiny_matrix(n, p)])
    rule = [{"params": m, "lr": options["lr"][i], "weight_decay": options["weight_decay"][i]}
            for i, m in enumerate(matrices)]
    if case == "ShardedMuon":
        opts.append(reference_optim.Muon(rule))
    else:
        opts.append(reference_optim.Shampoo(rule, every=extra["precondition_every"]))
    opts.append(torch.optim.AdamW(
        [{"params": o, "lr": options["adamw_lr"][i],
          "weight_decay": options["adamw_weight_decay"][i]} for i, o in enumerate(others)]))
    return opts


def train_tiny_matrix(name, p):
    return p.dim() == 2 and "layers." in name  # tiny_optim.is_matrix: the blocks' matrices


def data(step):
    """Step `step`'s micro-batch, the same on every rank: the average of the ranks' gradients is
    then a sum of equal terms, bit for bit the one-process gradient, and what differs between a
    sharded run and its reference is the optimizer alone. (With different data per rank the
    order of the sum alone moves Adam's, RMSprop's and 8-bit Adam's parameters by 2e-5 to 2e-4
    over these 5 steps, in one process: the first steps of an adaptive optimizer amplify
    rounding. Different data per rank is what examples/train_tiny.py's tests run.)"""
    chain = train_tiny.bigram_chain(VOCAB, 0)
    return train_tiny.batch(chain, 0, step, ROWS, SEQ)


def loss_of(net, x, y):
    return torch.nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))


def run_reference(case, sched_kind, options, extra):
    net = model()
    opts = reference_optimizers(net, case, options, extra)
    scheds = [scheduler(o, sched_kind) for o in opts]
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append([g["lr"] for g in opts[0].param_groups])
        loss = loss_of(net, *data(step))
        loss.backward()
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        net.zero_grad()
        losses.append(float(loss.detach()))
    return losses, lrs, {n: p.detach().clone() for n, p in net.named_parameters()}


def run_sharded(case, sched_kind, options, extra, job):
    import ragshard
    import ragshard.torch as rt
    env = ragshard.Env()
    client = ragshard.Client(env.planner, env.socket, job, env.rank, env.node, 120000,
                             env.token_file)
    kind = WHOLE_MATRIX.get(case)
    fsdp = rt.fully_shard(
        model(), client, units=lambda m: list(m.layers),
        optimizer=lambda n, p: kind if kind and train_tiny_matrix(n, p) else "elementwise",
        # 8-bit Adam's vector blocks are 256 elements: vectors whole.
        granule=lambda n, p: "rows:128" if p.dim() >= 2 else (
            "whole" if case == "ShardedAdam8bit" else "element"))
    opt = sharded_optimizer(fsdp, case, options, extra)
    assert isinstance(opt, torch.optim.Optimizer), type(opt)
    sched = scheduler(opt, sched_kind)
    w = env.world_size
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append([g["lr"] for g in opt.param_groups])
        loss = loss_of(fsdp, *data(step))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(fsdp.all_reduce_scalar(float(loss.detach())) / w)
    return losses, lrs, fsdp.full_state()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reference", action="store_true")
    p.add_argument("--jobs", default="", help="job prefix: case i runs in job PREFIX-i")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank = int(os.environ.get("RAGSHARD_RANK", "0"))
    if a.reference:
        torch.set_num_threads(1)  # as each rank (ragshard.launch): the same kernels' blocking
    results, params = {}, {}
    for i, (case, sched_kind, options, extra) in enumerate(CASES):
        if a.reference:
            losses, lrs, state = run_reference(case, sched_kind, options, extra)
        else:
            losses, lrs, state = run_sharded(case, sched_kind, options, extra, f"{a.jobs}-{i}")
        results[case] = {"scheduler": sched_kind, "losses": losses, "lrs": lrs}
        params[case] = state
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f)
        torch.save(params, os.path.join(a.out, "params.pt"))


if __name__ == "__main__":
    main()
