#!/usr/bin/python3
"""Runs the collective benchmarks side by side in one run and writes
docs/benchmarks/collectives.md.

    /usr/bin/python3 bench/collectives_report.py [--build build] [--max-mib 256]

Rows come from bench/collectives_bench (ragshard over UCX), bench/mpi_collectives under
mpirun (OpenMPI, tcp or its default shared memory) and bench/gloo_collectives (Gloo tcp),
all with nccl-tests' bus-bandwidth definitions (bench/bench_common.h).
"""
import argparse
import collections
import datetime
import os
import subprocess
import sys


def run(cmd, env=None):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    rows = []
    for line in out.stdout.splitlines():
        parts = line.strip().split(",")
        if len(parts) == 7:
            impl, op, n, size, sec, alg, bus = parts
            rows.append((impl, op, int(n), int(size), float(sec), float(alg), float(bus)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--max-mib", default="256")
    ap.add_argument("--out", default="docs/benchmarks/collectives.md")
    args = ap.parse_args()
    b = os.path.join(args.build, "bench")
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    rows = []
    rows += run([f"{b}/collectives_bench", "--members", "1", "--max-mib", args.max_mib])
    for n in (2, 4):
        rows += run([f"{b}/collectives_bench", "--members", str(n), "--max-mib", args.max_mib])
        rows += run(mpirun + ["-np", str(n), "--mca", "btl", "tcp,self", f"{b}/mpi_collectives",
                              "openmpi-tcp", args.max_mib])
        rows += run([f"{b}/gloo_collectives", "--members", str(n), "--max-mib", args.max_mib])
        rows += run(mpirun + ["-np", str(n), f"{b}/mpi_collectives", "openmpi-shm", args.max_mib])

    table = collections.defaultdict(dict)
    for impl, op, n, size, sec, alg, bus in rows:
        table[(op, n, size)][impl] = bus
    md = []
    md.append("# Collectives benchmark\n")
    md.append(f"Run on {datetime.date.today()} on this repository's 2-core development machine by "
              "`bench/collectives_report.py`, every implementation in the same run. Bus bandwidth "
              "(GB/s) as nccl-tests defines it: the size is the full gathered (or to-be-reduced) "
              "buffer, busbw = size / time × (n − 1) / n. Reduce-scatter is fp32 sum. Each figure "
              "is the slowest member's mean over the iterations.\n")
    md.append("## What is measured, and what is not yet\n")
    md.append("* **ragshard-ucx** is the data plane's collectives (`server/daemon/collectives.cc`: "
              "ring, direct below 64 KiB per block) over its UCX communicator "
              "(`server/daemon/ucx_comm.cc`: ucp tag API, peer error handling, tcp) between "
              "separate processes on 127.0.0.1: the inter-node path, measured at the transport "
              "level. The daemon that runs them for its local ranks (issue 4) is not built yet, so "
              "the daemon-level comparisons of the issue (2 daemons × 2 ranks with in-memory "
              "reduction inside a node; 1 daemon with 2 and 4 local ranks against OpenMPI's shared "
              "memory) cannot be run yet; the OpenMPI shared-memory rows are recorded for that "
              "comparison.\n"
              "* **openmpi-tcp**: `mpirun --mca btl tcp,self`, MPI_Allgather and "
              "MPI_Reduce_scatter_block. **openmpi-shm**: OpenMPI's default (shared memory).\n"
              "* **gloo-tcp**: Gloo's allgather and ReduceScatterHalvingDoubling over its tcp "
              "transport.\n"
              "* **memcpy**: single-process copy bandwidth, the physical limit of any host "
              "collective here. **ucx-p2p**: one UCX tagged transfer from process 0 to process 1.\n")
    for op in ("allgather", "reducescatter"):
        for n in (2, 4):
            sizes = sorted(s for (o, m, s) in table if o == op and m == n)
            if not sizes:
                continue
            md.append(f"\n## {op}, {n} processes\n")
            md.append("| size | ragshard-ucx | openmpi-tcp | gloo-tcp | ours ÷ best tcp baseline | openmpi-shm |")
            md.append("|---:|---:|---:|---:|---:|---:|")
            for s in sizes:
                r = table[(op, n, s)]
                ours = r.get("ragshard-ucx")
                base = max(r.get("openmpi-tcp", 0), r.get("gloo-tcp", 0))
                ratio = f"{ours / base:.2f}×" if ours and base else "–"
                fmt = lambda k: f"{r[k]:.3f}" if k in r else "–"
                md.append(f"| {s >> 20} MiB | {fmt('ragshard-ucx')} | {fmt('openmpi-tcp')} | "
                          f"{fmt('gloo-tcp')} | {ratio} | {fmt('openmpi-shm')} |")
    md.append("\n## Physical limits\n")
    md.append("| size | memcpy GB/s | ucx-p2p GB/s |\n|---:|---:|---:|")
    for s in sorted(s for (o, m, s) in table if o == "copy"):
        p2p = table.get(("sendrecv", 2, s), {}).get("ucx-p2p")
        md.append(f"| {s >> 20} MiB | {table[('copy', 1, s)]['memcpy']:.2f} | "
                  f"{p2p:.2f} |" if p2p else f"| {s >> 20} MiB | {table[('copy', 1, s)]['memcpy']:.2f} | – |")
    md.append("\n## Raw rows\n\n```\nimpl,op,members,bytes,seconds,algbw_GBps,busbw_GBps")
    for row in rows:
        md.append(",".join(str(x) for x in row))
    md.append("```\n\n## Reproduce\n\n```\nbash scripts/test.sh\n/usr/bin/python3 "
              "bench/collectives_report.py --build build --max-mib 256\n```\n")
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
