"""The ranks of tests/python/test_dcp.py: examples/train_tiny.py's model with tied embeddings,
AdamW with decay and no-decay groups and a warmup LambdaLR, trained through ragshard on a
global batch that is the same at any world size, saving or loading a DCP checkpoint
(ragshard.checkpoint.save_dcp / load_dcp, with the scheduler as an extra entry).

    ragshard-launch ... tests/python/dcp_ranks.py --steps 8 --save DIR --save-after 4 --out F
    ragshard-launch ... tests/python/dcp_ranks.py --steps 8 --load DIR --out F   # steps 5..8
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import train_tiny  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, SEQ, GLOBAL_ROWS = 32, 64, 2, 4, 16, 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save", default="")
    p.add_argument("--save-after", type=int, default=0)
    p.add_argument("--load", default="")
    p.add_argument("--granule", default="rows:128", help="of the matrices")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import ragshard
    import ragshard.torch as rt
    from ragshard import checkpoint
    env = ragshard.Env()
    net = train_tiny.TinyLM(VOCAB, DIM, LAYERS, HEADS, SEQ, tie=True)
    init = train_tiny.seeded_init(net, 3)
    with torch.no_grad():
        for n, prm in net.named_parameters():
            prm.copy_(init(n, prm))
    model = rt.fully_shard(net, units=lambda m: [m.tok, *m.layers],
                           granule=lambda n, t: a.granule if t.dim() >= 2 else "element")
    opt = rt.ShardedAdamW(model, [
        {"params": [t for t in model.parameters() if t.ndim >= 2], "weight_decay": 0.1},
        {"params": [t for t in model.parameters() if t.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 2))
    first = 0
    if a.load:
        progress = {"step": torch.tensor(0)}
        checkpoint.load_dcp(model, opt, a.load, extra={"sched": sched, "progress": progress})
        first = int(progress["step"])
    chain = train_tiny.bigram_chain(VOCAB, 0)
    w, r = env.world_size, env.rank
    rows = GLOBAL_ROWS // w
    losses = {}
    for step in range(first, a.steps):
        x, y = train_tiny.batch(chain, 0, step, GLOBAL_ROWS, SEQ)
        x, y = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses[step + 1] = model.all_reduce_scalar(float(loss.detach())) / w
        if a.save and step + 1 == a.save_after:
            checkpoint.save_dcp(model, opt, a.save,
                                extra={"sched": sched, "progress": {"step": torch.tensor(step + 1)}})
    if r == 0:
        with open(a.out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
