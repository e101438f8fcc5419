"""Measures this machine as a cluster profile for the strategy search: profiles/host-2x2-loopback.json.

Runs the project's collectives benchmark through the daemons (bench/daemon_bench: a planner, two
ragshardd 'nodes' on 127.0.0.1 and their rank processes, unshard / reduce_scatter through the
client library) and a one-thread torch matmul for the compute rate, and writes every figure with
its source (this run). The all-reduce and broadcast curves are derived, and marked so.

    .venv/bin/python bench/host_profile.py --build build
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matmul_flops():
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    n, t = 50, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 512 ** 3 * n / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "profiles", "host-2x2-loopback.json"))
    a = p.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # One daemon_bench run per size (fresh planner and daemons each time), as the calibration
    # in bench/strategy_report.py measures.
    # The median of --repeats runs per size: this 2-core machine is noisy.
    samples = {}
    size = 1 << 20
    while size <= a.max_mib << 20:
        for _ in range(a.repeats):
            r = subprocess.run([os.path.join(a.build, "bench", "daemon_bench"), "--bytes",
                                str(size)], capture_output=True, text=True, timeout=1200)
            if r.returncode != 0:
                raise SystemExit(f"daemon_bench failed: {r.stderr}")
            for line in r.stdout.splitlines():
                f = line.split(",")
                if len(f) == 7 and f[0].startswith("ragshard-"):
                    samples.setdefault((f[0], f[1], int(f[3])), []).append(float(f[6]))
        size *= 4
    rows = {}
    for (impl, op, b), v in sorted(samples.items()):
        rows.setdefault((impl, op), []).append((b, sorted(v)[len(v) // 2]))
    src = (f"bench/daemon_bench --bytes SIZE, median of {a.repeats} runs per size (fresh daemons "
           f"each), by bench/host_profile.py on this machine, {stamp}: {{impl}} {{op}} at "
           f"{{size}} B, busbw")

    def curve(impl, op):
        pts = sorted(rows[(impl, op)])
        return [{"bytes": b, "gbps": round(g, 4),
                 "source": src.format(impl=impl, op=op, size=b)} for b, g in pts]

    def all_reduce(impl):
        ag, rs = sorted(rows[(impl, "allgather")]), sorted(rows[(impl, "reducescatter")])
        return [{"bytes": b, "gbps": round(2 / (1 / g1 + 1 / g2), 4),
                 "assumption": "the data plane's all-reduce is a reduce-scatter then an "
                               f"all-gather: busbw = 2/(1/rs + 1/ag) from this run's {impl} "
                               f"figures at {b} B ({g2:.4f} and {g1:.4f} GB/s)"}
                for (b, g1), (_, g2) in zip(ag, rs)]

    def broadcast(impl):
        return [{"bytes": b, "gbps": round(g, 4),
                 "assumption": f"not measured: the {impl} all-gather figure at {b} B (a "
                               "broadcast moves the same bytes per link)"}
                for b, g in sorted(rows[(impl, "allgather")])]

    intra, one, two = "ragshard-1daemon-2ranks", "ragshard-daemons-2x1", "ragshard-daemons-2x2"
    flops = matmul_flops()
    prof = {
        "name": "host-2x2-loopback",
        "description": "This development machine as the tests and the demo use it: 2 ragshardd "
                       "daemons ('nodes') on 127.0.0.1 with 2 training processes ('devices') "
                       "each, host backend (shared memory inside a daemon, UCX tcp between "
                       "daemons). Measured by bench/host_profile.py.",
        "nodes": 2, "devices_per_node": 2,
        "device_memory_bytes": {"value": 6442450944,
                                "assumption": "a quarter of this machine's 24 GiB for each of "
                                              "the 4 training processes"},
        "peak_flops": {"value": round(flops, -6),
                       "source": f"measured by bench/host_profile.py, {stamp}: {sys.executable}, "
                                 "torch.set_num_threads(1), 512x512 fp32 matmul"},
        "mfu": {"value": 0.5, "assumption": "4 training processes share 2 cores, so each gets "
                                            "about half of one core's matmul rate"},
        "collectives": {
            "all_gather": {"intra_node": curve(intra, "allgather"),
                           "inter_node": {"1": curve(one, "allgather"),
                                          "2": curve(two, "allgather")}},
            "reduce_scatter": {"intra_node": curve(intra, "reducescatter"),
                               "inter_node": {"1": curve(one, "reducescatter"),
                                              "2": curve(two, "reducescatter")}},
            "all_reduce": {"intra_node": all_reduce(intra),
                           "inter_node": {"1": all_reduce(one), "2": all_reduce(two)}},
            "broadcast": {"intra_node": broadcast(intra),
                          "inter_node": {"1": broadcast(one), "2": broadcast(two)}}}}
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
        f.write("\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
