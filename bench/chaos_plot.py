"""The reliability report's plot (bench/chaos_render.py builds its data): a box and strip chart
per fault with matplotlib, or an SVG drawn by hand where matplotlib is missing."""
import os
import statistics


def write_svg(path, data):
    """A box/strip chart per fault, by hand (no matplotlib)."""
    W, H, top, bottom, left = 220 * max(1, len(data)), 360, 40, 60, 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for i, (fault, xs, limit, fails, bad) in enumerate(data):
        x0 = i * 220 + left
        w = 220 - left - 20
        ymax = max(xs + ([limit] if limit else []) + [1]) * 1.15
        y = lambda v: top + (H - top - bottom) * (1 - v / ymax)  # noqa: E731
        out.append(f'<text x="{x0 + w / 2}" y="20" text-anchor="middle" font-weight="bold">'
                   f'{fault}</text>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{H - bottom}" stroke="black"/>')
        for k in range(6):
            v = ymax * k / 5
            out.append(f'<text x="{x0 - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
            out.append(f'<line x1="{x0}" y1="{y(v):.1f}" x2="{x0 + w}" y2="{y(v):.1f}" '
                       f'stroke="#ddd"/>')
        if xs:
            q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
            bx = x0 + w * 0.3
            out.append(f'<rect x="{bx}" y="{y(q[2]):.1f}" width="{w * 0.4}" '
                       f'height="{max(1, y(q[0]) - y(q[2])):.1f}" fill="#cde" stroke="#248"/>')
            out.append(f'<line x1="{bx}" y1="{y(q[1]):.1f}" x2="{bx + w * 0.4}" '
                       f'y2="{y(q[1]):.1f}" stroke="#248" stroke-width="2"/>')
            for j, v in enumerate(xs):
                jx = x0 + w * (0.35 + 0.3 * ((j * 37) % 100) / 100)
                out.append(f'<circle cx="{jx:.1f}" cy="{y(v):.1f}" '
                           f'r="{4 if bad[j] else 2.5}" fill="{"red" if bad[j] else "#135"}" '
                           f'fill-opacity="0.6"/>')
        if limit:
            out.append(f'<line x1="{x0}" y1="{y(limit):.1f}" x2="{x0 + w}" y2="{y(limit):.1f}" '
                       f'stroke="red" stroke-dasharray="5,3"/>')
            out.append(f'<text x="{x0 + w}" y="{y(limit) - 3:.1f}" text-anchor="end" '
                       f'fill="red">limit {limit:g} s</text>')
        label = "s to exit" if limit else "wall s"
        out.append(f'<text x="{x0 + w / 2}" y="{H - bottom + 18}" text-anchor="middle">'
                   f'{label} (n={len(xs)})</text>')
        if fails:
            out.append(f'<text x="{x0 + w / 2}" y="{H - bottom + 34}" text-anchor="middle" '
                       f'fill="red">{fails} failed trial(s)</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def draw(docs, data, recovery_faults, node_rebuild):
    """data: (fault, seconds, limit, failed trials, which points broke the expectation) per
    fault. Writes reliability.png (or .svg) in docs; returns its path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = os.path.join(docs, "reliability.svg")
        write_svg(path, data)
        return path
    import random
    rng = random.Random(0)
    fig, axes = plt.subplots(1, len(data), figsize=(3.2 * len(data), 4.2), squeeze=False)
    for ax, (fault, xs, limit, fails, bad) in zip(axes[0], data):
        if xs:
            ax.boxplot([xs], widths=0.5, showfliers=False)
            jit = [1 + rng.uniform(-0.15, 0.15) for _ in xs]
            good = [(j, v) for j, v, b in zip(jit, xs, bad) if not b]
            worse = [(j, v) for j, v, b in zip(jit, xs, bad) if b]
            if good:
                ax.scatter(*zip(*good), s=12, c="#135", alpha=0.6, zorder=3)
            if worse:
                ax.scatter(*zip(*worse), s=40, c="red", marker="x", zorder=4,
                           label="broke the expectation")
                ax.legend(fontsize=7, loc="upper left")
        if limit:
            ax.axhline(limit, color="red", ls="--", lw=1)
            ax.text(1.45, limit, f"limit {limit:g} s", color="red", ha="right", va="bottom",
                    fontsize=8)
        top = max(xs + ([limit] if limit else []) + [1]) * 1.15
        ax.set_ylim(0, top)
        ax.set_xticks([1])
        ax.set_xticklabels([f"n={len(xs)}" + (f"\n{fails} failed trial(s)" if fails else "")],
                           color="red" if fails else "black")
        ax.set_title(fault, fontsize=10)
        ax.set_ylabel("seconds from the kill to the training's exit"
                      if fault in recovery_faults else
                      "seconds from the fault to each rank's exit" if limit else
                      "training wall time, s (limit: completes\nwith the reference losses)",
                      fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("ragshard under faults: each trial on fresh hosts, a planner + 2 daemons, 4 "
                 "ranks" + (" (node-rebuild: 3 daemons, 6 ranks)" if node_rebuild else ""),
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(docs, "reliability.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
