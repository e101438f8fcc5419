"""Before/after check of the control path for a refactor: the planner benchmark and the
control-plane benchmark of two builds (an old commit's and this one's), alternated in one run,
`--reps` times each, judged by the brief's rule for "within noise": the median moved by less
than the larger of 5 % and the repetitions' spread (max - min, the larger of the two builds').
Deterministic figures (padding, imbalance, split blocks, plan size) must be equal.

    git worktree add /tmp/old OLD && cmake -S /tmp/old -B /tmp/old/build -G Ninja \\
        -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build /tmp/old/build \\
        --target planner_bench control_plane_bench ragshard-planner
    .venv/bin/python bench/ab_compare.py --old /tmp/old/build --new build --label OLD \\
        --out docs/benchmarks/refactor_ab.md
"""
import argparse
import csv
import datetime
import os
import re
import statistics
import subprocess
import tempfile

import provenance

# Figures of planner_bench's CSV: DeepSeek-V3, ragged policy, rows:128.
PLAN_CASES = [(1024, "rows:128"), (65536, "rows:128"), (1024, "element")]
EXACT = ["padding_elems", "imbalance", "blocks128_split", "matrices_split", "lb2_gap_pct"]
# Figures of control_plane_bench's table, in seconds.
CONTROL = {"full inventory registered": "registered s", "all 1024 registrations answered":
           "answered s", "job READY": "READY s", "all 1024 watchers hold the plan": "fan-out s"}


def planner(build, work):
    out = os.path.join(work, "p.md")
    csv_path = os.path.join(work, "p.csv")
    subprocess.run([os.path.join(build, "bench", "planner_bench"), "--models", "deepseek-v3",
                    "--worlds", "1024", "--out", out, "--csv", csv_path], check=True,
                   capture_output=True, timeout=1200)
    timed, exact = {}, {}
    for row in csv.DictReader(open(csv_path)):
        case = (int(row["world"]), row["granule"])
        if row["policy"] == "ragged" and case in PLAN_CASES:
            timed[f"plan s W={case[0]} {case[1]}"] = float(row["plan_seconds"])
            exact[case] = {k: row[k] for k in EXACT}
    return timed, exact


def control(build, work):
    out = os.path.join(work, "c.md")
    subprocess.run([os.path.join(build, "bench", "control_plane_bench"), "--ranks", "1024",
                    "--model", "deepseek-v3", "--granule", "rows:128", "--out", out],
                   check=True, capture_output=True, timeout=1200)
    figures, exact = {}, {}
    for line in open(out):
        m = re.match(r"\| (.+?) \| (.+?) \|$", line.strip())
        if not m:
            continue
        for prefix, name in CONTROL.items():
            if m.group(1).startswith(prefix):
                figures[name] = float(m.group(2).split()[0])
        if m.group(1) in ("plan message size", "failed calls", "final job status"):
            exact[m.group(1)] = m.group(2)
    return figures, exact


def verdict(old, new):
    mo, mn = statistics.median(old), statistics.median(new)
    spread = max(max(old) - min(old), max(new) - min(new))
    moved = abs(mn - mo)
    return mo, mn, moved <= max(0.05 * mo, spread)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the old commit's build folder")
    ap.add_argument("--new", default="build")
    ap.add_argument("--label", default="old", help="the old commit, for the report")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="docs/benchmarks/refactor_ab.md")
    provenance.add_flag(ap)
    a = ap.parse_args()
    provenance.require(a)
    samples = {"old": {}, "new": {}}
    exact = {"old": None, "new": None}
    with tempfile.TemporaryDirectory() as work:
        for rep in range(a.reps):
            for side, build in (("old", a.old), ("new", a.new)):
                t, e1 = planner(build, work)
                c, e2 = control(build, work)
                for k, v in {**t, **c}.items():
                    samples[side].setdefault(k, []).append(v)
                e = (sorted(e1.items()), sorted(e2.items()))
                if exact[side] is not None and exact[side] != e:
                    raise SystemExit(f"{side}: deterministic figures changed between reps")
                exact[side] = e
            print(f"rep {rep + 1}/{a.reps} done", flush=True)
    rows, ok = [], True
    for k in samples["old"]:
        o, n = samples["old"][k], samples["new"][k]
        mo, mn, within = verdict(o, n)
        ok &= within
        rows.append((k, o, n, mo, mn, within))
    same = exact["old"] == exact["new"]
    lines = [
        "# Control path before and after a refactor", "",
        f"Run on {datetime.date.today()} on this repository's 2-core development machine by "
        f"`.venv/bin/python bench/ab_compare.py --old OLD_BUILD --new build --label {a.label}`: "
        f"`planner_bench --models deepseek-v3 --worlds 1024` and `control_plane_bench --ranks "
        f"1024 --model deepseek-v3 --granule rows:128` of commit {a.label} (old) and of this "
        f"commit (new), alternated, {a.reps} repetitions each in one run. Within noise: the "
        "median moved by less than the larger of 5 % and the spread (max − min, the larger "
        "of the two builds').", "",
        "| figure | old median (min–max) | new median (min–max) | new ÷ old | within noise |",
        "|---|---:|---:|---:|---|"]
    for k, o, n, mo, mn, within in rows:
        lines.append(f"| {k} | {mo:.4g} ({min(o):.4g}–{max(o):.4g}) | {mn:.4g} "
                     f"({min(n):.4g}–{max(n):.4g}) | {mn / mo:.2f}× | "
                     f"{'yes' if within else '**no**'} |")
    lines += ["", "Deterministic figures (padding, imbalance, split 128×128 blocks, split "
              "matrices and the LB2 gap of each planned case; the plan message's size, failed "
              "calls and the final job status): " +
              ("**identical** in both builds." if same else
               f"**differ**: old {exact['old']}, new {exact['new']}."), "",
              "Verdict: " + ("every timed figure within noise." if ok else
                             "**some figures moved beyond noise** (rows marked no)."), ""]
    provenance.write(a.out, "\n".join(lines), a.provenance)
    plot(rows, os.path.splitext(a.out)[0] + ".png", a.label)
    print(f"wrote {a.out}")


def plot(rows, path, label):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(rows)))
    for i, (k, o, n, mo, _, _) in enumerate(rows):
        for j, (side, vals) in enumerate((("old", o), ("new", n))):
            rel = [v / mo for v in vals]
            y = i * 3 + j
            ax.barh(y, statistics.median(rel), color="C7" if side == "old" else "C0",
                    label=side if i == 0 else None)
            ax.plot([min(rel), max(rel)], [y, y], color="black")
    ax.set_yticks([i * 3 + 0.5 for i in range(len(rows))], [r[0] for r in rows])
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel(f"time ÷ old median ({label}); bars: medians, lines: min–max")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
