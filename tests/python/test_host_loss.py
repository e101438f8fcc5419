"""A node lost as a host is lost: without a reset. Its daemon stops answering (SIGSTOP: its
connections stay open, nothing it holds is closed, its heartbeats stop) and a replacement
daemon with its node id registers long before the planner's node timeout (60 s here) runs out.
The planner tells the daemons apart by their incarnation (RegisterNodeRequest.incarnation): a
registration of an UP node id by another daemon counts the one before as lost, so the job
recovers in place on the replacement at once, equal to an uninterrupted run. Before, the new
registration silently replaced the old one: no recovery began, and the other nodes' ranks waited
in a collective with the silent daemon until their operations' deadline.

When the silent daemon comes back (SIGCONT), the planner refuses its heartbeats as stale, and it
fails its jobs' operations naming why and exits (status 3) at once, leaving the replacement's
sockets alone (docs/recovery.md, "A lost node")."""
import os
import signal
import subprocess
import sys
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch
# beside this file; it puts the build's package on the path
from cluster_runs import BUILD, ROOT, ctl, env

from ragshard.cluster import LocalCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch"]
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "6", "--optimizer", "adamw"]
NODE_TIMEOUT_MS = 60000  # far beyond the test: only the new registration can start the recovery


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, node_timeout_ms=NODE_TIMEOUT_MS,
                      heartbeat_ms=250) as c:
        yield c


def command(cluster, tmp_path, job, extra=()):
    out = str(tmp_path / job)
    return out, LAUNCH + ["--planner", cluster.planner, "--job", job, "--create-job",
                          "--nproc", "4", "--sockets", ",".join(cluster.sockets),
                          "--redundancy", "replica", "--max-restarts", "1",
                          "--recovery-deadline", "90", EXAMPLE, "--out", out] + SMALL + list(extra)


def wait_for(what, predicate, seconds=120):
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_a_host_lost_without_a_reset_is_replaced_before_the_node_timeout(cluster, tmp_path):
    ref, cmd = command(cluster, tmp_path, "host-ref")
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    job = "host-lost"
    marks = [str(tmp_path / f"hold{r}") for r in (2, 3)]
    out, cmd = command(cluster, tmp_path, job,
                       [f"--hold-at={r}:3:forward:{m}" for r, m in zip((2, 3), marks)])
    silent = cluster._daemons[1]
    # (a session of its own: a failure below ends the launcher and every rank it started)
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 240
        while not all(os.path.exists(m) for m in marks):
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline, "node-1's ranks did not reach the hold"
            time.sleep(0.05)
        # The host goes silent: its daemon stops, holding every connection open.
        silent.send_signal(signal.SIGSTOP)
        started = time.time()
        cluster.start_daemon(1, log_suffix="-replacement")
        # The replacement's registration alone starts the recovery (the node timeout is far off).
        wait_for("the replacement's registration started no recovery",
                 lambda: "RECOVERING" in ctl(cluster, "job", "show", job).stdout, 30)
        assert time.time() - started < NODE_TIMEOUT_MS / 1000 / 2
        for m in marks:  # the host's ranks were lost with it; the launcher starts them again
            with open(m) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stdout + stderr
        shown = ctl(cluster, "job", "show", job).stdout
        assert "another daemon registered with its id" in shown, shown
        assert "recoveries:   1 recovery" in shown, shown

        # The silent daemon comes back: refused as stale, it ends without touching the
        # replacement's socket.
        silent.send_signal(signal.SIGCONT)
        assert silent.wait(timeout=60) == 3  # (kStaleExitCode)
        with open(os.path.join(cluster.dir, "daemon1.log")) as f:
            log = f.read()
        assert "is stale: another daemon" in log and "ragshardd exits" in log, log[-3000:]
        assert cluster._daemons[1].poll() is None
        assert os.path.exists(cluster.sockets[1]) and os.path.exists(cluster.sockets[1] + ".fd")
        nodes = ctl(cluster, "nodes").stdout
        assert nodes.count("node-1") == 1 and "LOST" not in nodes, nodes
    finally:
        if silent.poll() is None:
            silent.kill()
            silent.wait()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()

    a, b = torch.load(out + ".pt"), torch.load(ref + ".pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
