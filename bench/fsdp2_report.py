"""ragshard beside torch's FSDP2 with the standard LLM recipe, in one run: examples/train_hf.py
(a transformers LlamaForCausalLM with tied embeddings; AdamW with weight decay 0.1 on tensors of
2 or more dimensions and 0 on the rest, LambdaLR warmup then cosine, global-norm clipping at
1.0; fp32, and bf16 parameters with fp32 reduction) at W = 4 ranks through

* ragshard at 2 daemons x 2 ranks and at 1 daemon x 4 ranks (ragshard.launch --preload; a fresh
  planner and daemons for every run, so each pool figure is that run's alone);
* FSDP2: train_hf.py --backend fsdp2 (fully_shard on every decoder layer and the root, a CPU
  device mesh, gloo), 4 ranks forked from one launcher that imported torch and transformers
  once, as ragshard.launch --preload does (tests/python/fsdp2_launcher.py, which
  tests/python/test_porting.py uses too).

The configurations are alternated: --reps rounds, each running every configuration once in the
same order. Every rank runs train_hf.py unchanged inside a thin driver (this file with --rank)
that times each step (from the start of the forward, after the step's batch is drawn, to the end
of zero_grad) and records the rank's maximum RSS at the end of training and at exit, and under
ragshard the daemon's pool peak (Client.stats()); the report samples every process's PSS
(/proc/PID/smaps_rollup) every 0.1 s and keeps each node's peak sum (ranks and daemon) and the
whole run's (the launcher included).

Writes docs/benchmarks/fsdp2.md and docs/benchmarks/fsdp2_loss.png. This file runs the rounds;
the rank driver and FSDP2's launcher are bench/fsdp2_rank.py, the runs and the sampling
bench/fsdp2_runs.py, the plot and the report bench/fsdp2_render.py.

    .venv/bin/python bench/fsdp2_report.py --build build            # the report (~15 min)
    .venv/bin/python bench/fsdp2_report.py --build build --smoke --out /tmp/fsdp2.md
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import provenance
from fsdp2_rank import fsdp2_launch, rank_main
from fsdp2_render import render, step_time
from fsdp2_runs import WORLD, Runner, reference_norm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
# The report's model: a Llama of about 30 M parameters (tied embeddings), with a global batch of
# 8 sequences of 128 tokens (2 per rank). Large enough that the parameters, gradients and AdamW
# state (16 bytes a parameter, about 470 MiB unsharded) dominate a rank's memory beyond the
# ~0.5 GiB that torch and transformers take, and that a step is seconds of compute rather than
# the systems' fixed costs; small enough that 5 alternated rounds in fp32 and 2 in bf16 fit in
# about 15 minutes on 2 cores.
MODEL = ["--model", "llama", "--hidden", "512", "--layers", "8", "--heads", "8",
         "--intermediate", "1376", "--vocab", "8192", "--seq", "128", "--global-batch", "8"]
SMOKE = ["--model", "llama", "--hidden", "64", "--layers", "2", "--heads", "4",
         "--intermediate", "128", "--vocab", "128", "--seq", "16", "--global-batch", "8"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="alternated rounds")
    ap.add_argument("--precisions", default="fp32,bf16,accum",
                    help="fp32, bf16, accum (fp32 with --accum 2: two micro-batches a step, "
                         "a loss.backward() each)")
    ap.add_argument("--bf16-reps", type=int, default=2,
                    help="rounds (the first ones) that also run the bf16 and accum "
                         "configurations")
    ap.add_argument("--bf16-note", default="",
                    help="the report's reason for a run without bf16 (--precisions)")
    ap.add_argument("--smoke", action="store_true",
                    help="the tests' tiny Llama (hidden 64, 2 layers, vocabulary 128, 16 tokens)")
    ap.add_argument("--example", default=EXAMPLE, help="the training script (train_hf.py)")
    ap.add_argument("--from-json", default="", metavar="RUNS",
                    help="write the report again from an earlier run's runs.json (its figures, "
                         "command and date), running nothing")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "fsdp2.md"))
    provenance.add_flag(ap)
    args = ap.parse_args()
    saved = None
    if args.from_json:  # the earlier run's own arguments, this call's --out
        saved = json.load(open(args.from_json))
        out = args.out
        args = ap.parse_args(saved["argv"][1:])
        args.out, args.from_json = out, "yes"
        args.provenance = saved.get("provenance")  # None: the report keeps its header
    else:
        provenance.require(args)
    precisions = [p for p in args.precisions.split(",") if p]
    if not set(precisions) <= {"fp32", "bf16", "accum"} or "fp32" not in precisions:
        ap.error("--precisions: fp32, optionally with bf16 and accum")
    if args.steps < 3:
        ap.error("--steps: at least 3 (step 1 is left out of the step times)")
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import torch  # noqa: F401  (here, so that a missing one fails before the runs)
    import transformers  # noqa: F401
    model = SMOKE if args.smoke else MODEL
    started = datetime.datetime.now()
    t_start = time.time()
    work = tempfile.mkdtemp(prefix="ragshard-fsdp2-")
    run = Runner(build, work, os.path.abspath(args.example), model, args.steps, args.warmup)

    configs = []  # (config, precision, label, system, daemons)
    for prec in precisions:
        configs += [(f"ragshard-2x2-{prec}", prec, "ragshard 2 daemons × 2 ranks", "ragshard", 2),
                    (f"ragshard-1x4-{prec}", prec, "ragshard 1 daemon × 4 ranks", "ragshard", 1),
                    (f"fsdp2-{prec}", prec, "FSDP2 (gloo)", "fsdp2", 0)]
    runs = {c[0]: [] for c in configs}  # config -> one result per round
    for rep in range(0 if args.from_json else args.reps):
        for config, prec, label, system, daemons in configs:
            if prec != "fp32" and rep >= args.bf16_reps:
                continue
            name = f"r{rep}-{config}"
            extra = {"bf16": ["--bf16"], "accum": ["--accum", "2"]}.get(prec, [])
            print(f"+ {name} ({(time.time() - t_start) / 60:.1f} min)", file=sys.stderr,
                  flush=True)
            r = run.ragshard(config, name, daemons, extra) if system == "ragshard" else \
                run.fsdp2(config, name, extra)
            runs[config].append(r)
            if "error" not in r:
                print(f"  {r['wall']:.0f} s, step {step_time(r):.3f} s, final loss "
                      f"{r['losses'][-1]:.6f}", file=sys.stderr, flush=True)
    elapsed = time.time() - t_start
    if saved:  # the figures of an earlier run, written again
        runs, run.commands, elapsed = saved["runs"], saved["commands"], saved["elapsed"]
        started = datetime.datetime.fromisoformat(saved["started"])
        sys.argv, load, ref_norm = saved["argv"], saved["load"], saved["ref_norm"]
    else:
        load = os.getloadavg()
        print("+ step 1's gradient norm in one process", file=sys.stderr, flush=True)
        ref_norm = reference_norm(os.path.abspath(args.example), model, WORLD)
        json.dump({"runs": runs, "commands": run.commands, "elapsed": elapsed,
                   "started": started.isoformat(), "argv": sys.argv, "load": load,
                   "ref_norm": ref_norm, "provenance": args.provenance},
                  open(os.path.join(work, "runs.json"), "w"))

    failed = render(args, configs, precisions, model, runs, run.commands, started, elapsed, load,
                    ref_norm, work)
    if failed:
        print("failed runs:", ", ".join(f"{c}#{i + 1}" for c, i, _ in failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1:2] == ["--fsdp2-launch"]:
        sys.exit(fsdp2_launch(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
    else:
        main()
