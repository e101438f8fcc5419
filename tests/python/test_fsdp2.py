"""ragshard against torch's own FSDP2 (`torch.distributed.fsdp.fully_shard` on every layer and
the root, over gloo on a CPU device mesh): the same model, seed, data and AdamW through
`examples/train_tiny.py`, 2 ranks, 3 steps, fp32. The loss at every step must agree within a
relative 1e-5, and so must the final parameters (‖Δ‖/‖p‖).

The FSDP2 ranks are plain subprocesses with RANK and WORLD_SIZE set that meet through a
FileStore in the test's temporary directory; every wait has a timeout and every process is
killed on the way out, whatever happened."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

from ragshard.cluster import LocalCluster  # noqa: E402
from test_training import LAUNCH  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# The small model of tests/python/test_training.py.
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet"]
WORLD = 2
STEPS = 3
RTOL = 1e-5
TIMEOUT = 600  # seconds for a whole run, generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        yield c


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONFAULTHANDLER"] = "1"  # a Python stack in the log if a rank aborts
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def run_ragshard(cluster, tmp_path, job, extra):
    out = str(tmp_path / job)
    cmd = LAUNCH + ["--planner", cluster.planner, "--job", job,
                    "--nproc", str(WORLD), "--sockets", ",".join(cluster.sockets),
                    "--create-job", EXAMPLE, "--out", out] + SMALL + extra
    # A session of its own: on a timeout the launcher and the ranks it started go together.
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        text = p.communicate(timeout=TIMEOUT)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 0, text
    return out


def run_fsdp2(tmp_path, name, extra):
    """WORLD processes of train_tiny.py --fsdp2, each with its own log file (no pipe that a
    rank could fill while another is being waited for)."""
    out = str(tmp_path / name)
    store = str(tmp_path / (name + ".store"))  # a fresh FileStore path for this run
    cmd = [sys.executable, EXAMPLE, "--fsdp2", store, "--out", out] + SMALL + extra
    procs, logs = [], []
    try:
        for r in range(WORLD):
            log = open(f"{out}.log{r}", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=dict(env(), RANK=str(r),
                                                        WORLD_SIZE=str(WORLD),
                                                        OMP_NUM_THREADS="1"),
                                          stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
        # Wait for whichever rank ends first; when one fails, the others (which may be waiting
        # for it in a collective) are killed at once instead of at the timeout.
        ended = queue.Queue()
        for p in procs:
            threading.Thread(target=lambda p=p: ended.put(p.wait()), daemon=True).start()
        deadline = time.monotonic() + TIMEOUT
        try:
            for _ in procs:
                if ended.get(timeout=max(1.0, deadline - time.monotonic())) != 0:
                    break
        except queue.Empty:  # timed out: the ranks still running are killed below
            pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    assert codes == [0] * WORLD, "\n".join(
        f"--- rank {r} exited with {c}:\n{t[-4000:]}" for r, (c, t) in
        enumerate(zip(codes, texts)))
    return out


def test_fp32_losses_match_torch_fsdp2(cluster, tmp_path):
    extra = ["--steps", str(STEPS)]
    fsdp2 = run_fsdp2(tmp_path, "fsdp2", extra)
    ours = run_ragshard(cluster, tmp_path, "fsdp2-parity", extra)

    a = json.load(open(ours + ".json"))["losses"]
    b = json.load(open(fsdp2 + ".json"))["losses"]
    assert len(a) == len(b) == STEPS
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= RTOL * abs(y), f"step {step + 1}: ragshard {x} vs FSDP2 {y}"
    assert a[-1] < a[0]  # it learns

    pa, pb = torch.load(ours + ".pt"), torch.load(fsdp2 + ".pt")
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pb[name].dtype == torch.float32
        rel = float((pa[name] - pb[name]).norm() / pb[name].norm().clamp_min(1e-12))
        assert rel <= RTOL, f"{name}: |delta|/|p| = {rel:.3g}"

    # FSDP2 really sharded: each rank held about 1/W of the parameters.
    for r in range(WORLD):
        rank = json.load(open(f"{fsdp2}.rank{r}.json"))
        assert len(rank["step_seconds"]) == STEPS and rank["max_rss_bytes"] > 0
        assert rank["local_param_elems"] <= rank["param_elems"] // WORLD + 64 * 64, rank
