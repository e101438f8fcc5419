"""Checkpoint throughput: ragshard.checkpoint's save and load per rank, against this disk's own
write and read bandwidth and against torch.save / torch.load of the full state, all measured in
one run, alternated, `--reps` times each. Writes docs/benchmarks/checkpoint.md and a plot.

    .venv/bin/python bench/checkpoint_report.py --build build

The model is examples/train_tiny.py at --layers 8 --dim 512 (about 25 M parameters, fp32,
AdamW: parameters and two moments, about 300 MB), on 2 daemons x 2 ranks. Saves are fsynced
(data files, indexes, metadata and directories). The disk's write bandwidth is measured with
as many writers as ranks at once (each a file of one rank's size), so that the save compares
with the disk at the same number of writers, and with one writer (a file of the checkpoint's
size). Reads are measured twice: right after the save (the files are in the page cache) and
after dropping the page cache (/proc/sys/vm/drop_caches, which needs root; without it the cold
rows are left out and the report says so).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")
MODEL = ["--layers", "8", "--dim", "512", "--heads", "8", "--seq", "32", "--vocab", "64",
         "--global-batch", "8", "--quiet"]
MB = 1e6


def drop_caches():
    """Drops the page cache; False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rank_files(step_dir):
    return {f: os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir)
            if f.endswith(".bin")}


def launch(build, cluster, job, out, args):
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    cmd = [sys.executable, "-m", "ragshard.launch", "--planner", cluster.planner, "--job", job,
           "--nproc", "4", "--sockets", ",".join(cluster.sockets), "--create-job", EXAMPLE,
           "--out", os.path.join(out, job)] + MODEL + args
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"{job} failed:\n{r.stdout}{r.stderr}")
    ranks = [json.load(open(os.path.join(out, f"{job}.rank{i}.json"))) for i in range(4)]
    for r in ranks:
        r["checkpoint"]["step_seconds"] = r["step_seconds"]
    return [r["checkpoint"] for r in ranks]


def together(ck):
    """MB/s of a load by every rank at once: all bytes read over the slowest rank's time."""
    return sum(s["load_bytes_read"] for s in ck) / max(s["load_seconds"] for s in ck) / MB


