"""Before/after check of the control path: the planner benchmark and the control-plane benchmark
of two builds (an old commit's and this one's), alternated in one run, `--reps` times each,
judged by the brief's rule for "within noise": the median moved by less than the larger of 5 %
and the repetitions' spread (max - min, the larger of the two builds'). Deterministic figures
(padding, imbalance, split blocks; the plan's size, the nodes holding it, failed calls, the
final job status) must be equal. `--what` names what changed between the two (the report's
title and first paragraph: "the control path before and after WHAT").

Each repetition runs, for each build,

    planner_bench --models deepseek-v3 --worlds 1024 --csv ...
        plan seconds of the ragged policy: W=1024 element, W=1024 rows:128, W=65536 rows:128
    control_plane_bench --nodes 128 --ranks-per-node 8 --model deepseek-v3 --granule rows:128
        --json
        1,024 ranks on 128 simulated nodes; from its JSON object: registrations answered
        (registrations_answered_s), READY (ready_s), every node holds the plan
        (all_nodes_hold_plan_s), the planner's CPU seconds (planner_cpu_s)

and, with --data-path (the collectives and the no-op latency),

    collectives_bench --members 2 --max-mib 16
        the data plane's collectives between 2 processes over UCX (each build's own program):
        all-gather and reduce-scatter seconds at 1 and 16 MiB
    daemon_bench --config 2x1 --bytes S (S = 1 MiB, 64 MiB)
        2 daemons x 1 rank through the command queue: all-gather and reduce-scatter seconds,
        and at 1 MiB the no-op's p50 (back to back, after 1 ms idle, over gRPC). The NEW
        build's daemon_bench drives both builds' ragshardd and ragshard-planner (it runs the
        servers beside it, so the script links each build's servers into a folder with a copy
        of it): the rank side and the way it times are the same, the daemons differ.

Both builds' control_plane_bench must have the node CLI (--nodes, --ranks-per-node, --json:
commit 301ec96 on), read from its --help; an older one (--ranks, a Markdown table of one watcher
per rank) measures another setup, so the script stops and says so rather than compare them.
planner_bench's --allow-dirty (where its --help lists it) is always passed: its report goes to a
temporary folder, and the commit this report names is this script's (bench/provenance.py).

    git worktree add /tmp/old OLD && cmake -S /tmp/old -B /tmp/old/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRAGSHARD_WITH_CUDA=OFF && cmake --build \\
        /tmp/old/build --target planner_bench control_plane_bench ragshard-planner
    .venv/bin/python bench/ab_compare.py --old /tmp/old/build --new build --label OLD \\
        --what "a refactor" --out docs/benchmarks/refactor_ab.md
"""
import argparse
import csv
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time

import provenance

# Figures of planner_bench's CSV: DeepSeek-V3, ragged policy.
PLAN_CASES = [(1024, "rows:128"), (65536, "rows:128"), (1024, "element")]
EXACT = ["padding_elems", "imbalance", "blocks128_split", "matrices_split", "lb2_gap_pct"]
PLANNER_ARGS = ["--models", "deepseek-v3", "--worlds", "1024"]
# control_plane_bench: 1,024 ranks as 128 nodes of 8.
CONTROL_ARGS = ["--nodes", "128", "--ranks-per-node", "8", "--model", "deepseek-v3",
                "--granule", "rows:128", "--json"]
# Its JSON keys, timed (seconds) and the report's names for them.
CONTROL = {"registrations_answered_s": "registrations answered s", "ready_s": "READY s",
           "all_nodes_hold_plan_s": "every node holds the plan s",
           "planner_cpu_s": "planner CPU s"}
CONTROL_EXACT = ["ranks", "tensors", "plan_bytes", "plan_wire_bytes", "nodes_holding_plan",
                 "mismatched_plans", "failed_calls", "final_job_status"]


def binary(build, name):
    path = os.path.join(build, "bench", name)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path}: no such program (build the target {name} in {build})")
    return path


