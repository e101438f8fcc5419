"""The node-loss section of docs/benchmarks/recovery.md (bench/recovery_node.py's runs, in
runs.json under "node"): the memory the redundancy keeps, the step time it costs, the seconds a
lost node costs rebuilt against checkpoint-and-restart, and their plot recovery_node.png."""
import os
import statistics

from recovery_node import REPLICAS, DAEMONS, PER_NODE, SCHEMES

PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:red",
                "between": "tab:green"}
NOISE_FLOOR = 0.05
TARGET = {"parity:2": 0.5, "replica": 1.0}  # the issue's: of the protected state


def med(xs):
    return statistics.median(xs) if xs else None


def _ok(runs):
    return [r for r in runs if "error" not in r]


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def span(xs, fmt="{:.2f}"):
    return f"{fmt.format(min(xs))}–{fmt.format(max(xs))}" if xs else "—"


def summarize(node):
    s = {"mem": {}, "step": {}, "lost": {}}
    runs = {k: _ok(node["uninterrupted"].get(k, [])) for k in SCHEMES}
    for k, rs in runs.items():
        if rs:
            m = rs[-1]["memory"]
            s["mem"][k] = {f: sum(n[f] for n in m.values())
                           for f in ("protected", "parity", "pool_between", "pool_end")}
            s["mem"][k]["nodes"] = m
        s["step"][k] = [med(r["slowest_steps"]) for r in rs]
    base = s["mem"].get("none", {}).get("pool_between")
    for k in ("parity:2", "replica"):
        m = s["mem"].get(k)
        if not m or not m["protected"]:
            continue
        m["of_protected"] = m["parity"] / m["protected"]
        m["persistent"] = m["pool_between"] - m["parity"]  # protected + the journal's copies
        m["of_persistent"] = m["parity"] / m["persistent"] if m["persistent"] else None
        if base:
            m["pool_growth"] = m["pool_between"] - base
        m["within_5pct"] = abs(m["of_protected"] - TARGET[k]) <= 0.05 * TARGET[k]
    none = s["step"].get("none") or []
    for k in ("parity:2", "replica"):
        xs = s["step"].get(k) or []
        if xs and none:
            m1, m0 = med(xs), med(none)
            spread = max(max(x) - min(x) for x in (xs, none))
            s["step"][k + " ratio"] = {"ratio": m1 / m0, "moved": m1 - m0, "spread": spread,
                                       "noise": max(NOISE_FLOOR * m0, spread),
                                       "within_noise": abs(m1 - m0) < max(NOISE_FLOOR * m0,
                                                                          spread)}
    walls = {k: med([r["wall"] for r in rs]) for k, rs in runs.items() if rs}
    s["walls"] = walls
    for k in ("parity:2", "replica"):
        rb = _ok(node["rebuilt"].get(k, []))
        for r in rb:
            r["lost"] = r["wall"] - walls[k] if k in walls else None
            if r.get("resumed_step_line_at") is not None and r.get("first_step_seconds"):
                r["back_in"] = r["resumed_step_line_at"] - r["first_step_seconds"] - r["killed_at"]
        s["lost"][k] = rb
    saved = _ok(node["saved"])
    s["base_saved"] = med([u["wall"] for u in saved])
    ck = _ok(node["checkpointed"])
    for c in ck:
        c["lost"] = sum(c["walls"]) - s["base_saved"] if s["base_saved"] is not None else None
    s["lost"]["checkpoint"] = ck
    # A shrink: against the same --replicate 3 job uninterrupted (whose steps after the kill ran
    # at 6 ranks, not 4: "back in training" is the cleaner figure).
    s["base_hsdp"] = med([u["wall"] for u in _ok(node.get("hsdp", []))])
    sh = _ok(node.get("shrunk", []))
    for r in sh:
        r["lost"] = r["wall"] - s["base_hsdp"] if s["base_hsdp"] is not None else None
        if r.get("resumed_step_line_at") is not None and r.get("first_step_seconds"):
            r["back_in"] = r["resumed_step_line_at"] - r["first_step_seconds"] - r["killed_at"]
    s["lost"]["shrink"] = sh
    # A re-cut: against the replica job uninterrupted (the same layout and redundancy; its
    # steps after the kill ran at 6 ranks, not 4).
    rc = _ok(node.get("recut", []))
    for r in rc:
        base = s["walls"].get("replica")
        r["lost"] = r["wall"] - base if base is not None else None
        if r.get("resumed_step_line_at") is not None and r.get("first_step_seconds"):
            r["back_in"] = r["resumed_step_line_at"] - r["first_step_seconds"] - r["killed_at"]
    s["lost"]["recut"] = rc
    s["lost_median"] = {k: med([r["lost"] for r in v if r.get("lost") is not None])
                        for k, v in s["lost"].items()}
    return s


