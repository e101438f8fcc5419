"""Where a collective's time goes between 2 daemons × 1 rank, for bench/collectives_report.py:
the per-phase timers daemon_bench prints (issued -> the job thread starts it, the job thread's
run, finished -> the rank holds the answer), the CPU the run used (user and system seconds of
every process, from the kernel's accounting of the waited-for children), and a `perf record`
profile of the daemons' user-space time. perf_event_paranoid 2 (this machine's) allows user
space only: the kernel's share (the TCP copies on loopback) shows in the system seconds.
"""
import collections
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

TOP = 8  # symbols per profile
# Operations per profiled run, so that the operations outweigh the start-up (about 1 s of
# operations at each size).
PROFILE_ITERS = {1 << 20: 2000, 64 << 20: 40}


def parse_daemon_bench(stdout):
    """daemon_bench's rows, per-phase medians and gradient allocations:
    (rows, {(config, bytes, op): (queued_us, run_us, answered_us)}, {(config, bytes): seconds})."""
    rows, phases, alloc = [], {}, {}
    for line in stdout.splitlines():
        parts = line.strip().split(",")
        if parts[0] == "phases-us" and len(parts) == 7:
            phases[(parts[1], int(parts[2]), parts[3])] = tuple(float(x) for x in parts[4:])
        elif parts[0] == "grad-alloc-s" and len(parts) == 4:
            alloc[(parts[1], int(parts[2]))] = float(parts[3])
        elif len(parts) == 7 and parts[0].startswith("ragshard-"):
            impl, op, n, size, sec, alg, bus = parts
            rows.append((impl, op, int(n), int(size), float(sec), float(alg), float(bus)))
    return rows, phases, alloc


def cpu_of(cmd):
    """Runs cmd; (stdout, wall s, user s, system s) of it and every process it waited for."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def daemon_symbols(b, op, size):
    """The daemons' user-space profile of daemon_bench --only op at size: [(share, symbol)] of
    their samples, and their sample count; None where perf cannot record."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        cmd = ["perf", "record", "-q", "-e", "cpu-clock:u", "-F", "4000", "-o", data, "--",
               f"{b}/daemon_bench", "--config", "2x1", "--bytes", str(size), "--only", op,
               "--iters", str(PROFILE_ITERS[size])]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
            script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,ip,sym"],
                                    check=True, capture_output=True, text=True,
                                    timeout=600).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    process = {}  # pid -> its main thread's name
    samples = []
    for line in script.splitlines():
        # "comm pid/tid ip symbol", the symbol possibly of several words
        fields = line.split()
        at = next((i for i, f in enumerate(fields) if "/" in f and f.split("/")[0].isdigit()),
                  None)
        if at is None or len(fields) < at + 2:
            continue
        pid, tid = (int(x) for x in fields[at].split("/"))
        comm, sym = " ".join(fields[:at]), " ".join(fields[at + 2:]) or "[unknown]"
        if pid == tid:
            process[pid] = comm
        samples.append((pid, sym))
    counts = collections.Counter(sym for pid, sym in samples if process.get(pid) == "ragshardd")
    total = sum(counts.values())
    if total == 0:
        return None
    return [(n / total, sym) for sym, n in counts.most_common(TOP)], total