def help_text(path):
    r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def probe(build):
    """The flags each of the build's benchmarks takes, checked against what this script runs."""
    planner_help = help_text(binary(build, "planner_bench"))
    missing = [f for f in ("--models", "--worlds", "--csv", "--out") if f not in planner_help]
    if missing:
        raise SystemExit(f"{build}: planner_bench takes no {', '.join(missing)}:\n"
                         f"{planner_help}")
    control_help = help_text(binary(build, "control_plane_bench"))
    missing = [f for f in ("--nodes", "--ranks-per-node", "--model", "--granule", "--json")
               if f not in control_help]
    if missing:
        raise SystemExit(
            f"{build}: control_plane_bench takes no {', '.join(missing)} (an older CLI, before "
            "commit 301ec96: --ranks N and a Markdown table, one watcher per rank, not "
            "simulated nodes); its figures measure another setup, so the builds cannot be "
            f"compared on it. Its --help:\n{control_help}")
    return {"planner_allow_dirty": "--allow-dirty" in planner_help}


def run(cmd):
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1200)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{shlex.join(cmd)} exited {e.returncode}:\n{e.stdout}{e.stderr}")


def planner(build, work, flags):
    out = os.path.join(work, "p.md")
    csv_path = os.path.join(work, "p.csv")
    run([binary(build, "planner_bench"), *PLANNER_ARGS, "--out", out, "--csv", csv_path]
        + (["--allow-dirty"] if flags["planner_allow_dirty"] else []))
    timed, exact = {}, {}
    for row in csv.DictReader(open(csv_path)):
        case = (int(row["world"]), row["granule"])
        if row["policy"] == "ragged" and case in PLAN_CASES:
            timed[f"plan s W={case[0]} {case[1]}"] = float(row["plan_seconds"])
            exact[case] = {k: row[k] for k in EXACT}
    if len(timed) != len(PLAN_CASES):
        raise SystemExit(f"{build}: planner_bench's CSV lacks some of {PLAN_CASES}")
    return timed, exact


def control(build):
    cmd = [binary(build, "control_plane_bench"), *CONTROL_ARGS]
    r = run(cmd)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if len(lines) != 1:
        raise SystemExit(f"{shlex.join(cmd)} printed no JSON object:\n{r.stdout}{r.stderr}")
    j = json.loads(lines[0])
    bad = [k for k in CONTROL if not isinstance(j.get(k), (int, float)) or j[k] < 0]
    if "error" in j or bad or j.get("final_job_status") != "JOB_READY":
        raise SystemExit(f"{shlex.join(cmd)} failed (error {j.get('error')!r}, no figure for "
                         f"{bad}, job {j.get('final_job_status')}):\n{lines[0]}")
    return ({name: float(j[k]) for k, name in CONTROL.items()},
            {k: j.get(k) for k in CONTROL_EXACT})


# The data path (--data-path): collectives_bench's rows and daemon_bench's sizes.
COLLECTIVE_CASES = [(op, size) for op in ("allgather", "reducescatter")
                    for size in (1 << 20, 16 << 20)]
DAEMON_SIZES = [1 << 20, 64 << 20]
NOOPS = {"noop-latency-us": "no-op p50 µs", "noop-idle-latency-us": "no-op after idle p50 µs",
         "noop-rpc-latency-us": "no-op over gRPC p50 µs"}


def servers_with(build, daemon_bench, work, side):
    """A folder holding a copy of `daemon_bench` and links to `build`'s servers, which that
    daemon_bench runs (it looks beside itself first)."""
    folder = os.path.join(work, f"servers-{side}")
    os.makedirs(folder, exist_ok=True)
    for name in ("ragshardd", "ragshard-planner"):
        target = os.path.abspath(os.path.join(build, "server", name))
        if not os.access(target, os.X_OK):
            raise SystemExit(f"{target}: no such program (build the target {name} in {build})")
        link = os.path.join(folder, name)
        if not os.path.lexists(link):
            os.symlink(target, link)
    copy = os.path.join(folder, "daemon_bench")
    if not os.path.exists(copy):
        shutil.copy2(daemon_bench, copy)
    return copy


