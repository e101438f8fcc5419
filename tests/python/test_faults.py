"""Faults without a launcher (issue 26): 4 ranks of examples/train_tiny.py over 2 daemons, each
rank started on its own (no ragshard.launch to stop the others). A daemon stopped with SIGSTOP,
or a rank killed with SIGKILL: every surviving rank must fail by itself, with an error that
names the node or the rank, within the deadline (twice the issue's, for CI's busy machine):
  * SIGSTOP of a daemon: 40 s (the ranks of the other node hear it from the planner, which
    marked the node lost; the stopped daemon's own ranks get no answer for the client's peer
    timeout, 30 s, and name their daemon);
  * kill -9 of a rank: 10 s (its daemon reports it; the planner tells the other daemons);
  * kill -9 of a daemon: 10 s (its ranks find their daemon unreachable; the other daemon loses
    its peer, or hears from the planner)."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ragshard import create_job
from ragshard.cluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
SLACK = 2.0  # CI's 2-core machine is busy: twice the deadline


def start_ranks(c, job, logdir):
    """4 ranks, 2 per daemon, each its own process with the environment ragshard.launch gives."""
    create_job(c.planner, job, 4)
    procs, logs = [], []
    for r in range(4):
        env = dict(os.environ, RAGSHARD_PLANNER=c.planner, RAGSHARD_JOB=job,
                   RAGSHARD_RANK=str(r), RAGSHARD_WORLD_SIZE="4",
                   RAGSHARD_SOCKET=c.sockets[r // 2], RAGSHARD_NODE=c.nodes[r // 2])
        log = open(os.path.join(logdir, f"rank{r}.log"), "w+")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "train_tiny.py"), "--steps", "100000",
             "--layers", "2", "--dim", "64"], env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs


def text(log):
    log.flush()
    with open(log.name) as f:
        return f.read()


def wait_for_steps(procs, logs, steps=3, timeout=180.0):
    """Until rank 0 has printed `steps` steps: training is under way on every rank."""
    deadline = time.time() + timeout
    while f"step {steps}/" not in text(logs[0]):
        for r, p in enumerate(procs):
            assert p.poll() is None, f"rank {r} exited early: {text(logs[r])[-3000:]}"
        assert time.time() < deadline, f"no step {steps} in {timeout} s: {text(logs[0])[-3000:]}"
        time.sleep(0.1)


def wait_exits(procs, ranks, timeout):
    """Each rank's exit code and seconds from now until it exited (None: still running)."""
    start = time.time()
    out = {}
    while len(out) < len(ranks) and time.time() - start < timeout:
        for r in ranks:
            if r not in out and procs[r].poll() is not None:
                out[r] = (procs[r].returncode, time.time() - start)
        time.sleep(0.05)
    return out


def report(exits, logs):
    """Each rank's time to fail and the last line of its error, for the test's log."""
    for r, (code, seconds) in sorted(exits.items()):
        last = [ln for ln in text(logs[r]).splitlines() if ln.strip()][-1:]
        print(f"rank {r}: exit {code} after {seconds:.1f} s: {last[0][:300] if last else ''}")


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_stopped_daemon_is_named_by_every_rank_within_the_deadline():
    with tempfile.TemporaryDirectory() as logdir, LocalCluster(BUILD, daemons=2) as c:
        procs, logs = start_ranks(c, "stopped-daemon", logdir)
        daemon1 = c.procs[2]  # planner, daemon node-0, daemon node-1
        try:
            wait_for_steps(procs, logs)
            os.kill(daemon1.pid, signal.SIGSTOP)
            exits = wait_exits(procs, range(4), 40 * SLACK)
            for r in range(4):
                assert r in exits, f"rank {r} still running {40 * SLACK} s after the daemon stopped"
                code, seconds = exits[r]
                assert code != 0, f"rank {r} exited 0"
                out = text(logs[r])
                assert "node-1" in out, f"rank {r}'s error does not name node-1: {out[-2000:]}"
            report(exits, logs)
        finally:
            os.kill(daemon1.pid, signal.SIGCONT)
            stop_all(procs)


def test_a_killed_rank_is_named_by_every_survivor_within_the_deadline():
    with tempfile.TemporaryDirectory() as logdir, LocalCluster(BUILD, daemons=2) as c:
        procs, logs = start_ranks(c, "killed-rank", logdir)
        try:
            wait_for_steps(procs, logs)
            procs[3].kill()
            exits = wait_exits(procs, [0, 1, 2], 10 * SLACK)
            for r in (0, 1, 2):
                assert r in exits, f"rank {r} still running {10 * SLACK} s after rank 3 died"
                assert exits[r][0] != 0
                out = text(logs[r])
                assert "rank 3" in out, f"rank {r}'s error does not name rank 3: {out[-2000:]}"
            report(exits, logs)
        finally:
            stop_all(procs)


def test_a_killed_daemon_is_named_by_every_rank_within_the_deadline():
    with tempfile.TemporaryDirectory() as logdir, LocalCluster(BUILD, daemons=2) as c:
        procs, logs = start_ranks(c, "killed-daemon", logdir)
        try:
            wait_for_steps(procs, logs)
            c.procs[2].kill()  # daemon node-1
            exits = wait_exits(procs, range(4), 10 * SLACK)
            for r in range(4):
                assert r in exits, f"rank {r} still running {10 * SLACK} s after node-1 died"
                assert exits[r][0] != 0
                out = text(logs[r])
                assert "node-1" in out, f"rank {r}'s error does not name node-1: {out[-2000:]}"
            report(exits, logs)
        finally:
            stop_all(procs)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
