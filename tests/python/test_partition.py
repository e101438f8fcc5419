"""A partition on hosts of their own (ragshard.cluster.NamespacedCluster; docs/recovery.md,
"Partitions and fencing"): a host whose link goes down while everything on it lives.

train_tiny 2 hosts x 2 ranks, --max-restarts 1 --redundancy replica; node-1's two ranks are held
at step 3's forward; its host's link goes down and the ranks are let go, into an operation
that cannot reach node-0. Its daemon has no heartbeat acknowledged, and once its lease (three
quarters of the planner's node timeout) runs out it fences itself: its jobs' operations fail
naming the fence, its ranks exit and its launcher gives up, named, all before the planner
declares the node lost. Then a replacement daemon with node-1's id starts on a spare host with
a launcher for node rank 1, and the job recovers in place and ends equal to the same training
uninterrupted (within 1e-6). When the link returns, the partitioned daemon learns that another
holds its node id and exits, named; nothing of it reached the job.

A short partition (longer than the lease, shorter than the node timeout): node-1's link comes
back as soon as its daemon fenced itself, before the planner counts the node lost. The fence
started a recovery in place on node-1 (its state kept; its ranks left on the notice, and their
restarts waited for the fence to end); once the planner hears node-1 again the job recovers in
place on the same two hosts and ends equal to the uninterrupted training (within 1e-6), READY
with one recovery.

And a lossy link (Hosts.lossy: node-1's host drops 5 % of its packets each way, at random, for
the whole training): the job is slower, nothing is fenced, and it ends equal to the same
training on clean links.

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import os
import time

from cluster_runs import BUILD, ROOT, require_namespaces  # beside this file; the package
from host_runs import assert_same, ctl, finish, held, launchers, partition, stop

from ragshard.cluster import NamespacedCluster  # noqa: E402

require_namespaces()

NODE_TIMEOUT_MS = 6000
LEASE_S = NODE_TIMEOUT_MS * 3 / 4 / 1000
STALE_EXIT = 3  # ragshardd's exit status when the planner refuses it as stale (kStaleExitCode)


def held_at_step_3(c, job, **more_env):
    """The uninterrupted run, then `job`'s launchers with node-1's two ranks held at step 3's
    forward: the two runs' outputs, the launchers and the holds' marks."""
    ref, out = os.path.join(c.dir, "ref"), os.path.join(c.dir, job)
    finish(launchers(c, "ref", ref, enumerate(c.nodes)))
    marks = [os.path.join(c.dir, f"hold{r}") for r in (2, 3)]
    procs = launchers(c, job, out, enumerate(c.nodes),
                      [f"--hold-at={r}:3:forward:{m}" for r, m in zip((2, 3), marks)],
                      **more_env)
    return ref, out, procs, marks


def test_a_partitioned_host_fences_itself_and_the_job_recovers_without_it():
    with NamespacedCluster(BUILD, daemons=2, spare_hosts=1, pool_bytes=128 << 20,
                           node_timeout_ms=NODE_TIMEOUT_MS, heartbeat_ms=250,
                           shared=[ROOT]) as c:
        # The partitioned host's launcher restarts its ranks once: their registrations wait at
        # the fenced daemon until the node timeout would count the node lost, then fail naming
        # the fence (their planner calls give up after 5 s, RAGSHARD_PLANNER_RETRY_S).
        ref, out, procs, marks = held_at_step_3(c, "cut", RAGSHARD_PLANNER_RETRY_S="5")
        old, cut_off = c.daemon(1), None
        try:
            pids = held(procs, marks)
            cut, stopped = partition(c, "node-1", marks, pids, LEASE_S)
            assert old.poll() is None, "the partitioned daemon lives on, fenced"
            # The replacement: node-1's id on a spare host, with a launcher for node rank 1.
            c.start_daemon(1, log_suffix="-replacement", host="spare-0")
            cut_off = procs.pop(1)
            procs.update(launchers(c, "cut", out, [(1, "spare-0")]))
            text = cut_off.communicate(timeout=300)[0]
            print(f"node-1's ranks stopped {stopped:.1f} s after the cut; its launcher exited "
                  f"{time.time() - cut:.1f} s after it")
            assert cut_off.returncode != 0, text[-4000:]
            assert "this node is fenced: the planner acknowledged no heartbeat for" in text, \
                text[-4000:]
            finish(procs)
            print(f"the job ended {time.time() - cut:.1f} s after the cut")
            # The link returns: the old daemon is refused as stale and exits, named.
            c.hosts.link_up("node-1")
            assert old.wait(timeout=120) == STALE_EXIT
            print(f"the old daemon exited {time.time() - cut:.1f} s after the cut")
            with open(os.path.join(c.dir, "daemon1.log")) as f:
                log = f.read()
            assert "this node is fenced" in log and "refuses this daemon's heartbeat" in log, \
                log[-4000:]
        finally:
            stop(list(procs.values()) + [cut_off] * (cut_off is not None))
        assert_same(out, ref, atol=1e-6)


def test_a_lossy_link_slows_the_job_and_changes_nothing():
    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20,
                           node_timeout_ms=NODE_TIMEOUT_MS, heartbeat_ms=250,
                           shared=[ROOT]) as c:
        ref, out = os.path.join(c.dir, "ref"), os.path.join(c.dir, "lossy")
        finish(launchers(c, "ref", ref, enumerate(c.nodes)))
        c.hosts.lossy("node-1", 5)
        started = time.time()
        finish(launchers(c, "lossy", out, enumerate(c.nodes)), timeout=600)
        print(f"the training took {time.time() - started:.1f} s with 5 % of node-1's packets "
              "dropped")
        c.hosts.lossy("node-1", 0)
        with open(os.path.join(c.dir, "daemon1.log")) as f:
            assert "fenced" not in f.read()
        assert_same(out, ref)


# The short partition's node timeout: its lease is 12 s, and 4 s pass between the fence and the
# planner counting the node lost, for the link to come back and a heartbeat to get through.
SHORT_NODE_TIMEOUT_MS = 16000


def until_logged(path, text, seconds):
    """Waits until the log at `path` holds `text`; its contents."""
    deadline, log = time.time() + seconds, ""
    while text not in log:
        assert time.time() < deadline, f"no {text!r} in {path} in {seconds} s: {log[-4000:]}"
        time.sleep(0.05)
        with open(path) as f:
            log = f.read()
    return log


def test_a_short_partition_is_recovered_in_place():
    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20,
                           node_timeout_ms=SHORT_NODE_TIMEOUT_MS, heartbeat_ms=250,
                           shared=[ROOT]) as c:
        ref, out, procs, marks = held_at_step_3(c, "short")
        log = os.path.join(c.dir, "daemon1.log")
        try:
            held(procs, marks)
            c.hosts.link_down("node-1")
            cut = time.time()
            for m in marks:
                os.unlink(m)
            until_logged(log, "this node is fenced", SHORT_NODE_TIMEOUT_MS / 1000 + 30)
            c.hosts.link_up("node-1")
            print(f"node-1's link came back {time.time() - cut:.1f} s after the cut, "
                  "once its daemon fenced itself")
            got = finish(procs)
            print(f"the job ended {time.time() - cut:.1f} s after the cut")
        finally:
            stop(procs.values())
        # node-1's ranks left on the recovery the fence started, and their launcher restarted
        # them; the daemon that fenced itself lives on with its node id, its fence ended.
        assert "ragshard recovery in progress: this node is fenced" in got[1], got[1][-4000:]
        assert c.daemon(1).poll() is None
        until_logged(log, "the fence ends", 30)
        show = ctl(c, "job", "show", "short")
        assert "READY" in show and "recoveries:   1 recovery" in show, show
        assert_same(out, ref, atol=1e-6)
