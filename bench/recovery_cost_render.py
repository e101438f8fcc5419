"""docs/benchmarks/recovery_cost.md and recovery_cost.png from bench/recovery_cost.py's runs
(JSON): per layout and configuration, the step time's median over the runs (each run's median
over its steps after the first two, or its mean where the recovering runs commit every K steps:
its cost comes once per K), its ratio to no recovery's with the noise bound, and the memory per
node.

    .venv/bin/python bench/recovery_cost_render.py RUNS.json --out docs/benchmarks/recovery_cost
"""
import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402

# Targets (issue "recovery where people train", item 5): of the step without recovery.
TARGETS = {"restarts": 1.03, "parity:2": 1.05, "replica": 1.05}
NAMES = {"none": "no recovery", "restarts": "`--max-restarts 1` (journal)",
         "parity:2": "`--redundancy parity:2`", "replica": "`--redundancy replica`"}
# Of the state (1x, the node's ranks' persistent state) a configuration's redundancy holds.
PARITY_OF_STATE = {"parity:2": 0.5, "replica": 1.0}
MIB = 2 ** 20


def groups(runs):
    out = {}
    for r in runs:
        out.setdefault(r["layout"], {}).setdefault(r["config"], []).append(r)
    return out


def per_node(r):
    """A run's memory per node: the machine's beyond the run's start, per node, and, where the
    daemons committed their pools at their start (before it: --pool-commit, every run of
    recovery_cost.py since the background protect), node 0's pool at its peak added back."""
    committed = r.get("pool_committed", True)
    return r["peak_bytes_per_node"] + (r["node0"].get("pool_peak", 0) if committed else 0)


def step(r, k):
    """A run's step time: its median step, or with K steps per commit its mean step (over a whole
    number of commits, recovery_cost.py checks), for every configuration alike."""
    return r["mean_step"] if k > 1 else r["median_step"]


def summary(rs, k=1):
    medians = [step(r, k) for r in rs]
    return {"median": statistics.median(medians), "low": min(medians), "high": max(medians),
            "runs": len(rs),
            "peak": statistics.median(per_node(r) for r in rs),
            "pool_peak": statistics.median(r["node0"].get("pool_peak", 0) for r in rs),
            "state": statistics.median(r["node0"].get("protected_bytes", 0) for r in rs),
            "parity": statistics.median(r["node0"].get("parity_bytes", 0) for r in rs),
            "others": max(r["others_cores"] for r in rs)}