def where_the_time_goes(b, phases, alloc, bound_sec):
    """The section's markdown lines. phases: {(bytes, op): [(queued, run, answered) per run]};
    alloc: {bytes: [seconds]}; bound_sec: {(op, bytes): the exchange bound's median seconds}."""
    md = ["\n## Where the time goes (2 daemons × 1 rank)\n"]
    md.append(
        "Per-phase timers, rank 0's medians over each run's operations and then the median "
        "over the alternated runs, on the steady clock the daemon stamps too: **queued** is "
        "from the rank's call to the job thread starting the operation (the shared-memory "
        "command queue and the hand-off), **run** the job thread's run of it, **answered** "
        "from its end to the rank holding the answer. *RS − AG run* is the reduce-scatter's "
        "run less the all-gather's: at 2 daemons both send half the buffer each way in the "
        "same messages' bytes, so this is the reduction (the fp32 sum of the received half "
        "into the output) and its pieces. *grad alloc* is the gradient buffer's allocation "
        "before each reduce-scatter (the daemon zero-fills it, as autograd accumulates into "
        "it), timed apart from the collective.\n")
    md.append("| size | AG queued µs | AG run µs | AG answered µs | AG bound µs | RS queued µs | "
              "RS run µs | RS answered µs | RS bound µs | RS − AG run µs | grad alloc ms |")
    md.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sizes = sorted({s for (s, op) in phases})
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    for s in sizes:
        ag, rs = phases.get((s, "allgather")), phases.get((s, "reducescatter"))
        if not ag or not rs:
            continue
        cells = [f"{s >> 20} MiB"]
        cells += [f"{med(ag, i):.0f}" for i in range(3)]
        cells.append(f"{bound_sec.get(('allgather', s), 0) * 1e6:.0f}")
        cells += [f"{med(rs, i):.0f}" for i in range(3)]
        cells.append(f"{bound_sec.get(('reducescatter', s), 0) * 1e6:.0f}")
        cells.append(f"{med(rs, 1) - med(ag, 1):.0f}")
        cells.append(f"{statistics.median(alloc[s]) * 1e3:.2f}" if alloc.get(s) else "–")
        md.append("| " + " | ".join(cells) + " |")

    md.append(
        "\nIn words, per size: the operation's median time end to end (queued + run + "
        "answered) against the exchange bound, what 0.8× of the bound would allow, and the "
        "parts: the control path (queued + answered), the job thread's run beyond the bound's "
        "exchange, and for the reduce-scatter the reduction (RS − AG run).\n")
    for s in sizes:
        ag, rs = phases.get((s, "allgather")), phases.get((s, "reducescatter"))
        if not ag or not rs:
            continue
        for op, xs in (("all-gather", ag), ("reduce-scatter", rs)):
            key = "allgather" if op == "all-gather" else "reducescatter"
            bound = bound_sec.get((key, s), 0) * 1e6
            q, r, a = (med(xs, i) for i in range(3))
            total = q + r + a
            line = (f"* {s >> 20} MiB {op}: {total:.0f} µs against the bound's {bound:.0f} µs "
                    f"({bound / total:.2f}×; 0.8× allows {bound / 0.8:.0f} µs); control path "
                    f"{q + a:.0f} µs, run beyond the bound {r - bound:.0f} µs")
            if key == "reducescatter":
                line += f", of which the reduction about {med(rs, 1) - med(ag, 1):.0f} µs"
            md.append(line + ".")

    md.append("\n### CPU: the exchange alone keeps both cores busy\n")
    md.append(
        "One run of `exchange_bound --daemons 2 --sizes S` (its 2 processes, start-up "
        "included): user and system seconds of both over the run's wall time. *cores busy* = "
        "(user + system) ÷ wall, where 2.0 is the whole machine. System time is the kernel: "
        "the TCP copies and wake-ups on loopback. Whatever the daemons do beyond the exchange "
        "(the reduction, the control path) needs CPU that the exchange already uses.\n")
    md.append("| size | wall s | user s | system s | cores busy |")
    md.append("|---:|---:|---:|---:|---:|")
    for size in (1 << 20, 64 << 20, 256 << 20):
        _, wall, user, system = cpu_of([f"{b}/exchange_bound", "--daemons", "2", "--sizes",
                                        str(size)])
        md.append(f"| {size >> 20} MiB | {wall:.2f} | {user:.2f} | {system:.2f} | "
                  f"{(user + system) / wall:.2f} |")

    md.append("\n### Profile of the daemons (perf, user space)\n")
    md.append(
        "`perf record -e cpu-clock:u -F 4000` over `daemon_bench --config 2x1 --bytes S --only "
        f"OP --iters N` (N = {PROFILE_ITERS[1 << 20]} at 1 MiB, {PROFILE_ITERS[64 << 20]} at "
        "64 MiB, so that the operations outweigh the start-up, which is included: the dynamic "
        "loader's symbols); the share of the two ragshardd processes' user-space samples "
        f"per symbol, top {TOP}. The kernel's time is not sampled here (perf_event_paranoid "
        "2); the CPU table above gives its total.\n")
    for size in (1 << 20, 64 << 20):
        for op in ("allgather", "reducescatter"):
            prof = daemon_symbols(b, op, size)
            md.append(f"\n**{op}, {size >> 20} MiB**" + (
                f" ({prof[1]} samples):\n" if prof else ": perf could not record here.\n"))
            if prof:
                md.append("| share | symbol |\n|---:|---|")
                for share, sym in prof[0]:
                    md.append(f"| {share * 100:.1f} % | `{sym}` |")
    return md
