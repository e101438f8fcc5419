"""fully_shard's PyTorch semantics, case by case: a model of PyTorch's own
nn.TransformerEncoderLayer units and a two-expert MoE unit, trained through ragshard, in one
process with plain PyTorch (--reference, on the same global batch), or under torch's FSDP2
(--fsdp2) on the same data.

Units: enc0, moe, enc1 (the root keeps the embeddings, the final norm and the head). The MoE
routes each token by its id (even: expert 0, odd: expert 1; the gate is the router's softmax),
and an expert that no token of a rank reaches is not called on that rank.

Cases (--case):
  plain                   every unit and expert used in every step
  skip-odd                enc1 skipped on every rank in odd steps (layer drop)
  expert-unused           no token reaches expert 1, on any rank
  expert-unused-one-rank  rank 0's tokens never reach expert 1 (the other ranks' do)
  eval-no-grad            a validation forward under eval() and no_grad() before each step
  two-forwards            two forwards (the halves of the rank's rows) before one backward
  frozen                  enc0 and the router frozen (requires_grad False)
  swapped-on-one-node     an error case: in step 1 the ranks of the first node run enc1 where
                          the others run enc0 (equal units), and the other way round; the job
                          must fail on every rank naming both units, not hang or go on

    ragshard-launch --planner ADDR --job J --nproc 4 --sockets S0,S1 --create-job \\
        examples/train_semantics.py --case skip-odd --set-to-none 0
    python examples/train_semantics.py --reference --world 4 --case skip-odd --set-to-none 0
    RANK=r WORLD_SIZE=4 python examples/train_semantics.py --fsdp2 STORE --case skip-odd
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_optim  # noqa: E402  (beside this script)
from example_flags import add_numbers  # noqa: E402
from tiny_model import batch, bigram_chain  # noqa: E402

CASES = ["plain", "skip-odd", "expert-unused", "expert-unused-one-rank", "eval-no-grad",
         "two-forwards", "frozen"]
ERROR_CASES = ["swapped-on-one-node"]


class Expert(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoE(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.router = torch.nn.Linear(d, 2, bias=False)
        self.experts = torch.nn.ModuleList(Expert(d) for _ in range(2))

    def forward(self, x, route):
        gate = self.router(x).softmax(-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            where = (route == e).nonzero(as_tuple=True)
            if where[0].numel() == 0:
                continue  # no token here: the expert is not called
            y = y.index_put(where, gate[where][:, e:e + 1] * expert(x[where]))
        return x + y


class Net(torch.nn.Module):
    def __init__(self, vocab, d, heads, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        # Without biases: attention's key bias has an exactly zero gradient (softmax ignores a
        # constant per row), and Adam would turn its rounding noise into full-size steps.
        layer = dict(d_model=d, nhead=heads, dim_feedforward=2 * d, dropout=0.0,
                     batch_first=True, bias=False)
        self.enc0 = torch.nn.TransformerEncoderLayer(**layer)
        self.moe = MoE(d)
        self.enc1 = torch.nn.TransformerEncoderLayer(**layer)
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx, route, skip=False, swap=False):
        first, last = (self.enc1, self.enc0) if swap else (self.enc0, self.enc1)
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        x = self.moe(first(x), route)
        if not skip:
            x = last(x)
        return self.head(self.ln(x))


def parse():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES + ERROR_CASES, default="plain")
    p.add_argument("--ranks-per-node", type=int, default=2,
                   help="swapped-on-one-node: the ranks of the first node")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--set-to-none", type=int, choices=[0, 1], default=1,
                   help="zero_grad(set_to_none=...) after each step")
    add_numbers(p, steps=6, dim=32, heads=2, vocab=32, seq=8)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    add_numbers(p, lr=1e-2, muon_lr=0.02, weight_decay=0.1, seed=0)
    p.add_argument("--reference", action="store_true", help="one process, plain PyTorch")
    p.add_argument("--world", type=int, default=0, help="W for --reference")
    p.add_argument("--reference-order", choices=["batch", "ranks"], default="batch",
                   help="--reference: the loss of the global batch at once (batch), or the mean "
                        "of each rank's loss on its rows, as the ranks compute them (ranks): the "
                        "same numbers summed in another order, whose distance from the first "
                        "is this case's floating-point noise floor")
    p.add_argument("--fsdp2", default="", metavar="STORE_FILE",
                   help="torch FSDP2 over gloo instead of ragshard (AdamW only)")
    p.add_argument("--out", default="", help="write losses (JSON) and final parameters (.pt)")
    a = p.parse_args()
    if a.fsdp2 and a.optimizer != "adamw":
        p.error("--fsdp2 runs AdamW only")
    return a


def is_matrix(name, p):
    return p.dim() == 2 and not name.startswith(("tok", "pos", "head"))


def routes(args, step, idx):
    """Each token's expert, for the global batch `idx` of step `step`."""
    route = idx % 2
    if args.case == "expert-unused":
        route = torch.zeros_like(route)
    elif args.case == "expert-unused-one-rank":
        route[:args.batch] = 0  # rank 0's rows
    return route


def step_inputs(args, chain, step, w):
    x, y = batch(chain, args.seed, step, w * args.batch, args.seq)
    return x, y, routes(args, step, x)


def loss_of(model, args, x, y, route, step):
    swap = (args.case == "swapped-on-one-node" and step == 1 and
            getattr(args, "rank", 0) < args.ranks_per_node)
    logits = model(x, route, skip=args.case == "skip-odd" and step % 2 == 1, swap=swap)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab),
                                             y.reshape(-1))


