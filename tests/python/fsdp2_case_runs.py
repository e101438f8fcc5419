"""Runs of tests/python/fsdp2_cases.py in each mode, and their comparison: what
tests/python/test_fsdp2_cases.py and bench/semantics_report.py share. Each mode runs every case
of its kind in one launch (ragshard: 4 ranks over a LocalCluster's 2 daemons, forked from one
torch import; FSDP2: 4 ranks forked by fsdp2_launcher.py; the reference: one process)."""
import json
import math
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fsdp2_cases  # noqa: E402
import preloaded  # noqa: E402  (the launches forked from one torch import)

SCRIPT = os.path.join(HERE, "fsdp2_cases.py")
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch"]
RTOL = 1e-5
WORLD = 4
# Parameters replicated, gradients sharded within the shard groups of 2, optimizer state over
# all 4.
AMSP_STRATEGY = "k=1,p=1x1,g=2x1,os=2x2"
MIXED = {"mp-bf16-accum", "mp-output"}
QUANTIZED = {"quantized-accum", "quantized-once"}
SPECIAL = fsdp2_cases.HSDP | fsdp2_cases.AMSP | QUANTIZED
PLAIN = [c for c in fsdp2_cases.CASES if c not in SPECIAL]
WITH_FSDP2 = [c for c in PLAIN if c not in fsdp2_cases.RAGSHARD_ONLY]


def env(build):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(build, "python") + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def _check(r):
    return None if r.returncode == 0 else (r.stdout + r.stderr)[-12000:]


def ragshard_run(build, cluster, cases, prefix, out, replicate=1, strategy=""):
    """Every case of `cases` in one launch of 4 ranks over `cluster`'s 2 daemons (a LocalCluster
    of build `build`), case C in job PREFIX-C; None, or the launch's output where it failed."""
    sys.path.insert(0, os.path.join(build, "python"))
    import ragshard
    launch_job = f"{prefix}-{cases[0]}"
    for c in cases:
        for job in [f"{prefix}-{c}"] + ([f"{prefix}-{c}-b"] if c in fsdp2_cases.TWO_MODELS
                                        else []):
            if job != launch_job:
                ragshard.create_job(cluster.planner, job, WORLD // replicate,
                                    replicate_size=replicate, strategy=strategy,
                                    policy="auto" if strategy else "ragged")
    extra = (["--replicate", str(replicate)] if replicate > 1 else []) + \
        (["--policy", "auto", "--strategy", strategy] if strategy else [])
    cmd = LAUNCH + ["--planner", cluster.planner, "--job", launch_job, "--nproc", str(WORLD),
                    "--sockets", ",".join(cluster.sockets), "--create-job", *extra, SCRIPT,
                    "--mode", "ragshard", "--jobs", prefix, "--cases", ",".join(cases),
                    "--out", out]
    return _check(preloaded.run(cmd, env=env(build), capture_output=True, text=True,
                                timeout=1200))


def fsdp2_run(build, cases, out, hsdp=False):
    """`cases` under torch's FSDP2, 4 ranks over gloo (`hsdp`: a (2, 2) mesh)."""
    args = ["--mode", "fsdp2", "--store", os.path.join(out, "store"), "--cases", ",".join(cases),
            "--out", out] + (["--hsdp"] if hsdp else [])
    code = [sys.executable, "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import fsdp2_launcher; "
            "sys.exit(fsdp2_launcher.fsdp2_launch(4, sys.argv[2], sys.argv[3:], ['torch']))",
            HERE, SCRIPT] + args
    return _check(subprocess.run(code, env=env(build), capture_output=True, text=True,
                                 timeout=1200))


def reference_run(build, cases, out):
    """`cases` in one plain PyTorch process."""
    return _check(preloaded.run([sys.executable, SCRIPT, "--mode", "reference", "--world",
                                 str(WORLD), "--cases", ",".join(cases), "--out", out],
                                env=env(build), capture_output=True, text=True, timeout=1200))


def results(out, case):
    with open(os.path.join(out, case + ".json")) as f:
        data = json.load(f)
    return data, torch.load(os.path.join(out, case + ".pt"))


def differences(got, want, rtol=RTOL):
    """What differs by more than rtol: each loss (relative, above 1 in size), each parameter
    (|delta| / |p|), and the case's other records (numbers relative, the rest equal)."""
    (da, pa), (db, pb) = got, want
    out = []
    for key in db:
        a, b = da.get(key), db[key]
        if a is None or len(a) != len(b):
            out.append(f"{key}: {a} vs {b}")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if isinstance(y, float) and isinstance(x, float):
                if math.isnan(y) != math.isnan(x) or \
                        (not math.isnan(y) and abs(x - y) > rtol * max(1.0, abs(y))):
                    out.append(f"{key} {i}: {x} vs {y}")
            elif x != y:
                out.append(f"{key} {i}: {x} vs {y}")
    if pa.keys() != pb.keys():
        out.append(f"parameters {sorted(pa)} vs {sorted(pb)}")
        return out
    for name in pb:
        rel = float((pa[name] - pb[name]).norm() / pb[name].norm().clamp_min(1e-12))
        if rel > rtol:
            out.append(f"{name}: |delta|/|p| = {rel:.3g}")
    return out


def largest(got, want):
    """The largest loss difference and parameter |delta|/|p| of `got` from `want`."""
    (da, pa), (db, pb) = got, want
    loss = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(da["losses"], db["losses"]))
    param = max(float((pa[n] - pb[n]).norm() / pb[n].norm().clamp_min(1e-12)) for n in pb)
    return loss, param


