"""fully_shard's semantics beside FSDP2's, case by case, in two parts. First
examples/train_semantics.py under ragshard (2 daemons x 2 ranks) and under torch's FSDP2 (4
ranks over gloo), each against the same model in one plain PyTorch process (AdamW). Then FSDP2's
training idioms, tests/python/fsdp2_cases.py (the cases of tests/python/test_fsdp2_cases.py:
accumulation, hooks, freezing, clipping, state dicts, FSDP2's module API), under ragshard on the
host and the device-shaped backends and under FSDP2, each against one process. Writes
docs/benchmarks/semantics.md: for each case the largest relative difference of the losses and
of the final parameters from the reference, or the error (the last line a run printed).

    PYTHONPATH=build/python .venv/bin/python bench/semantics_report.py
"""
import argparse
import json
import os
import re
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import fsdp2_case_runs as fcr  # noqa: E402
import fsdp2_cases  # noqa: E402
import provenance  # noqa: E402
from session import run_in_session  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_semantics.py")
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")
CASES = [("plain", 1), ("skip-odd", 1), ("skip-odd", 0), ("expert-unused", 1),
         ("expert-unused", 0), ("eval-no-grad", 1), ("two-forwards", 1), ("frozen", 1),
         ("expert-unused-one-rank", 1), ("expert-unused-one-rank", 0),
         ("swapped-on-one-node", 1)]
# Cases whose right outcome is an error on every rank (the reference is no reference for them:
# a run that completes computed with mixed-up parameters).
ERROR_CASES = {"swapped-on-one-node"}


