"""A Hugging Face `transformers` model trained with the standard LLM recipe, under torch's FSDP2
or under ragshard: one script, in which only the lines marked `# PORT` differ (the wrapping,
the optimizer's construction, clipping, the loss's mean over ranks, the checkpoint calls and
the launch). docs/porting.md puts the two paths side by side.

The model is built from a config (random init, nothing downloaded), seeded, so every rank and
every run builds the same initial weights: `--model llama` (LlamaForCausalLM, tied embeddings)
or `--model mixtral` (MixtralForCausalLM, a top-2 MoE), tiny by default, with eager attention
and eager experts (deterministic on the CPU). The recipe: AdamW with weight decay 0.1 on tensors
of 2 or more dimensions and 0 on the rest (two param groups), LambdaLR with --warmup linear
warmup steps and then cosine decay to 10 % of --lr at --steps, global-norm clipping at --clip,
fp32 or (--bf16) bf16 parameters with fp32 gradient reduction.

Data: token sequences from a fixed random bigram chain over the vocabulary (seeded), so the
loss has something to learn. Step s draws a global batch of --global-batch sequences from seed
(--seed, s); rank r of W takes rows [r*G/W, (r+1)*G/W), so the global batch is the same at any
world size. Each rank's loss is the mean over its rows; the gradients' mean over the ranks (what
FSDP2 and ragshard reduce) is then the gradient of the global batch's mean loss.

    # FSDP2, torchrun (or RANK/WORLD_SIZE with --store FILE: a FileStore instead of MASTER_ADDR)
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --backend fsdp2 --steps 8
    # ragshard: a planner and a daemon for the run, the ranks, everything stopped after
    ragshard-launch --standalone --nproc 4 examples/train_hf.py --backend ragshard --steps 8
    # resume: --save-dcp CKPT --save-after 4 writes a DCP checkpoint after step 4; another run
    # (either backend, any world size) continues it with --load-dcp CKPT
    ... examples/train_hf.py --backend fsdp2 --steps 8 --load-dcp CKPT

--out PATH writes PATH.json (rank 0): each step's loss (the global batch's mean), learning rate
and gradient norm (before clipping), the first step run, and each final parameter's sum and
norm (the fp32 masters under either backend, also with --bf16).
ragshard is imported from the installed package (`pip install .`) or from the build folder
(PYTHONPATH=build/python).
"""
import argparse
import json
import math
import os
import sys
import time

import torch