def data_path(build, daemon_bench):
    """collectives_bench's and daemon_bench's figures of one build: {name: seconds or µs}."""
    out = {}
    rows = run([binary(build, "collectives_bench"), "--members", "2", "--max-mib", "16"]).stdout
    for line in rows.splitlines():
        f = line.split(",")
        if len(f) == 7 and f[0] == "ragshard-ucx" and (f[1], int(f[3])) in COLLECTIVE_CASES:
            out[f"ucx {f[1]} {int(f[3]) >> 20} MiB s"] = float(f[4])
    for size in DAEMON_SIZES:
        text = run([daemon_bench, "--config", "2x1", "--bytes", str(size)]).stdout
        for line in text.splitlines():
            f = line.split(",")
            if len(f) == 7 and f[0] == "ragshard-daemons-2x1":
                out[f"daemons 2x1 {f[1]} {size >> 20} MiB s"] = float(f[4])
            elif len(f) == 4 and f[0] in NOOPS:
                out[NOOPS[f[0]]] = float(f[2].split("=")[1])
    want = len(COLLECTIVE_CASES) + 2 * len(DAEMON_SIZES) + len(NOOPS)
    if len(out) != want:
        raise SystemExit(f"{build}: the data-path benchmarks gave {sorted(out)}, not {want} "
                         "figures")
    return out


