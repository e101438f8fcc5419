"""ragshard side by side with torch's FSDP2 and DDP: examples/train_tiny.py with 8 layers,
d = 512 (about 25 M parameters), W = 4 ranks, 20 steps, the same seed, data and AdamW for every
system, in fp32 and with bf16 parameters and fp32 gradient reduction, all in one run:

* ragshard at 2 daemons x 2 ranks and at 1 daemon x 4 ranks (a fresh planner and daemons per
  configuration, so each pool figure is that job's alone);
* FSDP2: torch.distributed.fsdp.fully_shard on every layer and the root, 4 processes over gloo
  on a CPU device mesh (bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32));
* DDP: 4 processes over gloo (fp32 only).

Writes docs/benchmarks/fsdp2.md and docs/benchmarks/fsdp2_loss.png.

    .venv/bin/python bench/fsdp2_report.py --build build
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from session import run_in_session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
WORLD = 4
MODEL = ["--layers", "8", "--dim", "512"]
RTOL = 1e-5
TIMEOUT = 1800  # seconds per configuration


def sh(cmd):
    return " ".join(shlex.quote(c) for c in cmd)


def machine():
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return cpu, os.cpu_count(), mem


def vm_hwm(pid):
    """Peak resident set of a live process (VmHWM), or None."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Runner:
    def __init__(self, build, work, steps):
        self.build = build
        self.work = work
        self.env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(k, None)
        self.common = MODEL + ["--steps", str(steps), "--quiet"]
        self.runs = {}      # name -> {"losses", "ranks", ...} or {"error"}
        self.commands = {}  # name -> the command line, as run

    def load(self, name, world=WORLD):
        out = os.path.join(self.work, name)
        main = json.load(open(out + ".json"))
        ranks = [json.load(open(f"{out}.rank{r}.json")) for r in range(world)]
        return {"losses": main["losses"], "ranks": ranks}

    def ragshard(self, name, daemons, extra, world=WORLD, common=None):
        from ragshard.cluster import LocalCluster
        print("+", name, file=sys.stderr, flush=True)
        common = self.common if common is None else common
        # Enough pool for the largest case (one daemon holding every unit, in fp32).
        with LocalCluster(self.build, daemons=daemons, pool_bytes=3 << 30) as c:
            cmd = [sys.executable, "-m", "ragshard.launch", "--planner", c.planner, "--job",
                   name, "--nproc", str(world), "--sockets", ",".join(c.sockets),
                   "--create-job", EXAMPLE, "--out", os.path.join(self.work, name)] + \
                common + extra
            self.commands[name] = f"python -m ragshard.launch ... --nproc {world} --sockets " + \
                f"<{daemons} daemon socket{'s' if daemons > 1 else ''}> --create-job " + \
                sh(["examples/train_tiny.py"] + common + extra)
            # A session of its own: on a timeout the launcher and its ranks are killed together.
            # The cluster's planner token: self.env was taken before the cluster made it.
            code, text = run_in_session(cmd, dict(self.env, RAGSHARD_TOKEN_FILE=c.token_file),
                                        TIMEOUT)
            if code != 0:
                self.runs[name] = {"error": text[-3000:]}
                print(self.runs[name]["error"], file=sys.stderr)
                return
            run = self.load(name, world)
            # The daemons' own peak RSS (their pool pages included) and the planner's view of
            # each node (ragshardctl nodes --json, from the daemons' last heartbeat).
            run["daemon_hwm"] = [vm_hwm(p.pid) for p in c.procs[1:]]
            ctl = subprocess.run([os.path.join(self.build, "client", "ragshardctl"), "--planner",
                                  c.planner, "nodes", "--json"], capture_output=True, text=True,
                                 timeout=60)
            run["ctl_nodes"] = {}
            if ctl.returncode == 0:
                for n in json.loads(ctl.stdout).get("nodes", []):
                    f = n.get("figures", {})
                    run["ctl_nodes"][n.get("nodeId", n.get("node_id"))] = int(
                        f.get("poolPeakBytes", f.get("pool_peak_bytes", 0)))
            run["daemons"] = daemons
            self.runs[name] = run

    def torch_dist(self, name, mode, extra, world=WORLD, common=None):
        """`world` processes of train_tiny.py --ddp/--fsdp2 over gloo, meeting through a
        FileStore."""
        print("+", name, file=sys.stderr, flush=True)
        common = self.common if common is None else common
        out = os.path.join(self.work, name)
        store = out + ".store"
        cmd = [sys.executable, EXAMPLE, "--" + mode, store, "--out", out] + common + extra
        self.commands[name] = f"RANK=r WORLD_SIZE={world} OMP_NUM_THREADS=1 python " + \
            sh(["examples/train_tiny.py", "--" + mode, "STORE"] + common + extra) + \
            f"   # r = 0..{world - 1}"
        procs, logs = [], []
        try:
            for r in range(world):
                logs.append(open(f"{out}.log{r}", "w+"))
                procs.append(subprocess.Popen(cmd, env=dict(self.env, RANK=str(r),
                                                            WORLD_SIZE=str(world),
                                                            OMP_NUM_THREADS="1"),
                                              stdout=logs[-1], stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))
            deadline = time.time() + TIMEOUT
            codes = [p.wait(timeout=max(1, deadline - time.time())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read())
            f.close()
        if codes != [0] * world:
            self.runs[name] = {"error": "\n".join(
                f"rank {r} exited with {c}: {t[-1500:]}" for r, (c, t) in
                enumerate(zip(codes, texts)) if c != 0)}
            print(self.runs[name]["error"], file=sys.stderr)
            return
        self.runs[name] = self.load(name, world)


SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet"]  # the test model of tests/python


def bf16_reference(world, steps, rounded_masters):
    """{name: fp32 tensor} after `steps` AdamW steps of the SMALL model in one process, as the
    sharded systems define bf16 mixed precision: each rank's loss on a bf16 copy of the fp32
    masters, its bf16 gradients averaged over the ranks in fp32, AdamW on the fp32 masters.
    `rounded_masters`: the masters start from the initial weights rounded to bf16."""
    import copy
    import importlib.util
    import torch
    # train_tiny imports tiny_optim from beside itself, as it does when run as a script.
    if os.path.dirname(EXAMPLE) not in sys.path:
        sys.path.insert(0, os.path.dirname(EXAMPLE))
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    vocab, d, layers, heads, seq, rows = 32, 64, 2, 4, 16, 2
    torch.manual_seed(0)
    model = tt.TinyLM(vocab, d, layers, heads, seq)
    chain = tt.bigram_chain(vocab, 0)
    if rounded_masters:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        x, y = tt.batch(chain, 0, step, world * rows, seq)
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in range(world):
            low = copy.deepcopy(model).to(torch.bfloat16)
            sl = slice(r * rows, (r + 1) * rows)
            loss = torch.nn.functional.cross_entropy(
                low(x[sl]).float().reshape(-1, vocab), y[sl].reshape(-1))
            loss.backward()
            for n, p in low.named_parameters():
                acc[n] += p.grad.float()
        for n, p in model.named_parameters():
            p.grad = acc[n] / world
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def step_times(run):
    """The slowest rank's time of each step after the first (warm-up)."""
    ranks = run["ranks"]
    n = len(ranks[0]["step_seconds"])
    return [max(r["step_seconds"][s] for r in ranks) for s in range(1, n)]


def step_time(run):
    """The median of step_times."""
    return statistics.median(step_times(run))


def mib(b):
    return f"{b / 2**20:.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "fsdp2.md"))
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import torch
    started = datetime.datetime.now()
    work = tempfile.mkdtemp(prefix="ragshard-fsdp2-")
    run = Runner(build, work, args.steps)

    systems = {}  # precision -> [(label, run name)]
    for prec in ("fp32", "bf16"):
        extra = ["--param-dtype", prec]
        names = []
        for daemons in (2, 1):
            name = f"ragshard-{daemons}x{WORLD // daemons}-{prec}"
            run.ragshard(name, daemons, extra)
            names.append((f"ragshard {daemons} daemon{'s' if daemons > 1 else ''} × "
                          f"{WORLD // daemons} ranks", name))
        run.torch_dist(f"fsdp2-{prec}", "fsdp2", extra)
        names.append(("FSDP2 (gloo)", f"fsdp2-{prec}"))
        if prec == "fp32":
            run.torch_dist("ddp-fp32", "ddp", [])
            names.append(("DDP (gloo)", "ddp-fp32"))
        systems[prec] = names
    # Why bf16 differs: one step of the test model (2 ranks) through each system, against a
    # single-process reference of the same mixed precision.
    check = ["--param-dtype", "bf16", "--steps", "1"]
    run.ragshard("check-ragshard-bf16", 2, check, world=2, common=SMALL)
    run.torch_dist("check-fsdp2-bf16", "fsdp2", check, world=2, common=SMALL)
    elapsed = datetime.datetime.now() - started
    runs = run.runs
    ok = {n: r for n, r in runs.items() if "error" not in r}
    checked = None
    if "check-ragshard-bf16" in ok and "check-fsdp2-bf16" in ok:
        exact = bf16_reference(2, 1, rounded_masters=False)
        rounded = bf16_reference(2, 1, rounded_masters=True)
        rs = torch.load(os.path.join(work, "check-ragshard-bf16.pt"))
        f2 = torch.load(os.path.join(work, "check-fsdp2-bf16.pt"))

        def differ(a, b):  # elements that differ
            return sum(int((a[n] != b[n]).sum()) for n in b)

        def bf16(t):
            return {n: v.bfloat16().float() for n, v in t.items()}
        checked = {"elems": sum(v.numel() for v in exact.values()),
                   "fsdp2_vs_exact": differ(f2, exact),
                   "fsdp2_bf16_vs_exact": differ(bf16(f2), bf16(exact)),
                   "ragshard_vs_exact": differ(rs, bf16(exact)),
                   "ragshard_vs_rounded": differ(rs, bf16(rounded)),
                   "ragshard_is_bf16": differ(rs, bf16(rs)) == 0}

    # --- the plot: losses per precision, and each system's distance to FSDP2 -----------------
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"ragshard-2x2": "tab:blue", "ragshard-1x4": "tab:orange", "fsdp2": "tab:green",
              "ddp": "tab:red"}

    def color(name):
        return colors[name.rsplit("-", 1)[0]]
    for ax, prec in zip(axes[:2], ("fp32", "bf16")):
        for label, name in systems[prec]:
            if name in ok:
                ax.plot(range(1, args.steps + 1), ok[name]["losses"], label=label,
                        color=color(name), linestyle="--" if "FSDP2" in label else "-",
                        marker=".")
        ax.set_title(f"loss, {prec}" + (" params, fp32 reduction" if prec == "bf16" else ""))
        ax.set_xlabel("step")
        ax.set_ylabel("loss (global batch mean)")
        ax.legend(fontsize=8)
    ax = axes[2]
    for prec in ("fp32", "bf16"):
        ref = ok.get(f"fsdp2-{prec}")
        if ref is None:
            continue
        for label, name in systems[prec]:
            if name in ok and not name.startswith("fsdp2"):
                d = [max(abs(a - b) / abs(b), 1e-9)
                     for a, b in zip(ok[name]["losses"], ref["losses"])]
                ax.semilogy(range(1, args.steps + 1), d, label=f"{label}, {prec}",
                            color=color(name), linestyle="-" if prec == "fp32" else ":",
                            marker="." if prec == "fp32" else "x")
    ax.axhline(RTOL, color="grey", linewidth=0.8, label="1e-5")
    ax.set_title("|loss − FSDP2's| / FSDP2's, same precision (0 shown as 1e-9)", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.suptitle(f"train_tiny.py --layers 8 --dim 512, W = {WORLD}, {args.steps} steps")
    fig.tight_layout()
    png = os.path.join(os.path.dirname(args.out), "fsdp2_loss.png")
    fig.savefig(png, dpi=100)

    # --- the report -----------------------------------------------------------------------
    cpu, cores, mem = machine()
    nparams = None
    if "fsdp2-fp32" in ok:
        nparams = ok["fsdp2-fp32"]["ranks"][0]["param_elems"]
    md = ["# ragshard, FSDP2 and DDP side by side\n",
          f"Run on {started:%Y-%m-%d %H:%M} by `bench/fsdp2_report.py`, every configuration "
          f"in this one run ({elapsed.total_seconds() / 60:.1f} min in all), on this "
          f"repository's development machine: {cores} cores ({cpu}), "
          f"{mem / 2**30:.0f} GiB memory, no GPU; Python {platform.python_version()}, "
          f"torch {torch.__version__} (PyPI, the project's `.venv`), gloo on loopback.\n",
          "```\n.venv/bin/python bench/fsdp2_report.py --build build"
          + (f" --steps {args.steps}" if args.steps != 20 else "") + "\n```\n",
          "Model: `examples/train_tiny.py --layers 8 --dim 512` (decoder-only transformer, "
          "4 heads, vocabulary 64, 32 tokens per sequence, 4 sequences per rank: a global batch "
          "of 16 × 32 tokens" + (f"; {nparams:,} parameters" if nparams else "") +
          f"), {args.steps} steps, W = {WORLD} ranks, seed 0, AdamW (lr 1e-3, weight decay "
          "0.01) for every system; each rank takes its rows of the same global batch. The "
          "loss is the mean over the ranks of each rank's loss, all-reduced every step. "
          "Systems:\n",
          "* **ragshard** (`ragshard.torch.fully_shard`, each layer one unit plus a root unit, "
          "sharded AdamW) with 2 daemons × 2 ranks and with 1 daemon × 4 ranks; a fresh "
          "planner and daemons for each configuration;",
          "* **FSDP2**: `torch.distributed.fsdp.fully_shard` on every layer and then the root, "
          f"over `init_device_mesh(\"cpu\", ({WORLD},))`, 4 processes over gloo, "
          "`torch.optim.AdamW` on the DTensor shards; bf16: `MixedPrecisionPolicy("
          "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`;",
          "* **DDP** over gloo, fp32 only (`train_tiny.py --ddp` has no mixed precision; torch "
          "DDP's is a private API).\n",
          "In bf16 both sharded systems gather bf16 parameters, reduce the gradients in fp32 "
          "and keep fp32 master shards for AdamW; the loss is computed in fp32 "
          "(`logits.float()`) by both.\n",
          "Commands, as run (`python` is `.venv/bin/python`, with `PYTHONPATH=build/python`):\n",
          "```"]
    md += [f"{n}: {c}" for n, c in run.commands.items()]
    md += ["```\n"]

    failed = {n: r["error"] for n, r in runs.items() if "error" in r}
    if failed:
        md += ["## Configurations that failed\n"]
        for n, e in failed.items():
            md += [f"**{n}**:\n", "```", e.strip(), "```\n"]

    # Loss parity.
    md += ["## Loss parity\n"]
    fp = {n: ok[n]["losses"] for _, n in systems["fp32"] if n in ok}
    ref = fp.get("fsdp2-fp32")
    if ref:
        md += ["### fp32: ragshard against FSDP2, every step\n",
               "| step | " + " | ".join(lbl for lbl, n in systems["fp32"] if n in fp) +
               " | ragshard 2×2 − FSDP2 | ragshard 1×4 − FSDP2 |",
               "|---:|" + "---:|" * (len(fp) + 2)]
        for s in range(args.steps):
            cells = [f"{fp[n][s]:.7f}" for _, n in systems["fp32"] if n in fp]
            for n in ("ragshard-2x2-fp32", "ragshard-1x4-fp32"):
                cells.append(f"{fp[n][s] - ref[s]:+.2e}" if n in fp else "–")
            md.append(f"| {s + 1} | " + " | ".join(cells) + " |")
        md.append("")
        for n in ("ragshard-2x2-fp32", "ragshard-1x4-fp32"):
            if n not in fp:
                md.append(f"* {n}: did not run (see above) — **missed**.")
                continue
            ab = max(abs(a - b) for a, b in zip(fp[n], ref))
            rel = max(abs(a - b) / abs(b) for a, b in zip(fp[n], ref))
            md.append(f"* {n} vs FSDP2: largest difference over the {args.steps} steps "
                      f"{ab:.2e} absolute, {rel:.2e} relative. Target ≤ 1e-5 at every step: "
                      f"relative **{'met' if rel <= RTOL else 'missed'}**, absolute "
                      f"**{'met' if ab <= RTOL else 'missed'}**.")
        if "ddp-fp32" in fp:
            ab = max(abs(a - b) for a, b in zip(fp["ddp-fp32"], ref))
            md.append(f"* DDP vs FSDP2 (for scale): largest absolute difference {ab:.2e}.")
        md.append("")
    else:
        md += ["FSDP2 in fp32 did not run, so there is no parity figure — **missed**.\n"]

    bf = {n: ok[n]["losses"] for _, n in systems["bf16"] if n in ok}
    if "fsdp2-bf16" in bf:
        md += ["### bf16 parameters, fp32 reduction\n",
               "| system | largest \\|bf16 − FSDP2 bf16\\| | largest \\|bf16 − own fp32\\| | "
               "final loss bf16 | final loss fp32 |", "|---|---:|---:|---:|---:|"]
        for label, n in systems["bf16"]:
            if n not in bf:
                continue
            vs = "–" if n == "fsdp2-bf16" else \
                f"{max(abs(a - b) for a, b in zip(bf[n], bf['fsdp2-bf16'])):.2e}"
            own = n.replace("bf16", "fp32")
            own_d = f"{max(abs(a - b) for a, b in zip(bf[n], fp[own])):.2e}" if own in fp \
                else "–"
            md.append(f"| {label} | {vs} | {own_d} | {bf[n][-1]:.5f} | "
                      f"{fp[own][-1]:.5f} |" if own in fp else
                      f"| {label} | {vs} | {own_d} | {bf[n][-1]:.5f} | – |")
        md += ["\nThe first column is how far each ragshard bf16 run is from FSDP2's at the "
               "worst step; the second how far each system's bf16 run is from its own fp32 run "
               "of this report (the effect of bf16 itself), for scale. Every step:\n",
               "| step | " + " | ".join(lbl for lbl, n in systems["bf16"] if n in bf) +
               " | ragshard 2×2 − FSDP2 | ragshard 1×4 − FSDP2 |",
               "|---:|" + "---:|" * (len(bf) + 2)]
        for s in range(args.steps):
            cells = [f"{bf[n][s]:.7f}" for _, n in systems["bf16"] if n in bf]
            for n in ("ragshard-2x2-bf16", "ragshard-1x4-bf16"):
                cells.append(f"{bf[n][s] - bf['fsdp2-bf16'][s]:+.2e}" if n in bf else "–")
            md.append(f"| {s + 1} | " + " | ".join(cells) + " |")
        md.append("")
        if checked:
            c = checked
            md += ["What one mixed-precision step computes, checked in this run: one step of "
                   "the test model "
                   "(`" + " ".join(SMALL[:-1]) + "`, 2 ranks, `--param-dtype bf16 --steps 1`) "
                   "through each system, against a single-process reference of the same mixed "
                   "precision (each rank's loss on a bf16 copy of the fp32 masters, the bf16 "
                   "gradients averaged in fp32, AdamW on the fp32 masters), started from the "
                   "exact fp32 initial weights or from those weights rounded to bf16. Of "
                   f"{c['elems']:,} parameter elements after the step:\n",
                   f"* FSDP2's (fp32 masters, from `full_tensor()`) differ from the reference "
                   f"from exact masters in {c['fsdp2_vs_exact']:,} elements;",
                   "* ragshard's (`full_state()`, which returns the "
                   + ("bf16 compute copy, not the fp32 masters" if c["ragshard_is_bf16"]
                      else "parameters") +
                   f") differ from that reference rounded to bf16 in "
                   f"{c['ragshard_vs_exact']:,} elements, and from the reference started from "
                   f"bf16-rounded masters, rounded to bf16, in {c['ragshard_vs_rounded']:,} "
                   f"(FSDP2's, rounded to bf16, differ from the exact one's in "
                   f"{c['fsdp2_bf16_vs_exact']:,}).\n"]
            if c["fsdp2_vs_exact"] == 0 and c["ragshard_vs_exact"] == 0:
                md += ["So after one step both hold what the reference from the exact fp32 "
                       "initial weights holds (ragshard's parameters compared as the bf16 "
                       "copies it returns); over more steps the two can still part by rounding, "
                       "as the per-step table shows.\n"]
            if c["fsdp2_vs_exact"] == 0 and c["ragshard_vs_rounded"] == 0 and \
                    c["ragshard_vs_exact"] > 0:
                md += ["So both compute the same mixed-precision step, but ragshard's fp32 "
                       "master shards start from the initial weights rounded to bf16, while FSDP2 "
                       "keeps the exact fp32 initial weights as its sharded parameters; the "
                       "first forward (step 1) uses the same bf16 weights in both.\n"]
    md += ["![losses and distance to FSDP2](fsdp2_loss.png)\n"]

    # Step time and memory.
    starts = [x["start_rss_bytes"] for n, r in ok.items() for x in r["ranks"]
              if "start_rss_bytes" in x and not n.startswith("check")]
    md += ["## Step time and memory\n",
           "Step time: for each step the slowest rank's wall time from the start of the "
           "forward to the end of `zero_grad` (the loss all-reduce for printing is outside); "
           f"the median over steps 2 … {args.steps} (**step 1 is skipped as warm-up**), and "
           "the fastest and slowest of those steps.\n",
           "Memory: each rank's maximum RSS (`getrusage(RUSAGE_SELF).ru_maxrss`, rank 0 "
           "first) at the end of the last step (*training*: model construction, sharding and "
           f"{args.steps} steps), and at exit (after gathering every full parameter on every "
           "rank for the `.pt` file, which the figures at the end of training leave out). "
           + (f"A rank's RSS before it builds the model (torch imported) was "
              f"{mib(min(starts))}–{mib(max(starts))} MiB in this run. " if starts else "") +
           "A ragshard rank's RSS includes the pages of its daemon's shared pool that it maps "
           "(its views of the unsharded parameters and gradients), shared by the node's ranks "
           "and counted again in each of them and in the daemon. The pool columns are the "
           "daemon's figures per node: the pool peak (`Client.stats()` `pool_peak`, as the "
           "example prints it; `ragshardctl nodes --json` `poolPeakBytes` is shown next to it "
           "where it differs) and the daemon process's own peak RSS (VmHWM).\n"]

    def rss(run, key="train_max_rss_bytes"):
        return [x.get(key, x["max_rss_bytes"]) for x in run["ranks"]]

    for prec in ("fp32", "bf16"):
        md += [f"### {prec}" + (" parameters, fp32 reduction" if prec == "bf16" else "") + "\n",
               "| system | median step (s) | min–max (s) | max RSS per rank, training (MiB) | "
               "largest | sum | largest at exit (MiB) | pool peak per node (MiB) | "
               "daemon peak RSS (MiB) |",
               "|---|---:|---:|---|---:|---:|---:|---|---|"]
        for label, n in systems[prec]:
            if n not in ok:
                md.append(f"| {label} | failed | | | | | | | |")
                continue
            r = ok[n]
            tr = rss(r)
            pool = hwm = "–"
            if "daemons" in r:
                peaks = {}
                for x in r["ranks"]:
                    peaks.setdefault(x.get("node", "?"), x.get("pool_peak_bytes", 0))
                pool = ", ".join(f"{mib(v)}" for v in peaks.values())
                ctl = list(r.get("ctl_nodes", {}).values())
                if ctl and [mib(v) for v in ctl] != [mib(v) for v in peaks.values()]:
                    pool += " (ragshardctl: " + ", ".join(mib(v) for v in ctl) + ")"
                hwm = ", ".join(mib(v) for v in r["daemon_hwm"] if v)
            ts = step_times(r)
            md.append(f"| {label} | {step_time(r):.3f} | {min(ts):.2f}–{max(ts):.2f} | "
                      f"{', '.join(mib(v) for v in tr)} | "
                      f"{mib(max(tr))} | {mib(sum(tr))} | {mib(max(rss(r, 'max_rss_bytes')))} "
                      f"| {pool} | {hwm} |")
        md.append("")
        # Ratios within this run.
        rows = []
        for label, n in systems[prec]:
            if not n.startswith("ragshard") or n not in ok:
                continue
            for base_label, base in (("FSDP2", f"fsdp2-{prec}"), ("DDP", "ddp-fp32")):
                if base not in ok:
                    continue
                a, b = ok[n], ok[base]
                ra, rb = rss(a), rss(b)
                node_mem = sum(ra) + sum(v for v in a["daemon_hwm"] if v)
                shown = base_label + (" fp32" if base == "ddp-fp32" and prec != "fp32" else "")
                rows.append(f"| {label} | {shown} | "
                            f"{step_time(a) / step_time(b):.2f}× | "
                            f"{max(ra) / max(rb):.2f}× | {sum(ra) / sum(rb):.2f}× | "
                            f"{node_mem / sum(rb):.2f}× |")
        if rows:
            md += [f"Ratios ({prec}), ragshard ÷ the other system, both from this run (RSS: "
                   "training):\n",
                   "| ragshard | ÷ | median step time | largest rank RSS | sum of ranks' RSS | "
                   "ranks' + daemons' peak RSS ÷ the other's ranks' |",
                   "|---|---|---:|---:|---:|---:|"] + rows + [""]
    md += ["The last ratio counts the shared pool pages several times (in each rank that maps "
           "them and in the daemon), so it overstates ragshard's memory; the pool peak column is "
           "the daemon's own count of the bytes it holds. FSDP2 and DDP have no daemon.\n",
           "Run-to-run noise: 4 training processes (and for ragshard 1–2 daemons and a planner) "
           "share 2 cores, each process with torch's default intra-op thread count "
           f"({torch.get_num_threads()} here); the min–max column shows how much the step "
           "time varied within this run, and another run may give other ratios.\n",
           "## FSDP2 on gloo at this torch version\n"]
    f2 = [n for n in ("fsdp2-fp32", "fsdp2-bf16") if n in ok]
    if f2:
        md.append(f"FSDP2 ran on gloo with torch {torch.__version__} in "
                  f"{' and '.join(n.split('-')[1] for n in f2)}, unmodified: with fp32 and bf16 "
                  "gradients FSDP2 reduce-scatters with `ReduceOp.AVG`, and gloo's "
                  "`reduce_scatter_tensor` accepts it on CPU tensors at this version; no "
                  "workaround (such as `set_force_sum_reduction_for_comms(True)`) is used.")
        md.append("\nOne problem of gloo at this version shows at process exit, not in "
                  "training: a gloo worker thread drops its reference to a finished "
                  "collective only after waking the waiting rank, and when that lags into the "
                  "interpreter's finalization and the reference was a tensor's last, the "
                  "process aborts (`terminate called without an active exception`, in "
                  "`AsyncAllgatherCoalescedWork`'s destructor on a `ProcessGroupGloo::runLoop` "
                  "thread). Outside this run it happened 4 times in about 370 two-rank FSDP2 "
                  "runs of the test model on this machine, 2 of them in 88 runs made beside a "
                  "4-rank job. `train_tiny.py --fsdp2` and `--ddp` therefore end "
                  "with `os._exit(0)` once every file is written.")
    for n in ("fsdp2-fp32", "fsdp2-bf16"):
        if n in failed:
            md.append(f"FSDP2 **failed** in {n.split('-')[1]}; its error is shown above.")
    md.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(md))
    json.dump(runs, open(os.path.join(work, "runs.json"), "w"))
    print("wrote", args.out, "and", png, "; raw figures in", work, file=sys.stderr)
    if failed:
        print("failed configurations:", ", ".join(failed), file=sys.stderr)


if __name__ == "__main__":
    main()
