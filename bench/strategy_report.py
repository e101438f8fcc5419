"""Writes docs/benchmarks/strategy.md: the strategy search on the model zoo against sharding
everything over all W, the LLaMA runs for the AMSP comparison, and the calibration of the cost
model against the daemons on this machine. Every figure comes from running the tools here.

    .venv/bin/python bench/strategy_report.py --build build
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "profiles", "h100-8x-nvlink-ib400.json")
HOST = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")
ZOO = ["llama3-8b", "llama3-70b", "llama3.1-405b", "gpt3-175b", "mixtral-8x7b",
       "qwen3-235b-a22b", "llama-7b", "llama-13b", "llama-30b", "deepseek-v3"]
WORLDS = [1024, 8192, 65536]
GIB = float(1 << 30)
REPEATS = 5


def ctl(build, *args):
    t0 = time.perf_counter()
    r = subprocess.run([os.path.join(build, "client", "ragshardctl"), *args],
                       capture_output=True, text=True, timeout=600)
    return r, time.perf_counter() - t0


def advise(build, model, world, extra=()):
    r, wall = ctl(build, "advise", "--model", model, "--cluster", H100, "--granule", "rows:128",
                  "--world", str(world), "--tokens-per-step", str(world * 4096), "--json",
                  "--max-rejected", "0", *extra)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}, wall
    return json.loads(r.stdout), wall


def simulate(build, model, world, spec, extra=(), png=None):
    args = ["simulate", "--model", model, "--cluster", H100, "--granule", "rows:128",
            "--world", str(world), "--tokens-per-step", str(world * 4096), "--strategy", spec,
            "--json", *extra]
    if png:
        args += ["--png", png]
    r, _ = ctl(build, *args)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return json.loads(r.stdout)


def zoo_section(build, lines, rows):
    lines += ["## Targets on the model zoo (8×H100 nodes, rows:128, 80 GiB)", "",
              "`ragshardctl advise --model M --cluster profiles/h100-8x-nvlink-ib400.json "
              "--granule rows:128 --world W --tokens-per-step W×4096 --json` against "
              "`ragshardctl simulate ... --strategy k=1,shard=8x(W/8)` (every unit sharded over "
              "all W: FSDP/ZeRO-3 on per-layer units). Memory is per device; the step time is the "
              "cost model's prediction for one 4096-token sequence per device. Targets: padding "
              "< 1 % and memory ≤ 80 GiB where any candidate fits; search < 2 s.", "",
              "| model | W | advised strategy | padding | memory | step s | all-W padding | "
              "all-W memory | all-W step s | search s | padding < 1 % | fits 80 GiB | "
              "search < 2 s |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|:-:|:-:|:-:|"]
    for model in ZOO:
        for w in WORLDS:
            a, wall = advise(build, model, w)
            base = simulate(build, model, w, f"k=1,shard=8x{w // 8}")
            if "error" in a:
                rows.append((model, w, None, base, wall))
                lines.append(f"| {model} | {w} | nothing fits: {a['error'][:160]} | | | | "
                             f"{base.get('padding_pct', float('nan')):.3f} % | "
                             f"{base.get('memory_bytes', 0) / GIB:.1f} GiB | "
                             f"{base.get('predicted_step_seconds', 0):.3f} | {wall:.2f} | – | "
                             f"missed | {'met' if wall < 2 else 'missed'} |")
                continue
            rec = a["recommendation"]
            rows.append((model, w, a, base, wall))
            pad_ok = rec["padding_pct"] < 1.0
            fits = rec["memory_bytes"] <= 80 * GIB
            lines.append(
                f"| {model} | {w} | `{rec['strategy']['spec']}` | {rec['padding_pct']:.3f} % | "
                f"{rec['memory_bytes'] / GIB:.1f} GiB | {rec['predicted_step_seconds']:.3f} | "
                f"{base['padding_pct']:.3f} % | {base['memory_bytes'] / GIB:.1f} GiB | "
                f"{base['predicted_step_seconds']:.3f} | {a['search_seconds']:.2f} "
                f"({wall:.2f} wall) | {'met' if pad_ok else 'missed'} | "
                f"{'met' if fits else 'missed'} | {'met' if wall < 2 else 'missed'} |")
    missed = sorted({m for m, w, a, b, _ in rows
                     if not a or a["recommendation"]["padding_pct"] >= 1.0})
    lines += ["", f"Padding target missed for: {', '.join(missed) or 'none'}.", "",
              "* **llama3.1-405b** cannot pad under 1 % within 80 GiB at any W. Its down_proj "
              "[16384, 53248] has a 128-row granule of 6,815,744 elements (2^19·13) and its other "
              "matrices 2^21, so a shard that such a tensor contains whole must be a multiple of "
              "2^21·13 = 27,262,976 elements; a layer holds 116.9 of them. k layers over n "
              "devices pad ⌈116.9k/n⌉·n/(116.9k) − 1, under 1 % only when n ≤ 2k, and then a "
              "device holds at least 810 GB / n of parameters plus (prefetch + 2) unsharded units "
              "of k layers: far more than 80 GiB. The search returns the least padding that fits "
              "(9.4 %) and says the target is missed. Per-unit shard groups, or a granule that "
              "does not cut down_proj's 128-row bands, would be needed.",
              "* **deepseek-v3** meets it through `lead=4`: the three dense layers and the first "
              "MoE layer form one unit. Alone, each dense layer pads 1,349 % over 128 devices "
              "(the lcm of its granules, 66 M elements, exceeds its 4.6 M share per device); "
              "merged, the unit is large enough for that lcm. Without lead groupings the best "
              "fitting candidate padded 3.54 % (an earlier run of this report).", ""]


def amsp_section(build, lines):
    lines += ["## LLaMA-7B, 13B and 30B on 1024 GPUs (128 nodes × 8): ours and AMSP's", "",
              "Ours: `ragshardctl advise --model M --cluster profiles/h100-8x-nvlink-ib400.json "
              "--world 1024 --granule element --tokens-per-step 1024×T` for T tokens per device "
              "(AMSP shards flat parameters with no block granule, so neither do we here), over "
              "the whole AMSP space (p ≤ g ≤ os, each a within-node × across-node shape); "
              "`--executable` restricts it to p = g = os, what the data plane runs today. ZeRO-3 "
              "is `simulate --strategy k=1,shard=8x128`.", "",
              "| model | tokens/device | ours (AMSP space) | step s | exposed comm s | memory | "
              "ours (executable) | step s | ZeRO-3 step s | ZeRO-3 exposed s |",
              "|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    speedups, exposed_4096 = {}, []
    for model in ["llama-7b", "llama-13b", "llama-30b"]:
        for tokens in [512, 4096]:
            common = ["--model", model, "--cluster", H100, "--world", "1024", "--granule",
                      "element", "--tokens-per-step", str(1024 * tokens), "--json"]
            r, _ = ctl(build, "advise", *common, "--max-rejected", "0")
            a = json.loads(r.stdout)["recommendation"]
            r, _ = ctl(build, "advise", *common, "--max-rejected", "0", "--executable")
            e = json.loads(r.stdout)["recommendation"]
            r, _ = ctl(build, "simulate", *common, "--strategy", "k=1,shard=8x128")
            z = json.loads(r.stdout)
            zexp = z["predicted_step_seconds"] - sum(
                u["forward_seconds"] + u["backward_seconds"] for u in z["units"])
            lines.append(
                f"| {model} | {tokens} | `{a['strategy']['spec']}` | "
                f"{a['predicted_step_seconds']:.3f} | {a['exposed_comm_seconds']:.3f} | "
                f"{a['memory_bytes'] / GIB:.1f} GiB | `{e['strategy']['spec']}` | "
                f"{e['predicted_step_seconds']:.3f} | {z['predicted_step_seconds']:.3f} | "
                f"{zexp:.3f} |")
            if tokens == 512:
                speedups[model] = (z["predicted_step_seconds"] / a["predicted_step_seconds"],
                                   a["strategy"]["spec"])
            else:
                exposed_4096.append(zexp)
    sp = ", ".join(f"{m} {v[0]:.2f}×" for m, v in speedups.items())
    lines += ["", "**AMSP's side.** Through the workplace's search we found the AMSP paper's "
              "abstract (arXiv 2311.00257: independent Full-Replica, Full-Sharding or "
              "Partial-Sharding for parameters, gradients and optimizer states, each with its own "
              "device mesh, chosen by a cost model under a memory constraint; up to 52 % MFU for "
              "LLaMA models on 1024 GPUs; 1.4–12.7× the throughput of MiCS and ZeRO++) but not "
              "its table of the strategies chosen per model, nor its hardware and batch settings "
              "(searches for the table in the pages, docs and issues corpora returned only the "
              "abstract). We do not quote figures we could not read, so the comparison is with "
              "what the abstract states.", "",
              "Point by point:", "",
              f"* **Agree: separate factors beat uniform ZeRO-3 when communication is exposed.** "
              f"With 512 tokens per device the search picks P replicated (`p=1x1`) and G/OS "
              f"sharded, and predicts {sp} the step rate of ZeRO-3. AMSP reports 1.4× and more "
              f"over MiCS and ZeRO++ (other baselines, measured, where ours is predicted).",
              "* **Agree on the shape.** The winners keep the parameters replicated or inside a "
              "node and shard the optimizer states widest (p ≤ g ≤ os, AMSP's dependency rule), "
              "which is AMSP's Partial-Sharding / Full-Replica split.",
              f"* **Differ: at 4096 tokens per device the choice barely matters on H100.** Our "
              f"model hides ZeRO-3's traffic behind compute (exposed "
              f"{min(exposed_4096):.3f}–{max(exposed_4096):.3f} s), so the search falls back "
              "to the fewest bytes and the least memory. AMSP's gains come from a "
              "communication-bound regime; whether theirs was one we cannot tell without its "
              "settings.",
              "* **Differ: gradients travel in fp32** (the data plane reduces in fp32), twice "
              "the volume of a bf16 reduce-scatter and all-reduce, so gradient traffic weighs "
              "twice what it would in a bf16 model.",
              "* **Differ: we add unit grouping, prefetch depth, and padding from the real "
              "planner** (zero here with element granules; decisive with rows:128, see the zoo "
              "table). AMSP has no block granule.",
              "* **Differ: what runs.** AMSP executes separate factors; ragshard's data plane runs "
              "p = g = os (the `executable` column), so the separate-factor recommendation is "
              "recorded in the plan and not executed yet.", ""]


def calibration_section(build, lines):
    # A real plan: a transformer layer of width 512 (fp32), planned for 4 ranks on 2 daemons.
    d = 512
    units = []
    for l in range(2):
        p = f"layers.{l}."
        units.append({"name": f"layers.{l}", "tensors": [
            {"name": p + n, "shape": s, "dtype": "fp32", "granule": "rows:8"}
            for n, s in [("q", [d, d]), ("k", [d, d]), ("v", [d, d]), ("o", [d, d]),
                         ("w1", [4 * d, d]), ("w2", [d, 4 * d]), ("ln1", [d]), ("ln2", [d])]]})
    tmp = tempfile.mkdtemp(prefix="ragshard-strategy-")
    inv = os.path.join(tmp, "layer.json")
    json.dump({"units": units}, open(inv, "w"))
    r, _ = ctl(build, "plan", "--inventory", inv, "--world", "4", "--json")
    plan = json.loads(r.stdout)
    s = int(plan["units"][0]["shardElems"] if "shardElems" in plan["units"][0]
            else plan["units"][0]["shard_elems"])
    full = 4 * s * 4
    r, _ = ctl(build, "simulate", "--inventory", inv, "--cluster", HOST, "--strategy",
               "k=1,shard=2x2", "--json")
    sim = json.loads(r.stdout)
    u = next(x for x in sim["units"] if x["name"] == "layers.0")
    measured = {"allgather": [], "reducescatter": []}
    errors = []
    for _ in range(REPEATS):
        bench = subprocess.run([os.path.join(build, "bench", "daemon_bench"), "--bytes",
                                str(full)], capture_output=True, text=True, timeout=600)
        if bench.returncode != 0:
            errors.append(bench.stderr.strip()[:100])
        for line in bench.stdout.splitlines():
            f = line.split(",")
            if len(f) == 7 and f[0] == "ragshard-daemons-2x2":
                measured[f[1]].append(float(f[4]))
    lines += ["## Calibration on this machine", "",
              f"A real plan: two transformer layers of width {d} in fp32 (granule rows:8), "
              f"planned by `ragshardctl plan` for 4 ranks: S = {s} elements, so one unit's "
              f"all-gather moves a {full} B buffer. Predicted: `ragshardctl simulate --inventory "
              "... --cluster profiles/host-2x2-loopback.json --strategy k=1,shard=2x2` (2 daemons "
              "× 2 ranks). Measured: `bench/daemon_bench --bytes " + str(full) + "` (a planner, 2 "
              "ragshardd and 4 rank processes; each rank calls unshard / reduce_scatter through "
              "the client library; the slowest rank's mean), " + str(REPEATS) + " runs, each with "
              "fresh daemons, as bench/host_profile.py measured the profile's points.", "",
              "| operation | predicted s | measured s, median (min – max) | median ÷ predicted | "
              "within 25 % |", "|---|---:|---:|---:|:-:|"]
    for op, key in [("all-gather", "allgather"), ("reduce-scatter", "reducescatter")]:
        pred = u["all_gather_seconds"] if key == "allgather" else u["reduce_scatter_seconds"]
        meas = sorted(measured[key])
        if not meas:
            lines.append(f"| {op} | {pred:.5f} | failed: {'; '.join(errors)} | | missed |")
            continue
        med = meas[len(meas) // 2]
        ratio = med / pred
        lines.append(f"| {op} | {pred:.5f} | {med:.5f} ({meas[0]:.5f} – {meas[-1]:.5f}) | "
                     f"{ratio:.2f} | {'met' if abs(ratio - 1) <= 0.25 else 'missed'} |")
    lines.append("")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(WORLDS), figsize=(15, 4.5), sharey=True)
    for ax, w in zip(axes, WORLDS):
        names, adv, base = [], [], []
        for model, ww, a, b, _ in rows:
            if ww != w:
                continue
            names.append(model)
            adv.append(a["recommendation"]["padding_pct"] if a else float("nan"))
            base.append(b.get("padding_pct", float("nan")))
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], base, 0.4, label="every unit over all W")
        ax.bar([i + 0.2 for i in x], adv, 0.4, label="advised")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"W = {w}")
    axes[0].set_ylabel("padding % (rows:128)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "strategy.md"))
    a = p.parse_args()
    build = os.path.abspath(a.build)
    lines = ["# Sharding strategy search", "",
             f"Run on {datetime.date.today()} by `bench/strategy_report.py` on this repository's "
             "2-core development machine. The search and the simulator are offline "
             "(`ragshardctl advise`, `ragshardctl simulate`); the H100 figures are predictions "
             "from `profiles/h100-8x-nvlink-ib400.json` (published nccl-tests figures, each "
             "sourced in the file), not measurements: no GPU was available. The calibration "
             "section is measured on this machine. The cost model is described in "
             "docs/strategy.md.", ""]
    rows = []
    zoo_section(build, lines, rows)
    plot(rows, os.path.join(os.path.dirname(a.out), "strategy_padding.png"))
    lines += ["![padding](strategy_padding.png)", ""]
    sim = simulate(build, "deepseek-v3", 1024,
                   next((r[2]["recommendation"]["strategy"]["spec"] for r in rows
                         if r[0] == "deepseek-v3" and r[1] == 1024 and r[2]), "k=1,shard=8x128"),
                   png=os.path.join(os.path.dirname(a.out), "strategy_timeline.png"))
    lines += ["The step of DeepSeek-V3's advised strategy at W = 1024 (`ragshardctl simulate "
              "... --png`; top: compute, forward green, backward blue; bottom: communication, "
              "all-gather yellow, reduce-scatter red, replica all-reduce brown, update gathers "
              "pink):", "", "![timeline](strategy_timeline.png)", ""] if "error" not in sim else []
    amsp_section(build, lines)
    calibration_section(build, lines)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    sys.exit(main())
