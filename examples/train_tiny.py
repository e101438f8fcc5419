"""A small decoder-only transformer trained through ragshard (or, with --reference, in one
process with plain PyTorch on the same global batch, for comparison).

Data: synthetic token sequences from a fixed random bigram Markov chain over --vocab tokens
(seeded), so the loss has a known floor (the chain's entropy) and every run is reproducible.
Step s uses a global batch of G sequences drawn from seed (--seed, s), G = --global-batch
(default W x --batch); rank r takes rows [r*G/W, (r+1)*G/W), so runs at different W with the
same --global-batch see the same data.

    ragshard-launch --planner ADDR --job J --nproc 4 --sockets S0,S1 --create-job \\
        examples/train_tiny.py --steps 50
    python examples/train_tiny.py --reference --world 4 --steps 50
    ragshard-launch ... examples/train_tiny.py --global-batch 8 --steps 3 --save CKPT --save-step 3
    ragshard-launch ... examples/train_tiny.py --global-batch 8 --steps 6 --resume CKPT
    RANK=r WORLD_SIZE=4 python examples/train_tiny.py --ddp STORE_FILE --steps 50    # r = 0..3
    RANK=r WORLD_SIZE=4 python examples/train_tiny.py --fsdp2 STORE_FILE --steps 50  # r = 0..3

ragshard is imported from the installed package (`pip install .`) or from the build folder
(PYTHONPATH=build/python).
"""
import argparse
import importlib
import json
import os
import resource
import sys
import time

import torch

import tiny_optim  # beside this script
from example_faults import Kill  # beside this script
from example_flags import add_numbers  # beside this script
from tiny_model import TinyLM, batch, bigram_chain, seeded_init  # beside this script