def build(args):
    torch.manual_seed(args.seed)
    model = Net(args.vocab, args.dim, args.heads, args.seq)
    if args.case == "frozen":
        for p in [*model.enc0.parameters(), *model.moe.router.parameters()]:
            p.requires_grad_(False)
    return model


def validate(model, args, chain, step, rows, w):
    """The validation loss of `rows` of the global batch (eval mode, no autograd)."""
    x, y = batch(chain, args.seed + 1, step, w * args.batch, args.seq)
    x, y = x[rows], y[rows]
    model.eval()
    with torch.no_grad():
        val = float(loss_of(model, args, x, y, x % 2, 0))
    model.train()
    return val


def reference(args, model, chain):
    w = args.world
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if args.optimizer == "muon" and is_matrix(n, p)]
    others = [p for n, p in named if not any(p is m for m in matrices)]
    wd = args.weight_decay if args.optimizer == "adamw" else 0.0
    adamw = torch.optim.AdamW(others, lr=args.lr, weight_decay=wd)
    # Muon written independently of ShardedMuon; as it, a matrix without a gradient is skipped.
    muon = reference_optim.Muon(matrices, lr=args.muon_lr) if matrices else None
    losses, vals = [], []
    for step in range(args.steps):
        if args.case == "eval-no-grad":
            vals.append(validate(model, args, chain, step, slice(0, w * args.batch), w))
        x, y, route = step_inputs(args, chain, step, w)
        if args.reference_order == "ranks":
            loss = sum(rank_loss(model, args, x, y, route, step, r) for r in range(w)) / w
        else:
            loss = loss_of(model, args, x, y, route, step)
        loss.backward()
        adamw.step()
        if muon is not None:
            muon.step()
        model.zero_grad(set_to_none=bool(args.set_to_none))
        losses.append(float(loss))
    return losses, vals, {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_loss(net, args, x, y, route, step, r):
    """Rank r's loss on its rows of the global batch (x, y, route)."""
    rows = slice(r * args.batch, (r + 1) * args.batch)
    x, y, route = x[rows], y[rows], route[rows]
    if args.case == "two-forwards":
        h = args.batch // 2
        return (loss_of(net, args, x[:h], y[:h], route[:h], step) +
                loss_of(net, args, x[h:], y[h:], route[h:], step)) / 2
    return loss_of(net, args, x, y, route, step)


def train_ranks(args, net, chain, r, w, step_fn, all_mean):
    """The loop of the distributed modes: this rank's rows; the losses averaged over ranks."""
    losses, vals = [], []
    rows = slice(r * args.batch, (r + 1) * args.batch)
    for step in range(args.steps):
        if args.case == "eval-no-grad":
            vals.append(all_mean(validate(net, args, chain, step, rows, w)))
        x, y, route = step_inputs(args, chain, step, w)
        loss = rank_loss(net, args, x, y, route, step, r)
        loss.backward()
        step_fn()
        losses.append(all_mean(float(loss)))
    return losses, vals


def sharded(args, model, chain):
    import ragshard
    import ragshard.torch as rt
    env = ragshard.Env()
    client = ragshard.connect(env)
    w, r = env.world_size, env.rank
    args.rank = r
    fsdp = rt.fully_shard(
        model, client, units=lambda m: [m.enc0, m.moe, m.enc1],
        optimizer=lambda n, p: "matrix" if args.optimizer == "muon" and is_matrix(n, p)
        else "elementwise",
        # Without prefetch the swapped case's first differing operation is the all-gather of
        # enc1 on one node against enc0's on the other: units of equal size.
        prefetch=0 if args.case == "swapped-on-one-node" else None)
    if args.optimizer == "muon":
        opt = rt.ShardedMuon(fsdp, lr=args.muon_lr, adamw_lr=args.lr)
    else:
        opt = rt.ShardedAdamW(fsdp, lr=args.lr, weight_decay=args.weight_decay)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=bool(args.set_to_none))

    losses, vals = train_ranks(args, fsdp, chain, r, w, step,
                               lambda v: fsdp.all_reduce_scalar(v) / w)
    return r, losses, vals, fsdp.state_dict()


def fsdp2(args, model, chain):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.rank = r
    dist.init_process_group("gloo", init_method="file://" + args.fsdp2, rank=r, world_size=w)
    mesh = init_device_mesh("cpu", (w,))
    for unit in (model.enc0, model.moe, model.enc1, model):
        fully_shard(unit, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=args.weight_decay)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=bool(args.set_to_none))

    def all_mean(v):
        t = torch.tensor([v])
        dist.all_reduce(t)
        return float(t) / w

    losses, vals = train_ranks(args, model, chain, r, w, step, all_mean)
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return r, losses, vals, state


def main():
    args = parse()
    model = build(args)
    chain = bigram_chain(args.vocab, args.seed)
    if args.reference:
        if args.world < 1:
            sys.exit("--reference needs --world W")
        losses, vals, state = reference(args, model, chain)
        rank = 0
    elif args.fsdp2:
        rank, losses, vals, state = fsdp2(args, model, chain)
    else:
        rank, losses, vals, state = sharded(args, model, chain)
    if args.out and rank == 0:
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "val_losses": vals}, f)
        torch.save(state, args.out + ".pt")
    if args.fsdp2:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # as train_tiny: no interpreter teardown under gloo


if __name__ == "__main__":
    main()