def plot(doc, s, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (mx, sx, lx) = plt.subplots(1, 3, figsize=(14, 4.4))
    schemes = [k for k in ("parity:2", "replica") if k in s["mem"]]
    for i, k in enumerate(schemes):
        m = s["mem"][k]
        mx.bar(i - 0.2, m["protected"] / 2**20, 0.4, color="tab:blue",
               label="protected state (params + optimizer)" if i == 0 else None)
        mx.bar(i - 0.2, (m["persistent"] - m["protected"]) / 2**20, 0.4,
               bottom=m["protected"] / 2**20, color="tab:gray",
               label="journal, undo copies and the rest" if i == 0 else None)
        mx.bar(i + 0.2, m["parity"] / 2**20, 0.4, color="tab:red",
               label="parity / copies (2 steps)" if i == 0 else None)
        mx.text(i + 0.2, m["parity"] / 2**20, f"{m['of_protected']:.2f}× prot.\n"
                f"{m['of_persistent']:.2f}× pers.", ha="center", va="bottom", fontsize=7)
    mx.set_ylim(0, max([s["mem"][k]["pool_between"] for k in schemes] + [1]) / 2**20 * 1.45)
    mx.set_xticks(range(len(schemes)), schemes)
    mx.set_ylabel("MiB, summed over the 3 daemons")
    mx.set_title("pool bytes: state vs its redundancy", fontsize=10)
    mx.legend(fontsize=7, loc="upper left")
    mx.grid(axis="y", alpha=0.3)
    for x, k in enumerate(SCHEMES):
        xs = s["step"].get(k) or []
        sx.scatter([x] * len(xs), [v * 1e3 for v in xs], color="tab:blue", s=20, zorder=3)
        if xs:
            sx.hlines(med(xs) * 1e3, x - 0.3, x + 0.3, color="black")
    sx.set_xticks(range(3), [f"--redundancy {k}" for k in SCHEMES], fontsize=8)
    sx.set_ylim(0, max([v for k in SCHEMES for v in s["step"].get(k) or []] + [0.001])
                * 1e3 * 1.15)
    sx.set_ylabel("median step (ms), slowest rank")
    sx.set_title("step time, --max-restarts 1, alternated runs", fontsize=10)
    sx.grid(axis="y", alpha=0.3)
    kinds = [("parity:2", "rebuilt\nparity:2"), ("replica", "rebuilt\nreplica"),
             ("checkpoint", f"checkpoint\nevery {doc['save_every']} steps,\nrestart all"),
             ("shrink", "shrunk, HSDP\n6 → 4 ranks"),
             ("recut", "re-cut, replica\n6 → 4 ranks")]
    for x, (k, _) in enumerate(kinds):
        rs = [r for r in s["lost"].get(k, []) if r.get("lost") is not None]
        for i, r in enumerate(rs):
            lx.scatter(x + 0.25 * ((i * 0.37) % 1 - 0.5), r["lost"],
                       color=PHASE_COLORS[r["phase"]], s=28, zorder=3)
        if rs:
            lx.hlines(med([r["lost"] for r in rs]), x - 0.3, x + 0.3, color="black")
    for phase, color in PHASE_COLORS.items():
        lx.scatter([], [], color=color, s=28, label=f"lost in {phase}")
    lx.legend(fontsize=7, loc="upper left")
    lx.set_xticks(range(len(kinds)), [t for _, t in kinds], fontsize=7)
    lx.set_xlim(-0.6, len(kinds) - 0.4)
    top = max([r["lost"] for v in s["lost"].values() for r in v if r.get("lost") is not None]
              + [1.0])
    lx.set_ylim(min(0, min([r["lost"] for v in s["lost"].values() for r in v
                            if r.get("lost") is not None] + [0])), top * 1.2)
    lx.set_ylabel("seconds lost per node failure\n(wall time − uninterrupted median)")
    lx.set_title("a node (daemon + 2 ranks) killed", fontsize=10)
    lx.grid(axis="y", alpha=0.3)
    fig.suptitle(f"examples/train_tiny.py {' '.join(doc['model'])}, {doc['steps']} steps; "
                 f"{DAEMONS} daemons × {PER_NODE} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def lines(doc, out):
    """The section's Markdown lines (and its plot beside `out`)."""
    node = doc["node"]
    s = summarize(node)
    png = os.path.join(os.path.dirname(os.path.abspath(out)), "recovery_node.png")
    plot(doc, s, png)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    L = ["## A lost node: redundancy (issue 55)\n",
         f"`examples/train_tiny.py {' '.join(doc['model'])} --steps {doc['steps']}` at W = "
         f"{DAEMONS * PER_NODE} ranks over {DAEMONS} daemons × {PER_NODE} ranks, each launch on "
         f"a fresh `LocalCluster` of {DAEMONS} daemons (node timeout 2 s), `--max-restarts 1` "
         f"throughout (the checkpointing runs excepted). {node['reps']} alternated rounds of "
         "uninterrupted runs with `--redundancy none`, `parity:2` and `replica`, then "
         f"{node['trials']} rounds of: a node lost under parity:2, under replica, an "
         "uninterrupted run that saves checkpoints, the same loss under checkpoints, and (with "
         f"`--replicate {REPLICAS}`) an uninterrupted run and the same loss with no replacement "
         "under `--on-node-loss shrink`.\n",
         "![memory, step time and seconds lost per node failure](recovery_node.png)\n",
         "### Memory\n",
         "From each daemon's stats at the end of the uninterrupted runs (`client.stats()`: "
         "`protected_bytes`, the bytes of its local ranks' state the last protection covered, "
         "i.e. parameter shards and optimizer state buffers; `parity_bytes`, the pool bytes its "
         "parities or copies hold; `pool_used` between the last two steps), summed over the "
         f"{DAEMONS} daemons. Two ratios: **against the protected state** (parity ÷ protected), "
         "and **against the pool's persistent state of a recoverable job** (parity ÷ the pool in "
         "use between steps less the parity: the protected state, the step journal's undo "
         "copies, and whatever else the daemon keeps allocated for the job between steps). "
         "Between steps a daemon holds one step's parity (a second only inside a protect, "
         "until its barrier: docs/recovery.md, \"One parity held\").\n",
         "| redundancy | protected | parity / copies | ÷ protected | target | within 5 % | "
         "persistent state | ÷ persistent | pool growth over none |",
         "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for k in ("parity:2", "replica"):
        m = s["mem"].get(k)
        if not m or "of_protected" not in m:
            continue
        L.append(f"| {k} | {mib(m['protected'])} | {mib(m['parity'])} | "
                 f"{m['of_protected']:.3f}× | {TARGET[k]:g}× | "
                 f"{'yes' if m['within_5pct'] else 'no'} | {mib(m['persistent'])} | "
                 f"{_f(m['of_persistent'], '{:.3f}')}× | "
                 f"{mib(m['pool_growth']) if 'pool_growth' in m else '—'} |")
    if "none" in s["mem"]:
        n = s["mem"]["none"]
        L.append(f"\nWithout redundancy (`--redundancy none`, `--max-restarts 1`) the pool holds "
                 f"{mib(n['pool_between'])} between steps (the persistent state of a recoverable "
                 "job); \"pool growth over none\" is each redundancy's pool between steps less "
                 "that, which the parities should account for.")
    m = s["mem"].get("parity:2")
    if m and m.get("protected"):
        per = m["nodes"]
        L[-1] += (f" The persistent state is {m['persistent'] / m['protected']:.2f}× the "
                  "protected state. Per node, protected / parity: " + "; ".join(
                      f"{n} {mib(v['protected'])} / {mib(v['parity'])}"
                      for n, v in sorted(per.items())) + " (parity:2). The nodes' ranks hold state "
                  "of different sizes (the ragged plan); the chunks of a stripe have one length "
                  "(redundancy.h, StripeBytes), so the parities still add up to 1/K of the "
                  "group's state, but they sit unevenly on the nodes.")
    L.append("")
    L += ["### Step time\n",
          "Each run's figure: its median step (slowest rank), the first two steps left out; "
          "the schemes alternated within each round.\n",
          "| `--redundancy` | median of the runs' medians (s) | min–max (s) | runs | × none |",
          "|---|---:|---:|---:|---:|"]
    for k in SCHEMES:
        xs = s["step"].get(k) or []
        r = s["step"].get(k + " ratio")
        L.append(f"| {k} | {_f(med(xs), '{:.4f}')} | {span(xs, '{:.4f}')} | {len(xs)} | "
                 f"{'1' if k == 'none' else _f(r and r['ratio'], '{:.3f}')} |")
    for k in ("parity:2", "replica"):
        r = s["step"].get(k + " ratio")
        if r:
            L.append(f"\n**{k}: {r['ratio']:.3f}× the step without redundancy "
                     f"({r['moved'] * 1e3:+.1f} ms); "
                     f"{'within noise' if r['within_noise'] else 'not within noise'}** (noise: "
                     f"the larger of 5 % and the runs' spread, {r['noise'] * 1e3:.1f} ms).")
    L.append("")
    L += ["### Seconds lost per node failure\n",
          "A node lost: both its ranks held at a step and phase (`train_tiny.py --hold-at`), "
          "then its daemon killed (kill -9), the two ranks killed (SIGKILL) and a replacement "
          "daemon started with the node's id. **Rebuilt**: `--max-restarts 1 --redundancy R`; "
          "the launcher restarts the ranks, they wait for the replacement daemon, which "
          "rebuilds their state from the other nodes (`rebuilds: 1` in `ragshardctl job "
          "show`); seconds lost: the wall time less the median of the uninterrupted runs with "
          f"the same redundancy ({', '.join(f'{k} {_f(v)} s' for k, v in s['walls'].items())}). "
          f"**Checkpoint and restart**: a job that saves every {doc['save_every']} steps and "
          "has no restarts fails; with the replacement daemon up, a second launch (a job of its "
          "own) resumes all ranks from the newest checkpoint; seconds lost: both walls less the "
          f"median of uninterrupted runs that save ({_f(s['base_saved'])} s). **Shrunk**: the "
          f"same loss with no replacement, in a job of {REPLICAS} HSDP replica groups "
          f"(`--replicate {REPLICAS}`, one per daemon, the same global batch) under "
          "`--on-node-loss shrink` with a recovery deadline of "
          f"{_f(node.get('shrink_deadline'), '{:g}')} s (the wait for a replacement): at the "
          "deadline the job shrinks to the other 2 daemons' 4 ranks, which take their state over "
          "and go on (docs/recovery.md, \"Shrinking in place\"); seconds lost: the wall time less "
          f"the median of that job uninterrupted ({_f(s.get('base_hsdp'))} s), whose steps after "
          "the kill ran at 6 ranks rather than 4; \"back in training\" (the kill to the first "
          "step after it, less that step) holds no such difference. **Re-cut**: the same loss "
          "with no replacement, in a job of one shard group of 6 ranks with `--redundancy "
          "replica` (the same global batch) under `--on-node-loss shrink` and the same deadline: "
          "the other 2 daemons' 4 ranks re-cut every unit's shards for 4 ranks over their data "
          "plane, the lost node's share from its copy on the next node (docs/recovery.md); "
          "seconds lost: the wall time less the median of the replica runs uninterrupted "
          f"({_f(s['walls'].get('replica'))} s), whose steps after the kill ran at 6 ranks.\n",
          "| | seconds lost, median | min–max | trials |", "|---|---:|---:|---:|"]
    names = {"parity:2": "rebuilt from parity:2", "replica": "rebuilt from replica",
             "checkpoint": f"checkpoint every {doc['save_every']} steps, restart all, load",
             "shrink": "shrunk in place, no replacement (6 → 4 ranks)",
             "recut": "re-cut in place from replica, no replacement (6 → 4 ranks)"}
    for k, name in names.items():
        xs = [r["lost"] for r in s["lost"].get(k, []) if r.get("lost") is not None]
        L.append(f"| {name} | {_f(med(xs))} | {span(xs)} | {len(xs)} |")
    L += ["", "| trial | how | node | step | phase | resumed at step | back in training (s) "
          "| wall (s) | seconds lost | bytes rebuilt | max abs Δ | others (cores) |",
          "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in ("parity:2", "replica"):
        for i, r in enumerate(s["lost"].get(k, [])):
            L.append(f"| {i + 1} | rebuilt {k} | {r['node']} | {r['step']} | {r['phase']} | "
                     f"{r['first_step']} | {_f(r.get('back_in'))} | {r['wall']:.2f} | "
                     f"{_f(r.get('lost'))} | {r['rebuilt_bytes']:,} | "
                     f"{_f(r.get('max_abs_diff'), '{:.1e}')} | {_f(r.get('others_cores'))} |")
    for i, (k, r) in enumerate([("shrunk", r) for r in s["lost"].get("shrink", [])] +
                               [("re-cut", r) for r in s["lost"].get("recut", [])]):
        ws = r.get("world_sizes") or []
        L.append(f"| {i + 1} | {k} {ws[0] if ws else '?'} → {ws[-1] if ws else '?'} ranks | "
                 f"{r['node']} | {r['step']} | {r['phase']} | {r['first_step']} | "
                 f"{_f(r.get('back_in'))} | {r['wall']:.2f} | {_f(r.get('lost'))} | "
                 f"{_f(r.get('shrunk_bytes'), '{:,}')} (taken over, rank 0) | — | "
                 f"{_f(r.get('others_cores'))} |")
    for i, c in enumerate(s["lost"].get("checkpoint", [])):
        L.append(f"| {i + 1} | checkpoint (from step {c['resumed_from'] or '— none'}) | "
                 f"{c['node']} | {c['step']} | {c['phase']} | {c['resumed_from'] + 1} | — | "
                 f"{sum(c['walls']):.2f} | {_f(c.get('lost'))} | — | "
                 f"{_f(c.get('max_abs_diff'), '{:.1e}')} | {_f(c.get('others_cores'))} |")
    L.append("\nΔ: the largest |difference| of any final parameter against an uninterrupted "
             "run's with the same redundancy (rebuilt) or that saves (checkpoint).\n")
    bad = [(f"uninterrupted {k}", r["error"]) for k, v in node["uninterrupted"].items()
           for r in v if "error" in r]
    bad += [(f"rebuilt {k}", r["error"]) for k, v in node["rebuilt"].items() for r in v
            if "error" in r]
    bad += [(k, r["error"]) for k in ("saved", "checkpointed", "hsdp", "shrunk", "recut")
            for r in node.get(k, []) if "error" in r]
    if bad:
        L.append("Failed node-loss runs:\n")
        L += [f"- {k}: `{' '.join(e.split())[:600]}`" for k, e in bad]
        L.append("")
    return L, s
