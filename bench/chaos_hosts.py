"""Host faults as clusters see them, on hosts of their own (ragshard.cluster.NamespacedCluster:
a network namespace and a private /tmp per host; issue 72, items 4 and 5; docs/recovery.md):

  loss       a host's link goes down (its packets and those to it vanish: nothing is reset),
             then everything on it is killed; a replacement daemon with its node id starts on
             a spare host with a launcher for its node rank (tests/python/test_hosts.py)
  partition  a host's link goes down while everything on it lives: its daemon fences itself,
             its ranks exit named; then the replacement as above (tests/python/test_partition.py)

and either rebuilt on the replacement, or, in a shrink trial, with no replacement: the job
(--redundancy replica --on-node-loss shrink, recovery deadline SHRINK_DEADLINE_S) shrinks to the
other two hosts' ranks at the recovery deadline (tests/python/test_host_shrink.py).

Each trial has a fresh cluster: a planner host, 3 daemon hosts and a spare; train_tiny at
3 hosts x 2 ranks (one `ragshard-launch --nnodes 3 --node-rank K` per host), --max-restarts 1,
node timeout NODE_TIMEOUT_MS. Losses take parity:2, replica and shrink in turn; partitions
rebuild in odd trials (parity:2 and replica in turn) and shrink in even ones. The lost host (1
or 2: host 0's launcher creates the job), the step and, for a loss, the phase are drawn from a
seeded RNG; the host's two ranks are held there, then the fault. A trial passes when every
launcher of the job (the partitioned host's excepted) exits 0 within LIMIT_S of the cut and the
final parameters are within 1e-6 of the same training uninterrupted (one run per scheme), or,
after a shrink, within 1e-5 (losses and parameters) of the reference the node-loss tests define:
the uninterrupted training saved at 3 x 2 after the shrink's step, resumed at 2 x 2 with the
same global batch. Its figures are the seconds from the cut to the job's end, the planner's
seconds lost (`ragshardctl job show`: "recoveries: 1 recovery, X s lost"; none for a shrink,
whose shrunk job records no recovery) and, for a partition, when the host's ranks exited.

    .venv/bin/python bench/chaos_hosts.py --build build --losses 10 --partitions 5 \\
        --json docs/benchmarks/chaos_hosts.json --report docs/benchmarks/chaos_hosts.md

Needs root (namespaces)."""
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import report_sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
MODEL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--optimizer", "adamw"]
STEPS = 6
HOSTS, PER_HOST = 3, 2
NODE_TIMEOUT_MS = 6000
LIMIT_S = 180.0
PARAM_ATOL = 1e-6
SHRINK_ATOL = 1e-5
SHRINK_DEADLINE_S = 10
GLOBAL_BATCH = ["--global-batch", "12"]  # the same global batch at 3 x 2 ranks and at 2 x 2
LOST = re.compile(r"recoveries:\s+(\d+) recover\w*, ([\d.]+) s lost")