def private_bytes():
    """This process's private memory now: Private_Clean + Private_Dirty of
    /proc/self/smaps_rollup (0 where the kernel has no such file)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) * 1024 for line in f
                       if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except OSError:
        return 0


def parse():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_numbers(p, steps=20, layers=4, dim=256, heads=4, vocab=64, seq=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--global-batch", type=int, default=0, metavar="G",
                   help="sequences per micro-batch over all ranks, split evenly among them "
                        "(default: W x --batch)")
    p.add_argument("--save", default="", metavar="DIR",
                   help="checkpoint root (a directory every node sees) for --save-step")
    p.add_argument("--save-step", default="", metavar="N[,M...]",
                   help="save a checkpoint after these steps (counted from 1)")
    p.add_argument("--async-save", action="store_true",
                   help="save asynchronously: training goes on while the shards are written")
    p.add_argument("--resume", default="", metavar="DIR",
                   help="load the newest checkpoint under DIR and continue from its step to "
                        "--steps")
    p.add_argument("--load-state", default="", metavar="FILE",
                   help="start from a plain state_dict (torch.save of the unsharded model's "
                        "parameters), with a fresh optimizer")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--reduce-every-backward", action="store_true",
                   help="with --accum: every micro-batch's backward reduce-scatters and adds "
                        "into the gradient shards (FSDP2's default), instead of no_sync until "
                        "the last")
    p.add_argument("--clip", type=float, default=0.0, help="max global grad norm (0: off)")
    tiny_optim.add_arguments(p)
    p.add_argument("--meta-init", action="store_true",
                   help="build the model on the meta device and materialize only each rank's "
                        "shards, each tensor from its own seeded generator (--reference: the "
                        "same values in one process)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="the output head uses the token embedding's weight; the embedding is "
                        "then a unit of its own, the head in the root: the tie crosses units")
    p.add_argument("--checkpoint-activations", nargs="?", const="non-reentrant", default="",
                   choices=["non-reentrant", "reentrant"],
                   help="recompute each layer's activations in backward "
                        "(torch.utils.checkpoint; non-reentrant unless told)")
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--granule", default="rows:128", help="granule of 2-D parameters")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                   action="store_false",
                   help="keep each layer unsharded from its forward to its backward (FSDP2's "
                        "reshard_after_forward=False)")
    p.add_argument("--reshard-after-forward", dest="reshard_groups", type=int, default=None,
                   metavar="N",
                   help="reshard each layer after its forward to groups of N local ranks "
                        "(FSDP2's reshard_after_forward=N; N = ranks per node)")
    p.add_argument("--prefetch", type=int, choices=[0, 1, 2], default=None,
                   help="layers unsharded ahead of the one in use (0: on demand); default: "
                        "the plan's choice, else 1")
    p.add_argument("--quantize", choices=["none", "int8", "fp8"], default="none",
                   help="block-quantized all-gather (one fp32 scale per 128x128 block)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model computes: cuda with --reference, or with the daemons' "
                   "cuda backend (their buffers are CUDA tensors); fp32 AdamW only")
    p.add_argument("--reference", action="store_true", help="one process, plain PyTorch")
    p.add_argument("--ddp", default="", metavar="STORE_FILE",
                   help="torch.distributed DDP over gloo instead of ragshard (RANK, WORLD_SIZE "
                        "from the environment; rendezvous through this file)")
    p.add_argument("--fsdp2", default="", metavar="STORE_FILE",
                   help="torch FSDP2 (torch.distributed.fsdp.fully_shard on every layer, then "
                        "the root) over gloo on a CPU device mesh instead of ragshard (RANK, "
                        "WORLD_SIZE from the environment; rendezvous through this file, "
                        "which must be new: absent or empty)")
    p.add_argument("--world", type=int, default=0, help="W for --reference")
    p.add_argument("--out", default="", help="write losses (JSON) and final parameters (.pt)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--kill-at", action="append", default=[], metavar="RANK:STEP:PHASE:MARK",
                   help="fault injection for the recovery tests: rank RANK (its rank in the job "
                        "that runs: after a shrink, the successor's) sends itself SIGKILL "
                        "in step STEP (1-based) at PHASE (forward, backward, step: inside the "
                        "optimizer's update, protected: after the step's protection, before it "
                        "commits (--redundancy), between: after zero_grad), once: only while the "
                        "file MARK does not exist (it is created first); repeatable")
    p.add_argument("--hold-at", action="append", default=[], metavar="RANK:STEP:PHASE:MARK",
                   help="as --kill-at, but the rank writes its pid into MARK and waits there "
                        "until something kills it (a test that kills a whole node: its daemon "
                        "and its ranks); repeatable")
    p.add_argument("--raise-at", action="append", default=[], metavar="RANK:STEP:PHASE:MARK",
                   help="as --kill-at, but the rank raises an uncaught RuntimeError there (a "
                        "crash: in a job that recovers in place it counts as lost, "
                        "docs/recovery.md); repeatable")
    a = p.parse_args()
    tiny_optim.check_arguments(p, a)
    try:
        a.save_steps = sorted({int(x) for x in a.save_step.split(",") if x})
    except ValueError:
        p.error(f"--save-step: '{a.save_step}' is not a list of step numbers")
    if a.save_steps and not a.save:
        p.error("--save-step needs --save DIR")
    if (a.save or a.resume) and (a.reference or a.ddp or a.fsdp2):
        p.error("--save and --resume are for runs through ragshard")
    if a.meta_init and (a.ddp or a.fsdp2):
        p.error("--meta-init is for runs through ragshard and --reference")
    if a.load_state and (a.ddp or a.fsdp2):
        p.error("--load-state is for runs through ragshard and --reference")
    for mode in ("ddp", "fsdp2"):
        if getattr(a, mode):
            unsupported = [flag for flag, on in (
                (f"--optimizer {a.optimizer}", not tiny_optim.is_adamw(a)),
                ("--accum", a.accum != 1),
                ("--clip", a.clip > 0), ("--quantize", a.quantize != "none"),
                ("--param-dtype bf16", mode == "ddp" and a.param_dtype != "fp32"),
                ("--reference", a.reference), ("--ddp and --fsdp2", a.ddp and a.fsdp2))
                if on]
            if unsupported:
                p.error(f"--{mode} does not support {', '.join(unsupported)} (AdamW, one "
                        "micro-batch, no clipping" +
                        (", fp32 only)" if mode == "ddp" else ")"))
    return a


def global_rows(args, w):
    """Sequences per micro-batch over all ranks."""
    g = args.global_batch or w * args.batch
    if g % w:
        sys.exit(f"--global-batch {g} does not split evenly over {w} ranks")
    return g


def rank_rows(args, w, r):
    n = global_rows(args, w) // w
    return slice(r * n, (r + 1) * n)


def reference(args, model, chain):
    w = args.world
    opts = tiny_optim.reference_optimizers(args, model)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for micro in range(args.accum):
            x, y = batch(chain, args.seed, step * args.accum + micro, global_rows(args, w),
                         args.seq)
            x, y = x.to(args.device), y.to(args.device)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                                     y.reshape(-1))
            (loss / args.accum).backward()
            total += float(loss.detach()) / args.accum
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for opt in opts:
            opt.step()
        model.zero_grad()
        losses.append(total)
        if not args.quiet:
            print(f"reference step {step + 1}/{args.steps} loss {total:.6f}", flush=True)
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, {
        "shampoo": tiny_optim.shampoo_report(opts, model)}


def sharded(args, model, chain):
    import ragshard
    import ragshard.torch as rt
    env = ragshard.Env()
    client = ragshard.connect(env)
    args.private_stages["connected"] = private_bytes()
    w, r = env.world_size, env.rank
    seeded, peak = seeded_init(model, args.seed), [args.private_after_model]

    def sampled(name, tensor):
        # Each tensor is built whole only while this rank copies its pieces; the peak of
        # private memory through the sharding is sampled after each.
        v = seeded(name, tensor)
        peak[0] = max(peak[0], private_bytes())
        return v
    # --meta-init: the values come from the seeded init, or from the checkpoint on a resume.
    init = None if not args.meta_init else "empty" if args.resume else sampled
    fsdp = rt.fully_shard(
        # With tied embeddings the embedding is a unit of its own and the head, in the root,
        # uses its weight: the tie crosses units.
        model, client, init=init,
        units=lambda m: [m.tok, *m.layers] if args.tie_embeddings
        else list(m.layers), param_dtype=args.param_dtype,
        quantize=None if args.quantize == "none" else args.quantize,
        # Vectors are cut anywhere, except under adam8bit, whose 256-element blocks must not
        # straddle ranks (rows:K is whole for a vector).
        granule=lambda n, p: args.granule if p.dim() >= 2 or args.optimizer == "adam8bit"
        else "element",
        optimizer=tiny_optim.matrix_optimizer(args),
        reshard_after_forward=args.reshard_after_forward if args.reshard_groups is None
        else args.reshard_groups,
        prefetch=args.prefetch)
    if fsdp.shrink:
        # The job shrank (docs/recovery.md, "Shrinking in place"): this rank goes on in the
        # successor job, with its rank and world size, and the same global batch.
        client, w, r = fsdp.client, fsdp.shrink["world"], fsdp.shrink["rank"]
    args.private_stages["fully_shard"] = private_bytes()
    opt = tiny_optim.sharded_optimizer(args, fsdp)
    from ragshard import checkpoint
    # A job that recovers lost ranks in place (ragshard-launch --max-restarts): a restarted
    # process goes on from the last step every rank completed; its data is seeded per step.
    first = fsdp.resume_step
    ckpt = {"save_seconds": [], "load_seconds": 0.0}
    # r: the rank in the job that runs
    kill = Kill(args.kill_at, r, args.hold_at, client, args.raise_at)
    # A rank restarted in a recovery in place holds its recovered state (resume_step counts
    # from the checkpoint a load set it to): loading the checkpoint again would go back to it.
    recovered = first > 0
    if args.load_state and not recovered:
        fsdp.load_state_dict(torch.load(args.load_state))
    if args.resume and not recovered:
        fsdp.all_reduce_scalar(0.0)  # every rank starts loading at once (for the timing)
        ts = time.time()
        first = checkpoint.load(fsdp, opt, args.resume)
        ckpt["loaded"] = first  # (this process loaded it: the step it holds)
        ckpt["load_seconds"] = time.time() - ts
        ckpt["load_bytes_read"] = fsdp.checkpoint_bytes_read
        # What this rank holds under its plan (its optimizer range's position and each unit's
        # range size: the parameter shard's unless the AMSP factors differ; and its tensors'
        # offsets), from which the tests derive the bytes it must read.
        ckpt["layout"] = {"pos": fsdp.ospos, "units": [
            {"shard_elems": int(fsdp.os_elems[ui]),
             "tensors": [[t["name"], int(t["offset"]), int(t["numel"])]
                         for t in fsdp.plan["units"][ui]["tensors"]]} for ui in fsdp.units()],
            # Shampoo: the matrices whose preconditioners this rank owns (and reads whole).
            "owned": sorted(getattr(opt, "owned", {})),
            # False: another local rank loads this range into the memory both share.
            "steps": fsdp.steps}
    pending = []
    # Private memory (smaps_rollup) from the model's construction to the end of the sharding
    # (the optimizer built, whose torch.optim constructor imports torch._dynamo): the full model
    # where it was built, else the largest tensor while its pieces are copied.
    sharding = {"private_bytes_after": private_bytes(),
                "model_bytes": sum(p.numel() * 4 for p in model.parameters()),
                "largest_tensor_bytes": max(p.numel() * 4 for p in model.parameters())}
    sharding["private_peak_bytes"] = max(peak[0], sharding["private_bytes_after"])
    # Private memory at each stage: imports done, torch._dynamo loaded by the first meta
    # initialization (--meta-init only), the model built, connected to the daemon, fully_shard
    # done, sharded (the optimizer built; a resume's load done), and below, trained.
    sharding["stages"] = dict(args.private_stages, sharded=sharding["private_bytes_after"])
    ops_before = unit_operations(client, fsdp)
    losses, step_seconds, step_cpu_seconds, optimizer_cpu_seconds, pool_trace = [], [], [], [], []
    tokens = 0
    t0 = time.time()
    for step in range(first, args.steps):
        ts, cs = time.time(), time.process_time()
        total = 0.0
        for micro in range(args.accum):
            x, y = batch(chain, args.seed, step * args.accum + micro, global_rows(args, w),
                         args.seq)
            x, y = x.to(args.device), y.to(args.device)
            rows = rank_rows(args, w, r)
            last = micro == args.accum - 1
            sync = last or args.reduce_every_backward
            with (fsdp.no_sync() if not sync else _null()):
                logits = fsdp(x[rows])
                kill.at(step, "forward")
                if last and kill.armed(step, "backward"):  # (the last micro-batch's)
                    logits.register_hook(lambda g: kill.at(step, "backward") or g)
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, args.vocab), y[rows].reshape(-1))
                (loss / args.accum).backward()
            total += float(loss.detach()) / args.accum
            tokens += x[rows].numel() * w
        if args.clip > 0:
            fsdp.clip_grad_norm_(args.clip)
        co = time.process_time()
        with kill.inside_optimizer(step):
            opt.step()
        opt.zero_grad()
        kill.at(step, "between")
        step_seconds.append(time.time() - ts)
        step_cpu_seconds.append(time.process_time() - cs)  # this process's threads, all of them
        optimizer_cpu_seconds.append(time.process_time() - co)
        # Between steps only the shards exist: every parameter is without storage and every
        # gradient None (the unsharded buffers went back to the daemon's pool).
        held = [n for n, p in model.named_parameters()
                if p.grad is not None or p.untyped_storage().nbytes() != 0]
        if held:
            raise RuntimeError(f"step {step + 1}: still unsharded after the step: {held[:4]}")
        global_loss = fsdp.all_reduce_scalar(total) / w
        losses.append(global_loss)
        if step + 1 in args.save_steps:
            ts = time.time()
            saved = checkpoint.save(fsdp, opt, args.save, step + 1, async_save=args.async_save)
            if args.async_save:
                pending.append(saved)
            ckpt["save_seconds"].append(time.time() - ts)
            ckpt.setdefault("save_phases", []).append(fsdp.checkpoint_save_phases)
        st = client.stats()  # this node's daemon: the pool between steps
        pool_trace.append({k: st[k] for k in ("pool_peak", "pool_used", "pool_fragmentation")})
        if r == 0 and not args.quiet:
            rate = tokens / (time.time() - t0)
            print(f"step {step + 1}/{args.steps} loss {global_loss:.6f} tokens/s {rate:,.0f}",
                  flush=True)
    for handle in pending:
        ts = time.time()
        handle.result()
        ckpt["save_seconds"].append(time.time() - ts)  # what the asynchronous saves left
    sharding["stages"]["trained"] = private_bytes()  # the steps done, before the full state
    train_rss = max_rss()  # the peak through training, before gathering the full state
    # This rank's optimizer state after the last step, measured from the optimizer's own
    # tensors (each storage once), beside its optimizer range (tiny_optim.state_bytes).
    optimizer_state = tiny_optim.state_bytes(opt, fsdp)
    op_counts = {k: dict(v) for k, v in fsdp.op_counts.items()}  # the training steps'
    # This node's daemon: the operations the training steps ran, by unit and kind.
    ops_after = unit_operations(client, fsdp)
    daemon_ops = {u: {k: n - ops_before.get(u, {}).get(k, 0) for k, n in kinds.items()}
                  for u, kinds in ops_after.items()}
    state = fsdp.full_state()
    stats = client.stats()
    if r == 0 and not args.quiet:
        print(f"daemon pool: used {stats['pool_used'] / 2**20:.1f} MiB, peak "
              f"{stats['pool_peak'] / 2**20:.1f} MiB; bytes copied outside collectives: "
              f"{stats.get('staging_bytes', 0)}", flush=True)
    extra = {"step_seconds": step_seconds, "step_cpu_seconds": step_cpu_seconds,
             "optimizer_cpu_seconds": optimizer_cpu_seconds, "train_max_rss_bytes": train_rss,
             "pool_used_bytes": stats["pool_used"],
             "pool_peak_bytes": stats["pool_peak"], "node": env.node,
             # This node's daemon under --redundancy (issue 55): the bytes of its local ranks'
             # state the last protection covered, and of its pool that parities (or copies) hold.
             "protected_bytes": stats.get("protected_bytes", 0),
             "parity_bytes": stats.get("parity_bytes", 0),
             "staging_bytes": stats.get("staging_bytes", 0),
             "gathered_bytes": fsdp.gathered_bytes, "pool_trace": pool_trace,
             "peak_units_unsharded": fsdp.peak_unsharded,
             "op_counts": op_counts, "daemon_unit_operations": daemon_ops,
             "sharding": sharding, "shampoo": tiny_optim.shampoo_report(opt)
             if args.optimizer == "shampoo" else {},
             "first_step": first + 1, "checkpoint": ckpt, "optimizer_state": optimizer_state,
             # The world size of every step: those up to the step a shrink took the state
             # over at ran in the job it came from (its predecessor), however often this
             # process restarted since.
             "world_sizes": world_sizes(fsdp.shrink, w, first, args.steps),
             "shrink": fsdp.shrink, "rank": r}
    return losses, state, extra


def world_sizes(shrink, world, first, steps):
    """The world size of each of `steps` steps of a run at `world` ranks that resumed after
    step `first`: a shrink's predecessor's up to the step the shrink took the state over at."""
    if not shrink:
        return [world] * steps
    at = shrink.get("step", first)
    return [shrink["from_world"]] * at + [world] * (steps - at)


def unit_operations(client, fsdp):
    """The operations this node's daemon has run for the job: {unit name: {kind: count}}."""
    out = {}
    for u in client.stats().get("unit_operations", []):
        name = fsdp.plan["units"][u["unit"]]["unit"]
        out.setdefault(name, {})[u["kind"]] = u["count"]
    return out