def outcome(code, text, out, ref, error_case=False):
    if code != 0:
        lines = [line for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        return "error: " + ((errors or lines or ["(no output)"])[-1].strip()[:240])
    if error_case:
        return "**no error**: it ran to the end with mixed-up parameters"
    a, b = json.load(open(out + ".json")), json.load(open(ref + ".json"))
    la, lb = a["losses"] + a["val_losses"], b["losses"] + b["val_losses"]
    dl = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    pa, pb = torch.load(out + ".pt"), torch.load(ref + ".pt")
    dp = max(float((pa[n].float() - pb[n]).norm() / pb[n].norm().clamp_min(1e-12)) for n in pb)
    verdict = "equal" if dl <= 1e-5 and dp <= 1e-5 else "DIFFERENT"
    return f"{verdict} (losses {dl:.1e}, parameters {dp:.1e})"


def case_outcome(out, case, ref, against=None):
    """One cell of the second table: `out`'s case against the reference (or `against`)."""
    if out is None or not os.path.exists(os.path.join(out, case + ".json")):
        return "did not run"
    got = fcr.results(out, case)
    want = fcr.results(*(against or (ref, case)))
    dl, dp = fcr.largest(got, want)
    diff = fcr.differences(got, want, rtol=1e-5)
    return f"{'equal' if not diff else 'DIFFERENT'} (losses {dl:.1e}, parameters {dp:.1e})"


def fsdp2_cases_rows(build, tmp, host, device):
    """(case, what it compares, ragshard host, ragshard device-shaped, FSDP2) of every case of
    tests/python/fsdp2_cases.py, and the runs that failed."""
    dirs, failed = {}, []

    def run(key, make):
        out = os.path.join(tmp, key)
        os.makedirs(out, exist_ok=True)
        error = make(out)
        if error:
            failed.append((key, error.strip().splitlines()[-1][:240]))
        dirs[key] = out
    hsdp, quantized = sorted(fsdp2_cases.HSDP), sorted(fcr.QUANTIZED)
    run("reference", lambda o: fcr.reference_run(
        build, [c for c in fsdp2_cases.CASES if c not in fcr.QUANTIZED], o))
    run("fsdp2", lambda o: fcr.fsdp2_run(build, fcr.WITH_FSDP2, o))
    run("fsdp2-hsdp", lambda o: fcr.fsdp2_run(build, hsdp, o, hsdp=True))
    for backend, cluster in (("host", host), ("device", device)):
        run(f"{backend}-plain", lambda o: fcr.ragshard_run(build, cluster, fcr.PLAIN,
                                                           f"p{backend[0]}", o))
        run(f"{backend}-hsdp", lambda o: fcr.ragshard_run(build, cluster, hsdp, f"h{backend[0]}",
                                                          o, replicate=2))
        run(f"{backend}-amsp", lambda o: fcr.ragshard_run(build, cluster, ["amsp-accum"],
                                                          f"a{backend[0]}", o,
                                                          strategy=fcr.AMSP_STRATEGY))
        run(f"{backend}-quantized", lambda o: fcr.ragshard_run(build, cluster, quantized,
                                                               f"q{backend[0]}", o))
    ref = dirs["reference"]
    rows = []
    for case in fsdp2_cases.CASES:
        kind = "hsdp" if case in fsdp2_cases.HSDP else "amsp" if case in fsdp2_cases.AMSP \
            else "quantized" if case in fcr.QUANTIZED else "plain"
        theirs = dirs["fsdp2-hsdp" if kind == "hsdp" else "fsdp2"]
        against, what = None, "one process"
        if case in fcr.MIXED:
            against, what = (theirs, case), "FSDP2, same policy (bf16)"
        elif case == "quantized-accum":
            against, what = (dirs["host-quantized"], "quantized-once"), "quantized-once"
        elif case == "quantized-once":
            continue
        cells = [case_outcome(dirs[f"{b}-{kind}"], case, ref, against if case != "quantized-accum"
                              else (dirs[f"{b}-quantized"], "quantized-once"))
                 for b in ("host", "device")]
        if case in fsdp2_cases.RAGSHARD_ONLY or case in fcr.QUANTIZED:
            cells.append("–")
        elif case in fcr.MIXED:
            cells.append("from one process (fp32): " + case_outcome(theirs, case, ref)
                         .split(" ", 1)[1])
        else:
            cells.append(case_outcome(theirs, case, ref))
        text = " ".join((fsdp2_cases.CASES[case].__doc__ or "").split())
        doc = re.split(r"\.(?:\s+(?=[A-Z(])|$)", text)[0]
        rows.append((case, doc, what, *cells))
    return rows, failed


def write(path, rows, header, case_rows=(), failed=()):
    lines = [
        "# fully_shard beside FSDP2: PyTorch semantics, case by case", "",
        "Generated by `bench/semantics_report.py`: examples/train_semantics.py (units: two "
        "`nn.TransformerEncoderLayer`s and a two-expert MoE block; AdamW, 6 steps) under "
        "ragshard on 2 daemons x 2 ranks and under torch "
        f"{torch.__version__} FSDP2 on 4 ranks over gloo, each against the same model in one "
        "plain PyTorch process. \"equal\": every loss (training and validation) and every final "
        "parameter within 1e-5 (relative) of the reference. swapped-on-one-node is an error "
        "case: in step 1 the ranks of the first node (ranks 0 and 1) run enc1 where the others "
        "run enc0 (units of equal size); the right outcome is an error on every rank, naming "
        "the units.", "",
        f"{len(rows)} of {len(CASES)} cases measured.", "",
        "| case | zero_grad(set_to_none) | ragshard | FSDP2 |", "|---|---|---|---|"]
    for case, stn, ours, theirs in rows:
        lines.append(f"| {case} | {bool(stn)} | {ours} | {theirs} |")
    if case_rows:
        lines += [
            "", "## FSDP2's training idioms", "",
            "tests/python/fsdp2_cases.py, the cases of tests/python/test_fsdp2_cases.py (written "
            "after the kinds of case of PyTorch's own FSDP2 tests): a small decoder (an "
            "embedding, 3 blocks of LayerNorm and an MLP, each a unit, a head; 4 steps of "
            "AdamW unless the case says otherwise) under ragshard at 2 daemons x 2 ranks on the "
            "host and the device-shaped backends, and under FSDP2 on 4 ranks over gloo, each "
            "against one plain PyTorch process on the same global batch (the bf16 cases against "
            "FSDP2 with the same policy; int8 gathers' accumulation against one backward over "
            "the same rows). \"equal\": every loss, every final parameter and every number "
            "the case records (norms, values read in hooks) within 1e-5 (relative). Each mode "
            "ran all its cases in one launch.", "",
            "| case | what | against | ragshard, host | ragshard, device-shaped | FSDP2 |",
            "|---|---|---|---|---|---|"]
        for case, doc, what, host, device, theirs in case_rows:
            lines.append(f"| {case} | {doc} | {what} | {host} | {device} | {theirs} |")
        for key, error in failed:
            lines.append(f"\nRun **{key}** failed: `{error}`")
    provenance.write(path, "\n".join(lines) + "\n", header)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "semantics.md"))
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    provenance.add_flag(p)
    a = p.parse_args()
    provenance.require(a)
    sys.path.insert(0, os.path.join(a.build, "python"))
    from ragshard.cluster import LocalCluster
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(a.build, daemons=2, pool_bytes=128 << 20,
                         cluster_profile=PROFILE) as cluster, \
            LocalCluster(a.build, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE,
                         backend="device-shaped") as device:
        # (after the clusters start: their token is in this process's environment now)
        env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))
        for i, (case, stn) in enumerate(CASES):
            extra = ["--case", case, "--set-to-none", str(stn)]
            base = os.path.join(tmp, str(i))
            code, text = run_in_session([sys.executable, EXAMPLE, "--reference", "--world", "4",
                                         "--out", base + "-ref"] + extra, env, a.timeout)
            if code != 0:
                sys.exit(f"the reference failed for {case}: {text}")
            code, text = run_in_session(
                [sys.executable, "-m", "ragshard.launch", "--planner", cluster.planner, "--job",
                 f"sem{i}", "--nproc", "4", "--sockets", ",".join(cluster.sockets),
                 "--create-job", EXAMPLE, "--out", base + "-rs"] + extra, env, a.timeout)
            ours = outcome(code, text, base + "-rs", base + "-ref", case in ERROR_CASES)
            store = os.path.join(tmp, f"store{i}")
            ranks = " ".join(
                f"RANK={r} WORLD_SIZE=4 {sys.executable} {EXAMPLE} --fsdp2 {store} "
                f"--out {base}-fsdp2 {' '.join(extra)} & pids+=($!);" for r in range(4))
            code, text = run_in_session(
                ["bash", "-c", f"pids=(); {ranks} rc=0; for p in ${{pids[@]}}; do wait $p || "
                 "rc=$?; done; exit $rc"], env, a.timeout)
            theirs = outcome(code, text, base + "-fsdp2", base + "-ref", case in ERROR_CASES)
            rows.append((case, stn, ours, theirs))
            print(f"{case} set_to_none={stn}: ragshard {ours}; FSDP2 {theirs}", flush=True)
            write(a.out, rows, a.provenance)  # after every case, so a cut-off run keeps what it measured
        print("FSDP2's training idioms ...", flush=True)
        case_rows, failed = fsdp2_cases_rows(os.path.abspath(a.build), tmp, cluster, device)
        write(a.out, rows, a.provenance, case_rows, failed)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