def scheme(kind, trial):
    """A trial's scheme: parity:2, replica (both rebuilt on a replacement) or shrink."""
    if kind == "loss":
        return ("shrink", "parity:2", "replica")[trial % 3]
    return "shrink" if trial % 2 == 0 else ("parity:2", "replica")[(trial // 2) % 2]


def launchers(c, job, out, where, redundancy, extra=(), hosts=HOSTS, **more_env):
    """One launcher per (node rank, host) of `where` for a job of `hosts` hosts, each in a
    session of its own; redundancy "shrink" is replica with --on-node-loss shrink."""
    env = c.env(PYTHONPATH=os.pathsep.join([os.path.join(c.build, "python"),
                                            os.environ.get("PYTHONPATH", "")]), **more_env)
    flags = ["--redundancy", redundancy, "--recovery-deadline", "90"]
    if redundancy == "shrink":
        flags = ["--redundancy", "replica", "--on-node-loss", "shrink", "--recovery-deadline",
                 str(SHRINK_DEADLINE_S)]
        extra = GLOBAL_BATCH + list(extra)
    return {k: c.spawn(host, [sys.executable, "-m", "ragshard.launch", "--planner", c.planner,
                              "--job", job, "--create-job", "--nproc", str(hosts * PER_HOST),
                              "--nnodes", str(hosts), "--node-rank", str(k), "--sockets",
                              c.sockets[k], "--nodes", c.nodes[k], "--max-restarts", "1",
                              *flags, EXAMPLE, "--out", out, "--steps", str(STEPS)] + MODEL +
                       list(extra),
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       start_new_session=True)
            for k, host in where}


def kill_all(procs):
    """Each launcher's session (it and its ranks), killed."""
    from chaos_procs import kill_session
    for p in procs:
        if p.poll() is None:
            kill_session(p.pid)
            p.wait()


def finish(procs, until):
    """Every launcher's (exit code, output tail), waiting until `until` (time.time())."""
    out = {}
    for k, p in procs.items():
        try:
            text = p.communicate(timeout=max(1.0, until - time.time()))[0]
        except subprocess.TimeoutExpired:
            kill_all([p])
            text = p.communicate()[0] + "\n(killed: past the trial's limit)"
        out[k] = (p.returncode, text[-3000:])
    return out


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def cluster(build):
    from ragshard.cluster import NamespacedCluster
    c = NamespacedCluster(build, daemons=HOSTS, spare_hosts=1, pool_bytes=128 << 20,
                          node_timeout_ms=NODE_TIMEOUT_MS, heartbeat_ms=250, shared=[ROOT])
    return c


def reference(build, work, redundancy):
    out = os.path.join(work, f"ref-{redundancy.replace(':', '')}")
    with cluster(build) as c:
        passed(finish(launchers(c, "ref", out, enumerate(c.nodes), redundancy),
                      time.time() + LIMIT_S), f"the uninterrupted {redundancy} run")
    return out


def passed(got, what):
    bad = {k: t for k, (rc, t) in got.items() if rc != 0}
    if bad:
        raise RuntimeError(f"{what} failed: {bad}")


def shrink_reference(build, work, step, refs):
    """The reference of a shrink after `step` (cached in refs): the uninterrupted training at
    3 x 2 saved after that step, resumed at 2 x 2 with the same global batch."""
    key = ("shrink", step)
    if key not in refs:
        ckpt = os.path.join(work, f"shrink-ref-{step}.ckpt")
        out = os.path.join(work, f"shrink-ref-{step}")
        with cluster(build) as c:
            passed(finish(launchers(c, "save", out + "-saved", enumerate(c.nodes), "none",
                                    GLOBAL_BATCH + ["--save", ckpt, "--save-step", str(step)]),
                          time.time() + LIMIT_S), f"the reference saved after step {step}")
            passed(finish(launchers(c, "resumed", out, enumerate(c.nodes[:2]), "none",
                                    GLOBAL_BATCH + ["--resume", ckpt], hosts=2),
                          time.time() + LIMIT_S), f"the reference resumed after step {step}")
        refs[key] = out
    return refs[key]


def shrink_diff(build, work, out, refs):
    """The largest difference of a shrunk run from its reference: losses after the shrink and
    final parameters."""
    from recovery_runs import max_abs_diff
    with open(out + ".json") as f:
        shrunk = json.load(f)
    ref = shrink_reference(build, work, shrunk["shrink"]["step"], refs)
    with open(ref + ".json") as f:
        resumed = json.load(f)
    a = shrunk["losses"]
    b = resumed["losses"][shrunk["first_step"] - resumed["first_step"]:]
    if len(a) != len(b) or not a:
        raise RuntimeError(f"the shrunk run's losses {a} do not line up with the reference's "
                           f"{resumed['losses']}")
    return shrunk["shrink"]["step"], max([abs(x - y) for x, y in zip(a, b)] +
                                         [max_abs_diff(out, ref)])


def trial(build, work, kind, index, rng, refs):
    """One trial's record: its fault, and whether the job ended as it should (ok)."""
    from recovery_runs import max_abs_diff
    redundancy = scheme(kind, index)
    host = rng.choice([1, 2])
    step = rng.randint(2, STEPS - 1)
    phase = "forward" if kind == "partition" else rng.choice(
        ["forward", "backward", "step", "between"])
    node = f"node-{host}"
    record = {"kind": kind, "trial": index, "redundancy": redundancy, "host": node,
              "step": step, "phase": phase}
    out = os.path.join(work, f"{kind}-{index}")
    fault(build, work, record, out)
    if "ok" in record:  # it failed
        return record
    if redundancy == "shrink":
        try:
            record["shrink_step"], diff = shrink_diff(build, work, out, refs)
        except (RuntimeError, KeyError, OSError) as e:  # no shrink, or no reference
            record.update(ok=False, why=f"{type(e).__name__}: {e}")
            return record
        atol = SHRINK_ATOL
    else:
        diff, atol = max_abs_diff(out, refs[redundancy]), PARAM_ATOL
    record["max_abs_diff"] = diff
    record["ok"] = diff <= atol and record.get("fenced_named", True)
    if not record["ok"]:
        record["why"] = f"max |diff| {diff:.3g}" if diff > atol else \
            "the partitioned host's launcher did not name the fence"
    return record


def fault(build, work, record, out):
    """The trial's run on a cluster of its own, to the job's end; a failure sets record["ok"]
    (False) and "why"."""
    kind, redundancy, node = record["kind"], record["redundancy"], record["host"]
    host, step, phase, index = int(node[5:]), record["step"], record["phase"], record["trial"]
    with cluster(build) as c:
        ranks = [host * PER_HOST + i for i in range(PER_HOST)]
        marks = [os.path.join(work, f"{kind}-{index}-hold{r}") for r in ranks]
        procs = launchers(c, "cut", out, enumerate(c.nodes), redundancy,
                          [f"--hold-at={r}:{step}:{phase}:{m}" for r, m in zip(ranks, marks)],
                          RAGSHARD_PLANNER_RETRY_S="5")
        cut_off = []
        try:
            deadline = time.time() + LIMIT_S
            while not all(os.path.exists(m) for m in marks):
                if any(p.poll() is not None for p in procs.values()) or time.time() > deadline:
                    record.update(ok=False, why="the held ranks did not reach their hold")
                    return
                time.sleep(0.05)
            pids = [int(open(m).read()) for m in marks]
            c.hosts.link_down(node)
            cut = time.time()
            if kind == "loss":  # then everything on the host dies
                kill_all([procs[host]])
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                c.kill_daemon(host)
            else:  # its ranks go on, into an operation that cannot finish
                for m in marks:
                    os.unlink(m)
                while not all(gone(p) for p in pids):
                    if time.time() - cut > LIMIT_S:
                        record.update(ok=False, why="the partitioned host's ranks did not stop")
                        return
                    time.sleep(0.05)
                record["ranks_stopped_s"] = round(time.time() - cut, 2)
            old = procs.pop(host)
            cut_off.append(old)
            if redundancy != "shrink":
                c.start_daemon(host, log_suffix="-replacement", host="spare-0")
                procs.update(launchers(c, "cut", out, [(host, "spare-0")], redundancy))
            got = finish(procs, cut + LIMIT_S)
            record["end_s"] = round(time.time() - cut, 2)
            if kind == "partition":
                text = old.communicate(timeout=120)[0]
                record["fenced_named"] = "this node is fenced" in text
            bad = {k: t for k, (rc, t) in got.items() if rc != 0}
            shown = c.run("planner", [os.path.join(build, "ctl", "ragshardctl"), "--planner",
                                      c.planner, "--token-file", c.token_file, "job", "show",
                                      "cut"], capture_output=True, text=True, timeout=60).stdout
            m = LOST.search(shown)
            record["lost_s"] = float(m.group(2)) if m else None
            if bad:
                record.update(ok=False, why=f"launchers failed: {bad}")
        finally:
            kill_all(list(procs.values()) + cut_off)


def plot(records, path):
    """Each passing trial's seconds from the cut to the job's end and the planner's seconds
    lost, losses and partitions side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r.get("ok")]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = range(len(ok))
    ax.bar([x - 0.2 for x in xs], [r["end_s"] for r in ok], 0.4, label="cut to the job's end")
    ax.bar([x + 0.2 for x in xs], [r.get("lost_s") or 0 for r in ok], 0.4,
           label="planner's seconds lost")
    ax.set_xticks(list(xs), [f"{r['kind'][0]}{r['trial']}\n{r['redundancy'][:3]}" for r in ok],
                  fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Host losses (l) and partitions (p) on namespaced hosts: rebuilt or shrunk")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(records, path, commit=""):
    lines = ["# Host faults on hosts of their own", "",
             "Produced by `bench/chaos_hosts.py` (docs/recovery.md, \"Partitions and fencing\"); "
             f"train_tiny at {HOSTS} hosts x {PER_HOST} ranks, `--max-restarts 1`, node timeout "
             f"{NODE_TIMEOUT_MS / 1000:g} s, a replacement daemon on a spare host (none in a "
             f"shrink trial: recovery deadline {SHRINK_DEADLINE_S} s); commit "
             f"{commit or '(not recorded)'}. Run as `.venv/bin/python bench/chaos_hosts.py "
             "--build build --losses 10 --partitions 5 --json docs/benchmarks/chaos_hosts.json "
             "--report docs/benchmarks/chaos_hosts.md` (raw trials in chaos_hosts.json).", "",
             "A partition's replacement starts once the cut-off host's ranks stopped (its "
             "daemon fenced); a loss's at once. Seconds lost: the planner's, from the failure "
             "it saw to the job's recovery. A shrink trial's difference is from the reference "
             "saved at 3 x 2 after the shrink's step and resumed at 2 x 2 (losses and "
             f"parameters, ≤ {SHRINK_ATOL:g}); a rebuild's from the uninterrupted run "
             f"(parameters, ≤ {PARAM_ATOL:g}).", "",
             "| trial | fault | redundancy | host | step | phase | passed | ranks stopped (s) | "
             "cut to end (s) | planner's s lost | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        passed = "yes" if r.get("ok") else f"NO: {r.get('why', '')}"
        diff = f"{r['max_abs_diff']:.3g}" if "max_abs_diff" in r else ""
        cells = [r["trial"], r["kind"], r["redundancy"], r["host"], r["step"], r["phase"],
                 passed, r.get("ranks_stopped_s", ""), r.get("end_s", ""),
                 "—" if r.get("lost_s") is None else r["lost_s"], diff]
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    lines += ["", f"![trials]({os.path.basename(path)[:-3]}.png)", ""]
    table = summary(records)
    lines += [f"* {row[0]}: {row[2]} of {row[1]} passed; cut to end median {row[3]} s "
              f"({row[4]})" + (f"; planner's seconds lost median {row[5]} s" if row[5] != "—"
                               else " (the planner counts no seconds lost for a shrink)")
              for row in table]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(records, path[:-3] + ".png")
    section = [f"## Host faults on hosts of their own (bench/chaos_hosts.py, commit "
               f"{commit or '(not recorded)'})", "",
               f"train_tiny at {HOSTS} hosts x {PER_HOST} ranks, each host a network namespace "
               "with a private /tmp (ragshard.cluster.NamespacedCluster), one `ragshard-launch "
               f"--nnodes {HOSTS}` per host, node timeout {NODE_TIMEOUT_MS / 1000:g} s. A loss: "
               "the host's link goes down (nothing is reset), then everything on it dies; a "
               "partition: the link goes down while everything on it lives, and its daemon "
               "fences itself. Rebuilt: a replacement daemon with the node's id on a spare host; "
               f"shrunk: none, the job shrinks at the recovery deadline ({SHRINK_DEADLINE_S} s). "
               "Unlike the kills on loopback above, no peer learns of the fault from a reset: the "
               "planner's node timeout (or the replacement's registration) names it. Seconds "
               "lost: the planner's (`ragshardctl job show`, from the failure it saw to the "
               "job's recovery; the kill-with-reset figures above are measured as their own "
               "text says); cut to end: from the link's cut to the job's end, "
               "the steps after the fault included. Every trial "
               f"in [chaos_hosts.md](chaos_hosts.md).", "",
               "| fault | trials | passed | cut to end (s), median | min–max | planner's s "
               "lost, median | max abs diff |", "|---|---:|---:|---:|---:|---:|---:|"]
    section += ["| " + " | ".join(str(x) for x in row) + " |" for row in table]
    for report in ("recovery.md", "reliability.md"):
        there = os.path.join(os.path.dirname(os.path.abspath(path)), report)
        if os.path.exists(there):
            report_sections.put(there, "host-faults", "bench/chaos_hosts.py",
                                "\n".join(section))


def summary(records):
    """Per fault and outcome: (what, trials, passed, median and range of the cut to the end,
    median of the planner's seconds lost, largest difference)."""
    rows = []
    for kind, how in (("loss", "rebuilt"), ("loss", "shrunk"), ("partition", "rebuilt"),
                      ("partition", "shrunk")):
        done = [r for r in records if r["kind"] == kind and
                (r["redundancy"] == "shrink") == (how == "shrunk")]
        if not done:
            continue
        ok = [r for r in done if r.get("ok")]
        ends = [r["end_s"] for r in ok]
        lost = [r["lost_s"] for r in ok if r.get("lost_s") is not None]
        diffs = [r["max_abs_diff"] for r in done if "max_abs_diff" in r]
        rows.append((f"host {kind}, {how}", len(done), len(ok),
                     f"{statistics.median(ends):.1f}" if ends else "—",
                     f"{min(ends):.1f}–{max(ends):.1f}" if ends else "—",
                     f"{statistics.median(lost):.1f}" if lost else "—",
                     f"{max(diffs):.3g}" if diffs else "—"))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--losses", type=int, default=10)
    p.add_argument("--partitions", type=int, default=5)
    p.add_argument("--seed", type=int, default=72)
    p.add_argument("--json", default="")
    p.add_argument("--report", default="")
    p.add_argument("--from-json", default="", help="render --report from this JSON only")
    a = p.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            got = json.load(f)
        render(got["trials"], a.report, got.get("commit", ""))
        return 0
    build = os.path.abspath(a.build)
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ragshard import hosts
    why = hosts.unavailable()
    if why:
        sys.exit(f"chaos_hosts: hosts in namespaces cannot be made here: {why}")
    rng = random.Random(a.seed)
    records = []
    with tempfile.TemporaryDirectory(prefix="chaos-hosts-", dir="/var/tmp") as work:
        refs = {s: reference(build, work, s) for s in ("replica", "parity:2")}
        plan = [("loss", i + 1) for i in range(a.losses)] + \
            [("partition", i + 1) for i in range(a.partitions)]
        for kind, i in plan:
            r = trial(build, work, kind, i, rng, refs)
            records.append(r)
            print(json.dumps(r), flush=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"commit": commit, "node_timeout_ms": NODE_TIMEOUT_MS,
                       "trials": records}, f, indent=1)
    if a.report:
        render(records, a.report, commit)
    return 0 if all(r.get("ok") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