def verdict(old, new):
    """(old median, new median, judgement): "yes" within noise, "better" or "**worse**" beyond
    it. Every figure is a time (lower is better)."""
    mo, mn = statistics.median(old), statistics.median(new)
    spread = max(max(old) - min(old), max(new) - min(new))
    if abs(mn - mo) <= max(0.05 * mo, spread):
        return mo, mn, "yes"
    return mo, mn, "better" if mn < mo else "**worse**"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the old commit's build folder")
    ap.add_argument("--new", default="build")
    ap.add_argument("--label", default="old", help="the old commit, for the report")
    ap.add_argument("--what", default="a refactor",
                    help="what changed between the old commit and this one, for the report's "
                         "title and first paragraph (\"... before and after WHAT\")")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--data-path", action="store_true",
                    help="also the collectives (collectives_bench) and, through the daemons, "
                         "all-gather, reduce-scatter and the no-op latency (daemon_bench)")
    ap.add_argument("--out", default="docs/benchmarks/refactor_ab.md")
    ap.add_argument("--append", action="store_true",
                    help="keep the report's earlier sections and add this run's after them (a "
                         "section of the same title is replaced); its plot is "
                         "<out>_<label>.png")
    provenance.add_flag(ap)
    a = ap.parse_args()
    provenance.require(a)
    flags = {"old": probe(a.old), "new": probe(a.new)}
    samples = {"old": {}, "new": {}}
    exact = {"old": None, "new": None}
    rep_s = []
    with tempfile.TemporaryDirectory() as work:
        benches = {}
        if a.data_path:
            daemon_bench = binary(a.new, "daemon_bench")
            benches = {side: servers_with(build, daemon_bench, work, side)
                       for side, build in (("old", a.old), ("new", a.new))}
        for rep in range(a.reps):
            t0 = time.monotonic()
            for side, build in (("old", a.old), ("new", a.new)):
                t, e1 = planner(build, work, flags[side])
                c, e2 = control(build)
                d = data_path(build, benches[side]) if a.data_path else {}
                for k, v in {**t, **c, **d}.items():
                    samples[side].setdefault(k, []).append(v)
                e = (sorted(e1.items()), sorted(e2.items()))
                if exact[side] is not None and exact[side] != e:
                    raise SystemExit(f"{side}: deterministic figures changed between reps")
                exact[side] = e
            rep_s.append(time.monotonic() - t0)
            print(f"rep {rep + 1}/{a.reps} done in {rep_s[-1]:.0f} s", flush=True)
    rows, ok = [], True
    for k in samples["old"]:
        o, n = samples["old"][k], samples["new"][k]
        mo, mn, judged = verdict(o, n)
        ok &= judged != "**worse**"
        rows.append((k, o, n, mo, mn, judged))
    same = exact["old"] == exact["new"]
    what = (f" --what {shlex.quote(a.what)}" if a.what != "a refactor" else "") + (
        " --data-path" if a.data_path else "") + (" --append" if a.append else "")
    paths = "control and data paths" if a.data_path else "control path"
    lines = [
        f"# {paths.capitalize()} before and after {a.what}", "",
        f"The {paths} before and after {a.what}: commit {a.label} (old) against this "
        f"commit (new). Run on {datetime.date.today()} on this repository's 2-core development "
        f"machine by `.venv/bin/python bench/ab_compare.py --old OLD_BUILD --new build --label "
        f"{a.label}{what} --reps {a.reps}`: `planner_bench {' '.join(PLANNER_ARGS)}` and "
        f"`control_plane_bench {' '.join(CONTROL_ARGS)}` (1,024 ranks on 128 simulated nodes)"
        + (", `collectives_bench --members 2 --max-mib 16` and `daemon_bench --config 2x1 "
           "--bytes S` (S = 1 and 64 MiB; the new build's daemon_bench driving each build's "
           "daemons and planner)" if a.data_path else "") +
        f" of both builds, alternated, {a.reps} repetition{'s' * (a.reps != 1)} each in one run "
        f"({statistics.median(rep_s):.0f} s a repetition of both). Within noise: the median "
        "moved by less than the larger of 5 % and the spread (max − min, the larger of the "
        "two builds').", "",
        "| figure | old median (min–max) | new median (min–max) | new ÷ old | within noise (or "
        "better, worse) |",
        "|---|---:|---:|---:|---|"]
    for k, o, n, mo, mn, judged in rows:
        ratio = f"{mn / mo:.2f}×" if mo else "–"
        lines.append(f"| {k} | {mo:.4g} ({min(o):.4g}–{max(o):.4g}) | {mn:.4g} "
                     f"({min(n):.4g}–{max(n):.4g}) | {ratio} | "
                     f"{judged} |")
    lines += ["", "Timed figures: planning (one core) of DeepSeek-V3 by the ragged policy; "
              "control_plane_bench's seconds from the first registration until every "
              "registration was answered, until the job was READY (plan computed, stored, the "
              "first node holds it) and until every node held the plan, and the planner "
              "process's CPU seconds over that span (counted in 0.01 s ticks)."
              + (" Data path: collectives_bench's slowest member's mean seconds per "
                 "collective; daemon_bench's all-gather and reduce-scatter from call to answer "
                 "(the slowest rank's mean; the reduce-scatter's gradient allocation is timed "
                 "apart and not shown), and rank 0's no-op p50 through the command queue, "
                 "back to back and after 1 ms idle, and over gRPC." if a.data_path else ""),
              "",
              "Deterministic figures (padding, imbalance, split 128×128 blocks, split "
              "matrices and the LB2 gap of each planned case; the ranks, tensors, the plan's "
              "size and compressed size, the nodes holding it, mismatched plans, failed calls "
              "and the final job status): " +
              ("**identical** in both builds." if same else
               f"**differ**: old {exact['old']}, new {exact['new']}."), "",
              "Verdict: " + ("every timed figure within noise or better (every figure is a "
                             "time: lower is better)." if ok else
                             "**some figures got worse beyond noise** (rows marked worse)."),
              ""]
    text, png = "\n".join(lines), os.path.splitext(a.out)[0] + ".png"
    if a.append:
        text = with_earlier_sections(a.out, lines[0], text)
        png = f"{os.path.splitext(a.out)[0]}_{a.label}.png"
    provenance.write(a.out, text, a.provenance, heading=lines[0])
    plot(rows, png, a.label)
    print(f"wrote {a.out}")


def with_earlier_sections(path, title, section):
    """The report at `path` (if any) without a section titled `title`, then `section`."""
    try:
        rows = open(path).read().rstrip("\n").split("\n")
    except OSError:
        return section
    if title in rows:
        at = rows.index(title)
        end = next((i for i in range(at + 1, len(rows)) if rows[i].startswith("# ")), len(rows))
        rows = rows[:at] + rows[end:]
    earlier = "\n".join(rows).rstrip("\n")
    return f"{earlier}\n\n{section}" if earlier else section


def plot(rows, path, label):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    for i, (k, o, n, mo, _, _) in enumerate(rows):
        for j, (side, vals) in enumerate((("old", o), ("new", n))):
            rel = [v / mo if mo else 1.0 for v in vals]
            y = i * 3 + j
            ax.barh(y, statistics.median(rel), color="C7" if side == "old" else "C0",
                    label=side if i == 0 else None)
            ax.plot([min(rel), max(rel)], [y, y], color="black")
    ax.set_yticks([i * 3 + 0.5 for i in range(len(rows))], [r[0] for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel(f"seconds ÷ old median ({label}); bars: medians, lines: min–max")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