def render(runs, header, k=1, image="recovery_cost.png"):
    g = groups(runs)
    first = runs[0]
    names = {c: n + (f" `--steps-per-commit {k}`" if k > 1 and c != "none" else "")
             for c, n in NAMES.items()}
    statistic = "median" if k == 1 else "mean"
    title = "# Recovery's cost on a 105 M-parameter model" + (
        f", {k} steps per commit" if k > 1 else "")
    lines = [title, "", *header, "",
             "Run by `bench/recovery_cost.py`, every figure from that one run; rendered by "
             "`bench/recovery_cost_render.py`. One command of each kind, as run (in the "
             "repository root):", ""]
    seen = set()
    for r in runs:
        if r["config"] not in seen:
            seen.add(r["config"])
            lines += ["```", r["command"], "```", ""]
    lines += [
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}. The model: examples/train_hf.py's Llama (hidden 768, "
        "14 layers, 12 heads, intermediate 2048, vocabulary 8,192, tied embeddings: about "
        "105 M parameters), fp32, AdamW, sequences of 128, 2 sequences per rank per step. Each "
        "run on a fresh LocalCluster (a planner and one daemon per node on this machine, "
        "3 GiB pools, their pages taken at the daemons' start: `ragshardd --pool-commit`, so "
        "that no step pays for a page's first touch), the configurations alternated round by "
        "round "
        f"({max(r['round'] for r in runs) + 1} rounds). A run's step time: the {statistic} over "
        "its "
        f"steps after the first two ({len(first['steps']) - 2} steps) of rank 0's wall time of "
        "the step (forward, backward, clipping, optimizer step, zero_grad)" + (
            "." if k == 1 else
            f": with {k} steps per commit, each {k}-th step pays the journal's undo copies and "
            f"the wait for the last protect, so the mean over a whole number of commits counts "
            f"their cost where a median would leave it out; the runs without recovery are "
            f"measured the same way."), "",
        "Noise, as docs/benchmarks/README defines it: the larger of 5 % of no recovery's "
        "median and the spread (max − min) of the runs' medians.", ""]
    for layout in sorted(g):
        by = g[layout]
        if "none" not in by:
            continue
        base = summary(by["none"], k)
        noise = max(0.05 * base["median"], max(summary(v, k)["high"] - summary(v, k)["low"]
                                               for v in by.values()))
        lines += [f"## {layout.replace('x', ' daemons × ')} ranks", "",
                  f"| configuration | step (s), median of runs' {statistic}s | min–max | runs "
                  "| × no recovery | "
                  "target | within noise of the target |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for config in ("none", "restarts", "parity:2", "replica"):
            if config not in by:
                continue
            s = summary(by[config], k)
            ratio = s["median"] / base["median"]
            target = TARGETS.get(config)
            verdict = "" if target is None else (
                "met" if ratio <= target else
                "within noise" if s["median"] - target * base["median"] <= noise else "not met")
            lines.append(f"| {names[config]} | {s['median']:.2f} | {s['low']:.2f}–"
                         f"{s['high']:.2f} | {s['runs']} | {ratio:.3f} | "
                         f"{'' if target is None else f'≤ {target:.2f}'} | {verdict} |")
        lines += ["", f"Noise: {noise:.2f} s.", "",
                  "Memory per node: the machine's memory in use at the run's peak beyond its "
                  "start (/proc/meminfo, MemTotal − MemAvailable: the ranks and the daemons' "
                  "heaps), per node, plus node 0's pool at its peak (the pools' pages were "
                  "taken at the daemons' start, before the run's: only the part in use counts); "
                  "node 0's pool at its peak; its ranks' persistent "
                  "state (the parameter shards and the optimizers' state and step counts, as "
                  "the protect reads them: 1×); and the parities it held at the end.", "",
                  "| configuration | per node (MiB) | over no recovery (MiB) | pool peak (MiB) "
                  "| state (MiB) | parities (MiB) | over no recovery, in states | an undo copy and one parity, in states |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        state = max(summary(v, k)["state"] for v in by.values())
        for config in ("none", "restarts", "parity:2", "replica"):
            if config not in by:
                continue
            s = summary(by[config], k)
            over = s["peak"] - base["peak"]
            ideal = "" if config == "none" else f"{1 + PARITY_OF_STATE.get(config, 0):.2f}"
            lines.append(f"| {names[config]} | {s['peak'] / MIB:.0f} | {over / MIB:.0f} | "
                         f"{s['pool_peak'] / MIB:.0f} | {s['state'] / MIB:.0f} | "
                         f"{s['parity'] / MIB:.0f} | "
                         f"{over / state if state else 0:.2f} | {ideal} |")
        lines += [""]
    lines += [f"![step time per configuration, as a ratio to no recovery]({image})", ""]
    return "\n".join(lines)


def plot(runs, path, k=1):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = groups(runs)
    fig, axes = plt.subplots(1, len(g), figsize=(5 * len(g), 3.5), squeeze=False)
    for ax, layout in zip(axes[0], sorted(g)):
        by = g[layout]
        base = summary(by["none"], k)["median"]
        configs = [c for c in ("none", "restarts", "parity:2", "replica") if c in by]
        for i, c in enumerate(configs):
            xs = [step(r, k) / base for r in by[c]]
            ax.scatter([i] * len(xs), xs, color="gray", s=12)
            ax.bar(i, summary(by[c], k)["median"] / base, 0.6, alpha=0.5)
            if c in TARGETS:
                ax.hlines(TARGETS[c], i - 0.3, i + 0.3, color="red")
        ax.set_xticks(range(len(configs)), configs)
        ax.set_ylim(0.8, None)
        ax.set_title(f"{layout}: step time / no recovery (red: target)" +
                     (f"\n{k} steps per commit" if k > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs")
    p.add_argument("--out", default=os.path.join(provenance.ROOT, "docs", "benchmarks",
                                                 "recovery_cost"))
    p.add_argument("--header", default="", help="the run's provenance lines (JSON list); "
                   "default: those the runs file holds")
    a = p.parse_args()
    data = json.load(open(a.runs))
    runs, header = (data["runs"], data["provenance"]) if isinstance(data, dict) else (data, [])
    k = data.get("steps_per_commit", 1) if isinstance(data, dict) else 1
    with open(a.out + ".md", "w") as f:
        f.write(render(runs, header, k, os.path.basename(a.out) + ".png") + "\n")
    plot(runs, a.out + ".png", k)


if __name__ == "__main__":
    main()