from example_faults import Kill  # beside this script
from example_flags import add_numbers


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["fsdp2", "ragshard"], required=True)
    p.add_argument("--model", choices=["llama", "mixtral"], default="llama")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--experts", type=int, default=4, help="mixtral: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="mixtral: experts per token")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per step, each its own loss.backward() (gradient "
                        "accumulation by repeated backward); each rank's rows split evenly")
    p.add_argument("--steps", type=int, default=8, help="the schedule's length and the last step")
    add_numbers(p, lr=3e-3, warmup=2, weight_decay=0.1, clip=1.0)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reductions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write OUT.json (rank 0)")
    p.add_argument("--save-dcp", default="", metavar="PATH", help="DCP checkpoint to write")
    p.add_argument("--save-after", type=int, default=0, metavar="N",
                   help="write --save-dcp after step N (default: after the last step)")
    p.add_argument("--load-dcp", default="", metavar="PATH",
                   help="resume from this DCP checkpoint (its step and scheduler included)")
    p.add_argument("--store", default="", metavar="FILE",
                   help="fsdp2 without torchrun: meet through a FileStore at FILE (RANK and "
                        "WORLD_SIZE from the environment)")
    p.add_argument("--kill-at", action="append", default=[], metavar="RANK:STEP:forward:MARK",
                   help="a fault for the recovery benchmarks (examples/example_faults.py): "
                        "SIGKILL rank RANK as step STEP starts, once (while MARK does not exist)")
    p.add_argument("--hold-at", action="append", default=[], metavar="RANK:STEP:forward:MARK",
                   help="as --kill-at, but the rank writes its pid into MARK and waits there "
                        "until something kills it (a benchmark that kills a whole node)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if any(k.split(":")[2:3] != ["forward"] for k in a.kill_at + a.hold_at):
        p.error("--kill-at, --hold-at: RANK:STEP:forward:MARK (the start of a step is this "
                "script's one fault point)")
    if a.steps < 1 or a.global_batch < 1 or a.warmup < 0:
        p.error("--steps and --global-batch must be at least 1, --warmup at least 0")
    if a.save_after and not a.save_dcp:
        p.error("--save-after needs --save-dcp")
    if not 0 <= a.save_after <= a.steps:
        p.error(f"--save-after {a.save_after} is not a step of 1..{a.steps}")
    if a.store and a.backend != "fsdp2":
        p.error("--store is for --backend fsdp2")
    return a


# --- shared: model, data, recipe ------------------------------------------------------------

def build_model(a):
    """The model from its config, the same initial weights on every rank (seeded)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                  num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads or a.heads, max_position_embeddings=a.seq,
                  use_cache=False)
    if a.model == "llama":
        config = LlamaConfig(tie_word_embeddings=True, **common)
    else:
        config = MixtralConfig(num_local_experts=a.experts, num_experts_per_tok=a.top_k,
                               tie_word_embeddings=False, **common)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             experts_implementation="eager")
    return model.train()


def bigram_chain(vocab, seed):
    g = torch.Generator().manual_seed(seed + 7919)
    return (torch.randn(vocab, vocab, generator=g) * 3.0).softmax(-1)


def global_batch(a, chain, step):
    """Step `step`'s global batch (inputs, targets), the same on every rank and world size."""
    g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
    x = torch.empty(a.global_batch, a.seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, a.vocab, (a.global_batch,), generator=g)
    for t in range(a.seq):
        x[:, t + 1] = torch.multinomial(chain[x[:, t]], 1, generator=g).squeeze(1)
    return x[:, :-1], x[:, 1:]


def param_groups(model, weight_decay):
    """Decay on tensors of 2 or more dimensions (matrices, embeddings, expert stacks), none on
    the rest (norms, biases)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def warmup_cosine(a):
    """LambdaLR's factor after `s` scheduler steps: linear warmup over a.warmup steps, then
    cosine decay to 0.1 at step a.steps."""
    def factor(s):
        if s < a.warmup:
            return (s + 1) / a.warmup
        progress = (s - a.warmup) / max(1, a.steps - a.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class Step:
    """The last step done, a Stateful entry of the checkpoint."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def checksums(named):
    """{name: [sum, norm]} of the full fp32 parameters."""
    return {n: [float(t.double().sum()), float(t.double().norm())] for n, t in named}


# --- the run --------------------------------------------------------------------------------

def main(argv=None):
    a = parse(argv)
    model = build_model(a)
    chain = bigram_chain(a.vocab, a.seed)
    fsdp2 = a.backend == "fsdp2"

    if fsdp2:  # PORT: torch.distributed's process group and FSDP2's wrapping
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if a.store:
            dist.init_process_group("gloo", init_method="file://" + a.store,
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group("gloo")  # torchrun's MASTER_ADDR, RANK, WORLD_SIZE
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if a.bf16 else None,
                                  reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    else:  # PORT: ragshard's wrapping (the client from ragshard-launch's or torchrun's env)
        import ragshard
        import ragshard.torch as rt
        from ragshard import checkpoint
        env = ragshard.Env()
        rank, world = env.rank, env.world_size
        model = rt.fully_shard(model, units=lambda m: list(m.model.layers),
                               param_dtype="bf16" if a.bf16 else "fp32")

    groups = param_groups(model, a.weight_decay)
    if fsdp2:  # PORT: the optimizer
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    else:
        opt = rt.ShardedOptimizer(model, torch.optim.AdamW, groups, lr=a.lr,
                                  betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(a))
    done = Step()

    # A rank restarted in a recovery in place holds its recovered state (resume_step counts
    # from the checkpoint's step): it does not load the checkpoint again (docs/recovery.md).
    if a.load_dcp and (fsdp2 or not model.resume_step):
        if fsdp2:  # PORT: loading a DCP checkpoint (written by either backend)
            state = {"model": get_model_state_dict(model),
                     "optim": get_optimizer_state_dict(model, opt), "sched": sched, "step": done}
            dcp.load(state, checkpoint_id=a.load_dcp)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
        else:
            checkpoint.load_dcp(model, opt, a.load_dcp, extra={"sched": sched, "step": done},
                                step=lambda: done.step)
    elif not fsdp2 and model.resume_step:
        # A recovery in place (docs/recovery.md): the job goes on from the last step every rank
        # completed; the data is seeded per step, and the schedule resumes there.
        done.step = model.resume_step
        for g in opt.param_groups:
            g.setdefault("initial_lr", g["lr"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(a),
                                                  last_epoch=done.step - 1)
    first = done.step

    if a.global_batch % world:
        sys.exit(f"--global-batch {a.global_batch} does not split evenly over {world} ranks")
    per_rank = a.global_batch // world
    if a.accum < 1 or per_rank % a.accum:
        sys.exit(f"--accum {a.accum} does not split a rank's {per_rank} sequences evenly")
    micro = per_rank // a.accum
    losses, lrs, norms, seconds = [], [], [], []
    kill = Kill(a.kill_at, rank, a.hold_at)
    for step in range(first, a.steps):
        kill.at(step, "forward")
        started = time.perf_counter()
        x, y = global_batch(a, chain, step)
        loss = 0.0
        for i in range(a.accum):  # the same lines under both: each micro-batch's backward adds
            rows = slice(rank * per_rank + i * micro, rank * per_rank + (i + 1) * micro)
            logits = model(input_ids=x[rows]).logits
            part = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab),
                                                     y[rows].reshape(-1)) / a.accum
            part.backward()
            loss = loss + part.detach()
        # The same line under both: torch's clip_grad_norm_, over FSDP2's DTensor gradients or
        # ragshard's ShardGrads, takes the global norm of every rank's shards.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        if fsdp2:  # PORT: FSDP2's norm is a DTensor
            norm = norm.full_tensor()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - started)  # (this rank's: the step's wall time)
        done.step = step + 1
        if fsdp2:  # PORT: the loss's mean over the ranks, for the log
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            global_loss = float(t) / world
        else:
            global_loss = model.all_reduce_scalar(float(loss.detach())) / world
        losses.append(global_loss)
        norms.append(float(norm))
        if rank == 0 and not a.quiet:
            print(f"{a.backend} step {step + 1}/{a.steps} loss {global_loss:.6f} "
                  f"lr {lrs[-1]:.3e} grad norm {norms[-1]:.4f}", flush=True)
        if a.save_dcp and step + 1 == (a.save_after or a.steps):
            if fsdp2:  # PORT: writing a DCP checkpoint (each rank its own shards)
                dcp.save({"model": get_model_state_dict(model),
                          "optim": get_optimizer_state_dict(model, opt),
                          "sched": sched, "step": done}, checkpoint_id=a.save_dcp)
            else:
                checkpoint.save_dcp(model, opt, a.save_dcp, extra={"sched": sched, "step": done})

    if fsdp2:  # PORT: the full parameters (every rank takes part in the gathers)
        full = [(n, p.full_tensor().detach().float()) for n, p in model.named_parameters()]
    else:
        full = sorted(model.full_state().items())
    sums = checksums(full)
    # ragshard: this node's daemon's pool (bench/recovery_cost.py: the state, its parities).
    node = {} if fsdp2 else {k: v for k, v in model.client.stats().items() if k in (
        "pool_used", "pool_peak", "protected_bytes", "parity_bytes", "staging_bytes")}
    if a.out and rank == 0:
        with open(a.out + ".json", "w") as f:
            json.dump({"backend": a.backend, "model": a.model, "world": world,
                       "first_step": first + 1, "losses": losses, "lrs": lrs,
                       "grad_norms": norms, "step_seconds": seconds, "checksums": sums,
                       "node": node}, f)
    if fsdp2:
        dist.destroy_process_group()
        # Leave without the interpreter's teardown: a gloo worker thread may drop its last
        # reference to a finished collective's tensor while Py_Finalize runs, which aborts the
        # process (examples/train_tiny.py says more). Everything is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
