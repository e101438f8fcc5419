"""Timelines of training steps from the traces fully_shard writes with RAGSHARD_TRACE=DIR
(python/ragshard/torch/fsdp/hooks.py): a rank's compute per unit and the daemon's run of each
operation the rank waited for, on one clock (CLOCK_MONOTONIC, shared by the processes of a
node). bench/training_report.py plots them and measures how much of each kind of operation ran
while the rank computed."""
import json

KINDS = ("unshard", "reduce_scatter", "all_reduce")


def load(path):
    with open(path) as f:
        return json.load(f)


def step_window(trace, step=-2):
    """(start, end) ns of one whole step: from the forward mark of `step` (by default the last
    step but one, whose backward and optimizer finished before the next mark) to the next."""
    marks = [e["t"] for e in trace["events"] if e["event"] == "step"]
    if len(marks) < 2:
        raise ValueError(f"the trace has {len(marks)} step marks; a window needs 2")
    i = step % len(marks)
    if i + 1 >= len(marks):
        i = len(marks) - 2
    return marks[i], marks[i + 1]


def in_window(trace, window):
    """The events of the window: compute intervals and operations that the daemon ran in it
    (those without times, over gRPC, are left out)."""
    lo, hi = window
    compute = [e for e in trace["events"] if e["event"] in ("forward", "backward")
               and lo <= e["start"] < hi]
    ops = [e for e in trace["events"] if e["event"] == "op" and e["started"] > 0
           and lo <= e["started"] < hi]
    return compute, ops


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(compute, ops, kind, phase=None):
    """(seconds the daemon ran operations of `kind`, the fraction of it during the rank's
    compute; of `phase` only, where given)."""
    busy = _union([(c["start"], c["end"]) for c in compute if phase in (None, c["event"])])
    total = hidden = 0
    for o in ops:
        if o["kind"] != kind:
            continue
        s, f = o["started"], o["finished"]
        total += f - s
        for bs, be in busy:
            hidden += max(0, min(f, be) - max(s, bs))
    return total / 1e9, (hidden / total if total else 0.0)


def plot(ax, trace, window, title):
    """Compute (forward, backward) on one row and each kind of operation on its own row."""
    lo, _ = window
    compute, ops = in_window(trace, window)
    rows = ["compute"] + list(KINDS) + ["other"]
    colors = {"forward": "tab:blue", "backward": "tab:orange"}
    for c in compute:
        ax.broken_barh([((c["start"] - lo) / 1e6, (c["end"] - c["start"]) / 1e6)], (0, 0.8),
                       color=colors[c["event"]])
    for o in ops:
        row = rows.index(o["kind"]) if o["kind"] in KINDS else len(rows) - 1
        width = max((o["finished"] - o["started"]) / 1e6, 0.05)
        ax.broken_barh([((o["started"] - lo) / 1e6, width)], (row, 0.8),
                       color="tab:green" if o["kind"] in KINDS else "tab:gray")
    ax.set_yticks([r + 0.4 for r in range(len(rows))])
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's forward began")
    ax.set_title(title, fontsize=9)