def disk_write(paths, sizes):
    """The disk's write bandwidth with len(paths) writers at once: writer i writes sizes[i]
    bytes to paths[i] in 1 MiB blocks of one preallocated buffer (memoryview slices: nothing is
    copied per block) and fsyncs it. The writers are threads, whose write and fsync system calls
    run in parallel (they release the GIL), as the ranks' do. Before the clock starts the old
    files are removed and every dirty page written back (os.sync), so that no earlier write is
    flushed inside the timing; each writer opens its file before the common start. Returns the
    seconds from the first writer's start to the last one's fsync, and each writer's own."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.sync()
    block = memoryview(os.urandom(1 << 20))
    go = threading.Barrier(len(paths))
    spans, errors = [None] * len(paths), []

    def write(i):
        fd = -1
        try:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            go.wait()
            t = time.perf_counter()
            left = sizes[i]
            while left > 0:
                left -= os.write(fd, block[:min(left, len(block))])
            os.fsync(fd)
            spans[i] = (t, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)
            go.abort()
        finally:
            if fd >= 0:
                os.close(fd)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the first error that is not another writer's broken barrier
        raise sorted(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))[0]
    return (max(e for _, e in spans) - min(s for s, _ in spans), [e - s for s, e in spans])


def disk_read(path):
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)
    return time.perf_counter() - t


def torch_full_state():
    """The example's model and AdamW state after one step, as one process holds them."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_tiny
    torch.manual_seed(0)
    model = train_tiny.TinyLM(64, 512, 8, 8, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def torch_save(state, path):
    """Seconds of torch.save of `state` to `path` and its fsync, started as disk_write's are:
    the previous file removed and the dirty pages written back first."""
    import torch
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def torch_load(path):
    import torch
    t = time.perf_counter()
    torch.load(path)
    return time.perf_counter() - t


def summary(values):
    return statistics.median(values), min(values), max(values)


def fmt(values):
    m, lo, hi = summary(values)
    return f"{m:.0f} ({lo:.0f}–{hi:.0f})"


def verdict(m):
    """Whether the asynchronous save paid off in this run, from the medians."""
    grew = summary(m["async_next_step"])[0] - summary(m["sync_next_step"])[0]
    blocked = summary(m["sync_ms"])[0] / 1e3
    if grew <= blocked:
        return (f" Here it paid off: the next step grew by {grew:.2f} s against the "
                f"{blocked:.2f} s a synchronous save blocks.")
    return (f" Here it did not pay off: the next step grew by {grew:.2f} s (medians), more than "
            f"the {blocked:.2f} s a synchronous save blocks; use synchronous saves where the "
            "disk is as fast as this one and the cores are busy.")


def fmt2(values):
    m, lo, hi = summary(values)
    return f"{m:.2f}× ({lo:.2f}–{hi:.2f})"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r[0] for r in rows]
    med = [summary(r[1])[0] for r in rows]
    err = [[m - summary(r[1])[1] for m, r in zip(med, rows)],
           [summary(r[1])[2] - m for m, r in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(labels, med, xerr=err, color=["C0" if "ragshard" in label else "C7"
                                           for label in labels])
    ax.invert_yaxis()
    ax.set_xlabel("MB/s (median, min–max whiskers)")
    fig.suptitle("Checkpoint throughput, 2 daemons x 2 ranks, ~25 M parameters + AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "checkpoint.md"))
    ap.add_argument("--work", default="", help="scratch directory (default: a new one in /tmp)")
    provenance.add_flag(ap)
    a = ap.parse_args()
    provenance.require(a)
    build = os.path.abspath(a.build)
    sys.path.insert(0, os.path.join(build, "python"))
    from ragshard.cluster import LocalCluster
    work = a.work or tempfile.mkdtemp(prefix="ragshard-ckpt-bench-")
    os.makedirs(work, exist_ok=True)
    can_drop = drop_caches()
    m = {k: [] for k in ("save_rank", "save_all", "sync_ms", "async_stall", "sync_next_step",
                         "async_next_step", "sync_step_ratio", "async_step_ratio", "load_warm_rank",
                         "load_warm_all", "load_cold_rank", "load_cold_all", "disk_write_1",
                         "disk_write_n_each", "disk_write_n_all", "disk_read_warm",
                         "disk_read_cold",
                         "torch_save", "torch_load_warm", "torch_load_cold")}
    state = torch_full_state()
    sizes = {}
    for rep in range(a.reps):
        # A fresh planner and daemons per repetition: a finished job's shards stay in the
        # daemons' pools until the job is deleted.
        with LocalCluster(build, daemons=2, pool_bytes=1 << 30, cluster_profile=PROFILE) as c:
            root = os.path.join(work, f"ckpt{rep}")
            shutil.rmtree(root, ignore_errors=True)
            ck = launch(build, c, f"save{rep}", work, ["--steps", "2", "--save", root,
                                                       "--save-step", "1"])
            m["sync_next_step"] += [s["step_seconds"][1] for s in ck]
            m["sync_step_ratio"] += [s["step_seconds"][1] / s["step_seconds"][0] for s in ck]
            files = rank_files(os.path.join(root, "step_00000001"))
            per_rank = [files[f"rank{i:05d}.bin"] for i in range(4)]
            total = sum(per_rank)
            sizes = {"per_rank": per_rank, "total": total}
            m["save_rank"] += [b / s["save_seconds"][0] / MB for b, s in zip(per_rank, ck)]
            m["save_all"].append(total / max(s["save_seconds"][0] for s in ck) / MB)
            m["sync_ms"] += [s["save_seconds"][0] * 1e3 for s in ck]
            ck = launch(build, c, f"async{rep}", work, ["--steps", "2", "--save", root + "a",
                                                        "--save-step", "1", "--async-save"])
            m["async_stall"] += [s["save_seconds"][0] * 1e3 for s in ck]
            m["async_next_step"] += [s["step_seconds"][1] for s in ck]
            m["async_step_ratio"] += [s["step_seconds"][1] / s["step_seconds"][0] for s in ck]
            ck = launch(build, c, f"warm{rep}", work, ["--steps", "2", "--resume", root])
            m["load_warm_rank"] += [s["load_bytes_read"] / s["load_seconds"] / MB for s in ck]
            m["load_warm_all"].append(together(ck))
            if can_drop:
                drop_caches()
                ck = launch(build, c, f"cold{rep}", work, ["--steps", "2", "--resume", root])
                m["load_cold_rank"] += [s["load_bytes_read"] / s["load_seconds"] / MB
                                        for s in ck]
                m["load_cold_all"].append(together(ck))
            # The disk with one writer, then with one writer per rank (each a rank's bytes).
            f = os.path.join(work, "disk.bin")
            seconds, _ = disk_write([f], [total])
            m["disk_write_1"].append(total / seconds / MB)
            m["disk_read_warm"].append(total / disk_read(f) / MB)
            if can_drop:
                drop_caches()
                m["disk_read_cold"].append(total / disk_read(f) / MB)
            os.unlink(f)
            fs = [os.path.join(work, f"disk{i}.bin") for i in range(len(per_rank))]
            seconds, each = disk_write(fs, per_rank)
            m["disk_write_n_all"].append(total / seconds / MB)
            m["disk_write_n_each"] += [b / s / MB for b, s in zip(per_rank, each)]
            for f in fs:
                os.unlink(f)
            t = os.path.join(work, "torch.pt")
            seconds = torch_save(state, t)
            m["torch_save"].append(os.path.getsize(t) / seconds / MB)
            m["torch_load_warm"].append(os.path.getsize(t) / torch_load(t) / MB)
            if can_drop:
                drop_caches()
                m["torch_load_cold"].append(os.path.getsize(t) / torch_load(t) / MB)
            shutil.rmtree(root + "a", ignore_errors=True)
            print(f"rep {rep + 1}/{a.reps} done", flush=True)
    torch_bytes = os.path.getsize(os.path.join(work, "torch.pt"))
    rows = [("ragshard save, per rank", m["save_rank"]),
            ("disk write + fsync, per writer of 4 at once", m["disk_write_n_each"]),
            ("ragshard save, 4 ranks together", m["save_all"]),
            ("disk write + fsync, 4 writers together", m["disk_write_n_all"]),
            ("disk write + fsync, 1 writer", m["disk_write_1"]),
            ("torch.save of the full state + fsync", m["torch_save"]),
            ("ragshard load, per rank (page cache)", m["load_warm_rank"]),
            ("ragshard load, 4 ranks together (page cache)", m["load_warm_all"]),
            ("disk read (page cache)", m["disk_read_warm"]),
            ("torch.load (page cache)", m["torch_load_warm"])]
    if can_drop:
        rows += [("ragshard load, per rank (cold)", m["load_cold_rank"]),
                 ("ragshard load, 4 ranks together (cold)", m["load_cold_all"]),
                 ("disk read (cold)", m["disk_read_cold"]),
                 ("torch.load (cold)", m["torch_load_cold"])]
    png = os.path.splitext(a.out)[0] + ".png"
    plot(rows, png)
    write(a, rows, m, sizes, torch_bytes, can_drop, os.path.basename(png))
    shutil.rmtree(work, ignore_errors=True)


def write(a, rows, m, sizes, torch_bytes, can_drop, png):
    today = datetime.date.today().isoformat()
    ratio = lambda x, y: summary(x)[0] / summary(y)[0]  # noqa: E731
    lines = [
        "# Checkpoint throughput", "",
        f"Run on {today} on this repository's 2-core development machine by "
        f"`.venv/bin/python bench/checkpoint_report.py --build build` ({a.reps} repetitions, "
        "every row alternated in the same run). The model: examples/train_tiny.py "
        "`--layers 8 --dim 512` (about 25 M parameters, fp32) with AdamW's two moments, on "
        "2 daemons × 2 ranks; a checkpoint holds "
        f"{sizes['total'] / MB:.0f} MB in 4 rank files of "
        f"{', '.join(f'{b / MB:.0f}' for b in sizes['per_rank'])} MB; torch.save of the same "
        f"state (model and AdamW state_dict) is {torch_bytes / MB:.0f} MB.", "",
        "* **Save** is `ragshard.checkpoint.save` as the example calls it after a step: copy "
        "nothing (synchronous), write the rank's pieces with a CRC-32 per 1 MiB chunk, fsync, "
        "write and fsync the rank's index, two barriers through the daemons, and on rank 0 the "
        "commit (metadata, renames, `latest`, directory fsyncs). Per rank: the rank's bytes over "
        "its own save time. Together: all bytes over the slowest rank's time.",
        "* **Load** is `ragshard.checkpoint.load` in a new job of the same shape: every rank "
        "reads the chunks its pieces need and checks their CRC-32, and copies them into its "
        "shards and AdamW state. Per rank: the bytes it read over its load time.",
        "* **Disk write** is measured in the same run with as many writers as ranks (4 at "
        "once, each writing a file of one rank's size: the same number of writers and bytes as "
        "the save) and with 1 writer (a file of the checkpoint's total size). The writers are "
        "threads whose write and fsync system calls run in parallel; each writes 1 MiB blocks "
        "of one preallocated buffer (no copy per block) and fsyncs. Before each measurement "
        "the previous files are removed and all dirty pages written back (`os.sync`), so no "
        "earlier write is flushed inside the timing. Per writer: its bytes over its own time; "
        "together: all bytes from the first start to the last fsync. torch.save (+ fsync) "
        "starts the same way. **Disk read** is one process reading back the 1-writer file.",
        "* **(page cache)** rows read files written moments before, which the kernel still "
        "holds: they measure memory, not the disk. " +
        ("**(cold)** rows ran after `echo 3 > /proc/sys/vm/drop_caches`." if can_drop else
         "The cold rows are missing: this run could not drop the page cache (not root)."), "",
        "| what | MB/s, median (min–max) |", "|---|---:|"]
    lines += [f"| {label} | {fmt(v)} |" for label, v in rows]
    lines += ["", f"![checkpoint throughput]({png})", "",
              "## Ratios (medians, this run)", "",
              f"* ragshard save, 4 ranks together ÷ disk write, 4 writers together (the same "
              f"number of writers): {ratio(m['save_all'], m['disk_write_n_all']):.2f}×; per "
              f"rank ÷ disk write per writer of 4: "
              f"{ratio(m['save_rank'], m['disk_write_n_each']):.2f}×. Against 1 writer: "
              f"{ratio(m['save_all'], m['disk_write_1']):.2f}× (4 writers together ÷ 1 writer: "
              f"{ratio(m['disk_write_n_all'], m['disk_write_1']):.2f}×).",
              f"* ragshard save, 4 ranks together ÷ torch.save of the full state: "
              f"{ratio(m['save_all'], m['torch_save']):.2f}×.",
              f"* ragshard load, 4 ranks together ÷ disk read, page cache: "
              f"{ratio(m['load_warm_all'], m['disk_read_warm']):.2f}×" +
              (f"; cold: {ratio(m['load_cold_all'], m['disk_read_cold']):.2f}×." if can_drop
               else ".") + " ÷ torch.load of the full state, page cache: "
              f"{ratio(m['load_warm_all'], m['torch_load_warm']):.2f}×" +
              (f"; cold: {ratio(m['load_cold_all'], m['torch_load_cold']):.2f}×." if can_drop
               else "."),
              f"* A synchronous save blocks each rank for {fmt(m['sync_ms'])} ms (median, "
              f"min–max over ranks and repetitions); an asynchronous one for "
              f"{fmt(m['async_stall'])} ms (a barrier; nothing is copied on the host backend), "
              "after which a thread writes the rank's part while the next forward and backward "
              "run, and the optimizer's next step waits until it is written. The step after the "
              f"save took {summary(m['sync_next_step'])[0]:.2f} s after a synchronous save and "
              f"{summary(m['async_next_step'])[0]:.2f} s after an asynchronous one (medians; "
              f"ranges {summary(m['sync_next_step'])[1]:.2f}–"
              f"{summary(m['sync_next_step'])[2]:.2f} and "
              f"{summary(m['async_next_step'])[1]:.2f}–{summary(m['async_next_step'])[2]:.2f} "
              "s); the step after the save over the step before it, in the same process: "
              f"{fmt2(m['sync_step_ratio'])} after a synchronous save, "
              f"{fmt2(m['async_step_ratio'])} after an asynchronous one. Step times on this "
              "shared 2-core machine vary by tens of percent from run to run; on 2 cores the "
              "writing thread also competes with the step's compute, so the overlap hides less "
              "than it would on a machine with idle cores." + verdict(m), "",
              "## Reading these figures", "",
              "* All four ranks and both daemons share one disk and two cores, so the ranks' "
              "writes compete: a rank's save compares with one of 4 disk writers at once, and "
              "4 ranks together, what a node's disk sees, with the disk's 4 writers together. "
              "On a cluster each node writes its ranks' files to a shared filesystem, whose "
              "bandwidth then bounds the save.",
              "* A save moves each byte once from the shards to the file (no gather, no "
              "serialization); the cost beyond the disk is the CRC-32 (zlib) and the barriers.",
              "* A load reads only the ranges of its pieces, rounded out to whole 1 MiB chunks "
              "for the CRC check; under the same plan each rank reads its own file. Each byte "
              "is then read by the CRC-32 and copied into the shard (or the optimizer's state): "
              "with 4 ranks on 2 cores these passes, not the disk, bound the load, which is why "
              "it stays far below the page cache's read bandwidth; torch.load is one process "
              "with the machine to itself and no checksum.", ""]
    provenance.write(a.out, "\n".join(lines), a.provenance)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
