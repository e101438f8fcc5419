"""Side-by-side sections of docs/benchmarks/collectives.md (bench/collectives_report.py): two
variants measured alternately in one run, judged by the within-noise rule, with a plot; and the
message checks' cost, which is one such section.
"""
import os
import statistics


def noise_section(samples, names, heading, intro, outdir, png, title):
    """Markdown and a plot comparing two variants measured alternately in this run: per
    (op, members, size), the median bus bandwidth of each variant's REPS runs, their spreads,
    and whether the first (`names[0]`) lost against the second by less than the larger of 5 %
    and the spread (max - min, relative to the second's median; the larger of the two
    variants'). `samples` maps (variant, op, members, size) to bus bandwidths."""
    new, old = names
    md = [f"\n## {heading}\n", intro,
          f"| op | processes | size | {new} | {old} | change | noise bound | within noise |",
          "|---|---:|---:|---:|---:|---:|---:|---|"]
    keys = sorted({(op, n, size) for (_, op, n, size) in samples})
    outcome = []
    for op, n, size in keys:
        on = samples.get((new, op, n, size), [])
        off = samples.get((old, op, n, size), [])
        if not on or not off:
            continue
        mon, moff = statistics.median(on), statistics.median(off)
        change = (mon - moff) / moff
        spread = max(max(on) - min(on), max(off) - min(off)) / moff
        bound = max(0.05, spread)
        ok = change > -bound  # a gain is never a loss
        outcome.append((op, n, size, mon, moff, ok))
        md.append(f"| {op} | {n} | {size >> 20} MiB | {mon:.3f} ({min(on):.3f}–{max(on):.3f}) | "
                  f"{moff:.3f} ({min(off):.3f}–{max(off):.3f}) | {change * 100:+.1f} % | "
                  f"±{bound * 100:.1f} % | {'yes' if ok else '**no**'} |")
    losses = [o for o in outcome if not o[5]]
    md.append("")
    md.append(f"{len(outcome) - len(losses)} of {len(outcome)} rows within noise."
              + ("" if not losses else " Rows with a loss beyond noise: " + ", ".join(
                  f"{op} {n}p {size >> 20} MiB" for op, n, size, *_ in losses) + "."))
    if outcome:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [f"{op[:2]} {n}p {size >> 20}M" for op, n, size, *_ in outcome]
        x = range(len(outcome))
        ax.bar([i - 0.2 for i in x], [o[4] for o in outcome], 0.4, label=old)
        ax.bar([i + 0.2 for i in x], [o[3] for o in outcome], 0.4, label=new)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("bus bandwidth GB/s (median)")
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, png), dpi=100)
        md.append(f"\n![{new} and {old} medians]({png})\n")
    return md


def check_section(checks, outdir, reps):
    """The message checks' cost: `reps` checked and `reps` unchecked runs, alternated."""
    return noise_section(
        checks, ("ragshard-ucx", "ragshard-ucx-unchecked"),
        "The message checks' cost (side by side, this run)",
        f"`bench/collectives_bench` over UCX with the message checks (the default, "
        f"ragshard-ucx) and with them off (`--unchecked 1`: receives match the whole tag, "
        f"nothing is compared), {reps} runs of each, alternated. Bus bandwidth GB/s: median "
        "(min–max). *Within noise* means the median moved by less than the larger of 5 % and "
        "the spread (max − min) of either variant, relative to the unchecked median.\n",
        outdir, "collectives_checks.png", "UCX collectives with and without the message checks")