def _distributed_steps(args, net, chain, r, w, label):
    """The training loop of the torch.distributed modes (--ddp, --fsdp2): AdamW on `net`'s
    parameters, this rank's rows of each global batch, the loss in fp32 and its mean over the
    ranks every step. Returns the losses, each step's seconds (forward to zero_grad), and the
    process's CPU seconds in each step and in its optimizer step (all its threads: gloo's
    too)."""
    import torch.distributed as dist
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    losses, step_seconds, step_cpu_seconds, optimizer_cpu_seconds = [], [], [], []
    for step in range(args.steps):
        ts, cs = time.time(), time.process_time()
        x, y = batch(chain, args.seed, step, global_rows(args, w), args.seq)
        rows = rank_rows(args, w, r)
        loss = torch.nn.functional.cross_entropy(net(x[rows]).float().reshape(-1, args.vocab),
                                                 y[rows].reshape(-1))
        loss.backward()
        co = time.process_time()
        opt.step()
        opt.zero_grad()
        step_seconds.append(time.time() - ts)
        step_cpu_seconds.append(time.process_time() - cs)
        optimizer_cpu_seconds.append(time.process_time() - co)
        t = torch.tensor([float(loss.detach())])
        dist.all_reduce(t)
        losses.append(float(t) / w)
        if r == 0 and not args.quiet:
            print(f"{label} step {step + 1}/{args.steps} loss {losses[-1]:.6f}", flush=True)
    return losses, step_seconds, {"step_cpu_seconds": step_cpu_seconds,
                                  "optimizer_cpu_seconds": optimizer_cpu_seconds}


def ddp(args, model, chain):
    import torch.distributed as dist
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + args.ddp, rank=r, world_size=w)
    net = torch.nn.parallel.DistributedDataParallel(model)
    losses, step_seconds, step_cpu = _distributed_steps(args, net, chain, r, w, "ddp")
    train_rss = max_rss()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return losses, state, {"step_seconds": step_seconds, **step_cpu,
                           "train_max_rss_bytes": train_rss}


def fsdp2(args, model, chain):
    """torch's FSDP2: fully_shard on every layer, then on the root, over a 1-D CPU mesh of W
    ranks (gloo). The same seed, data, rank slices and AdamW as the other modes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + args.fsdp2, rank=r, world_size=w)
    mesh = init_device_mesh("cpu", (w,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None,
                              reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    losses, step_seconds, step_cpu = _distributed_steps(args, model, chain, r, w, "fsdp2")
    train_rss = max_rss()
    # Every rank takes part in each parameter's all-gather (DTensor.full_tensor()); the sharded
    # parameters are the fp32 masters also under bf16 mixed precision.
    state = {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
    # This rank's shard of the parameters (each DTensor is sharded on dim 0 over the mesh).
    local = sum(p.to_local().numel() for p in model.parameters())
    dist.destroy_process_group()
    return losses, state, {"step_seconds": step_seconds, **step_cpu,
                           "train_max_rss_bytes": train_rss, "local_param_elems": local,
                           "param_elems": sum(t.numel() for t in state.values())}


def max_rss():
    """This process's peak resident set so far (bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main():
    args = parse()
    if args.device == "cuda" and (args.ddp or args.fsdp2 or args.param_dtype != "fp32" or
                                  not tiny_optim.is_adamw(args) or args.quantize != "none"):
        sys.exit("--device cuda: only fp32 AdamW without quantized gathers, through ragshard or "
                 "--reference (the other paths keep state on the CPU)")
    start_rss = max_rss()  # torch imported, no model yet
    start_private = private_bytes()
    through_ragshard = not (args.reference or args.ddp or args.fsdp2)
    if through_ragshard:
        importlib.import_module("ragshard.torch")  # here, so the figure below holds it
    # Imports done: through ragshard, torch, ragshard and ragshard.torch, with --meta-init or not.
    args.private_stages = {"imports": private_bytes()}
    if through_ragshard and args.meta_init:
        # The first normal_ on a meta tensor (an Embedding's init) runs torch's Python
        # reference (torch._refs.normal_), whose torch._disable_dynamo wrapper imports
        # torch._dynamo, with sympy and triton: ~880 modules, ~65 MiB of a rank's private
        # memory (~114 MiB in a process alone). A model of Linear and LayerNorm alone would not
        # load it, and torch.optim's add_param_group loads it anyway (so a run without --meta-init
        # pays it right after fully_shard). Loaded here, before the model, so that the model's
        # figures hold only the model; its own figure is the stage below.
        with torch.device("meta"):
            torch.nn.Embedding(1, 1)
        args.private_stages["meta_first_init"] = private_bytes()
    torch.manual_seed(args.seed)
    meta = args.meta_init and not args.reference
    with torch.device("meta") if meta else _null():
        model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq,
                       args.checkpoint_activations, args.tie_embeddings)
    if not meta:
        model = model.to(args.device)
    args.private_after_model = private_bytes()
    args.private_stages["model"] = args.private_after_model
    if args.meta_init and args.reference:
        init = seeded_init(model, args.seed)  # the values the sharded run materializes
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init(name, p))
    chain = bigram_chain(args.vocab, args.seed)
    extra = {}
    if args.reference:
        if args.world < 1:
            sys.exit("--reference needs --world W")
        if args.load_state:
            model.load_state_dict(torch.load(args.load_state))
        losses, state, extra = reference(args, model, chain)
        rank = 0
    elif args.ddp:
        losses, state, extra = ddp(args, model, chain)
        rank = int(os.environ["RANK"])
    elif args.fsdp2:
        losses, state, extra = fsdp2(args, model, chain)
        rank = int(os.environ["RANK"])
    else:
        losses, state, extra = sharded(args, model, chain)
        rank = extra["rank"]  # ragshard-launch's or torchrun's, or after a shrink the new one
    extra["start_rss_bytes"] = start_rss
    extra["start_private_bytes"] = start_private
    extra["max_rss_bytes"] = max_rss()
    if args.out:
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(extra, f)
    if args.out and rank == 0:
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "first_step": 1, **extra}, f)
        torch.save(state, args.out + ".pt")
    if args.ddp or args.fsdp2:
        # Leave without the interpreter's teardown. A gloo worker thread drops its reference to
        # a finished collective only after waking the waiter (ProcessGroupGloo::runLoop, torch
        # 2.11); when that lags into Py_Finalize and the reference was a tensor's last, its
        # release takes the GIL from a finalizing interpreter and the process aborts ("terminate
        # called without an active exception"; 4 times in about 370 two-rank runs on a 2-core
        # machine, mostly under load). Everything is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
