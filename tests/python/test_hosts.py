"""Hosts of their own (ragshard.hosts) and a cluster on them (ragshard.cluster.NamespacedCluster):
each host a network namespace with its own address on a private bridge and a private /tmp.

What a test may count on from them: a host's /tmp is its own; hosts reach each other's
addresses and this process reaches none; a host whose link goes down leaves its peers' packets
unanswered (no reset: a connection attempt times out rather than being refused); and nothing
of them remains afterwards, also when the block fails. And a training across such hosts (a
planner and two daemons each on its own host, a launcher on each daemon's host starting its two
ranks: --nnodes 2 --node-rank K) ends equal to the same training on loopback; and where one of
those hosts is lost without a reset (its link down, then everything on it killed) and replaced
on a spare host, the training recovers in place and ends equal to the uninterrupted one. The same
training started by torchrun on each host (--nnodes 2 --node-rank K) ends equal to it too.

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import os
import socket
import subprocess
import sys
import time

import pytest
# beside this file; it puts the build's package on the path
from cluster_runs import BUILD, ROOT, env, require_namespaces
from host_runs import (EXAMPLE, SMALL, assert_same, finish, held, launchers, lose_host,
                       loopback_reference, stop)

from ragshard.cluster import NamespacedCluster  # noqa: E402
from ragshard.hosts import Hosts  # noqa: E402

require_namespaces()

# A server on a host: prints its port, answers one connection with "pong".
SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(b"pong"); c.close()
"""
# A client on a host: "pong", "timeout" or "refused" (or the error's name).
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print(c.recv(4).decode())
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print(type(e).__name__, e.errno)
"""


def namespaces():
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return r.stdout


def test_hosts_have_their_own_tmp_reach_each_other_only_and_leave_nothing(tmp_path):
    with Hosts(["a", "b"], shared=[sys.prefix]) as h:  # (the interpreter, under /tmp in CI)
        tag = h.tag
        assert tag in namespaces()
        # Their own /tmp.
        assert h.run("a", ["sh", "-c", "echo mine > /tmp/only-a"]).returncode == 0
        assert h.run("b", ["test", "-e", "/tmp/only-a"]).returncode != 0
        assert not os.path.exists("/tmp/only-a")
        with open(h.seen("a", "/tmp/only-a")) as f:
            assert f.read() == "mine\n"
        # The hosts reach each other; this process reaches neither.
        server = h.spawn("b", [sys.executable, "-c", SERVER, h.address("b")],
                         stdout=subprocess.PIPE, text=True)
        port = server.stdout.readline().strip()
        got = h.run("a", [sys.executable, "-c", CLIENT, h.address("b"), port, "10"],
                    capture_output=True, text=True)
        assert got.stdout.strip() == "pong", got
        assert server.wait(timeout=30) == 0
        with pytest.raises(OSError):
            socket.create_connection((h.address("b"), int(port)), timeout=2)
        # A link down: no answer at all, not a refusal (the port is closed now, so a host that
        # answered would refuse at once).
        h.link_down("b")
        got = h.run("a", [sys.executable, "-c", CLIENT, h.address("b"), port, "1"],
                    capture_output=True, text=True)
        assert got.stdout.strip() == "timeout", got
        h.link_up("b")
        got = h.run("a", [sys.executable, "-c", CLIENT, h.address("b"), port, "10"],
                    capture_output=True, text=True)
        assert got.stdout.strip() == "refused", got
        # A lossy link: every packet dropped is a link that does not answer; none, it answers.
        h.lossy("b", 100)
        got = h.run("a", [sys.executable, "-c", CLIENT, h.address("b"), port, "1"],
                    capture_output=True, text=True)
        assert got.stdout.strip() == "timeout", got
        h.lossy("b", 0)
        got = h.run("a", [sys.executable, "-c", CLIENT, h.address("b"), port, "10"],
                    capture_output=True, text=True)
        assert got.stdout.strip() == "refused", got
        with pytest.raises(ValueError, match="percent: 101 is not in"):
            h.lossy("b", 101)
        holders = [h.holder(n) for n in h.names]
    assert tag not in namespaces()
    for pid in holders:
        gone = not os.path.exists(f"/proc/{pid}")
        assert gone or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

    # A block that fails is cleaned up too.
    with pytest.raises(RuntimeError, match="on purpose"):
        with Hosts(["c"]) as h:
            tag = h.tag
            raise RuntimeError("on purpose")
    assert tag not in namespaces()


def test_a_training_across_hosts_ends_as_on_loopback(tmp_path):
    ref = loopback_reference(str(tmp_path / "loopback"))  # through ragshard.launch
    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20, shared=[ROOT]) as c:
        out = os.path.join(c.dir, "hosts")  # (outside /tmp, which each host has of its own)
        # The daemons registered from their hosts' addresses (ragshardctl on the planner's host).
        nodes = c.run("planner", [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner",
                                  c.planner, "--token-file", c.token_file, "nodes"],
                      capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0, nodes.stderr
        for node in c.nodes:
            assert node in nodes.stdout
            assert c.hosts.address(node) in nodes.stdout, nodes.stdout
        # One launcher per host (--nnodes 2 --node-rank K), each starting its host's two ranks
        # on its daemon; host 0 creates the job.
        launchers = [c.spawn(node, [sys.executable, "-m", "ragshard.launch", "--planner",
                                    c.planner, "--job", "across", "--create-job", "--nproc", "4",
                                    "--nnodes", "2", "--node-rank", str(k), "--sockets",
                                    c.sockets[k], "--nodes", node, EXAMPLE, "--out", out] + SMALL,
                             env=c.env(PYTHONPATH=env()["PYTHONPATH"]), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
                     for k, node in enumerate(c.nodes)]
        try:
            for k, p in enumerate(launchers):
                text = p.communicate(timeout=300)[0]
                assert p.returncode == 0, f"host {k}'s launcher: {text[-3000:]}"
        finally:
            for p in launchers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert_same(out, ref)


def test_torchrun_across_hosts_ends_as_ragshard_launch(tmp_path):
    # torchrun on each daemon's host (--nnodes 2 --node-rank K, its static rendezvous at host
    # 0's address, two workers each), the ranks finding the planner, the job and their daemon
    # from the environment (docs/training.md): the same training as one ragshard-launch per host.
    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20, shared=[ROOT]) as c:
        ref, out = os.path.join(c.dir, "launch"), os.path.join(c.dir, "torchrun")
        finish(launchers(c, "launch", ref, enumerate(c.nodes)))
        procs = {}
        for k, node in enumerate(c.nodes):
            e = c.env(PYTHONPATH=env()["PYTHONPATH"], RAGSHARD_JOB="torchrun",
                      RAGSHARD_SOCKET=c.sockets[k], RAGSHARD_NODE=node)
            for name in ("RAGSHARD_RANK", "RAGSHARD_WORLD_SIZE"):
                e.pop(name, None)
            procs[k] = c.spawn(node, [sys.executable, "-m", "torch.distributed.run",
                                      "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node",
                                      "2", "--master-addr", c.hosts.address("node-0"),
                                      "--master-port", "29500", EXAMPLE, "--out", out] + SMALL,
                               env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
        finish(procs)
        shown = c.run("planner", [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner",
                                  c.planner, "--token-file", c.token_file, "job", "show",
                                  "torchrun"], capture_output=True, text=True, timeout=60).stdout
        for node in c.nodes:  # each host's two ranks on its own daemon
            assert f"node {node}: 2 rank(s)" in shown, shown
        assert_same(out, ref)  # (inside: the cluster's directory goes with it)


def test_a_host_lost_without_a_reset_recovers_on_a_spare_host(tmp_path):
    # Node-1's host loses its link in the middle of step 3 (its ranks held there), and everything
    # on it dies with no packet leaving it: no connection of it is reset. A replacement daemon
    # with its node id starts on a spare host, long before the planner's node timeout (60 s), with
    # a launcher for node rank 1 there. The job recovers in place and ends equal to the same
    # training uninterrupted.
    with NamespacedCluster(BUILD, daemons=2, spare_hosts=1, pool_bytes=128 << 20,
                           node_timeout_ms=60000, heartbeat_ms=250, shared=[ROOT]) as c:
        ref, out = os.path.join(c.dir, "ref"), os.path.join(c.dir, "lost")
        finish(launchers(c, "ref", ref, enumerate(c.nodes)))
        marks = [os.path.join(c.dir, f"hold{r}") for r in (2, 3)]
        procs = launchers(c, "lost", out, enumerate(c.nodes),
                          [f"--hold-at={r}:3:forward:{m}" for r, m in zip((2, 3), marks)])
        try:
            held(procs, marks)
            lose_host(c, procs, 1)  # its link down, then everything on it dies
            started = time.time()
            c.start_daemon(1, log_suffix="-replacement", host="spare-0")
            procs[1] = launchers(c, "lost", out, [(1, "spare-0")])[1]
            finish(procs)
            assert time.time() - started < 60, "the recovery waited for the node timeout"
            shown = c.run("planner", [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner",
                                      c.planner, "--token-file", c.token_file, "job", "show",
                                      "lost"], capture_output=True, text=True, timeout=60).stdout
            assert "another daemon registered with its id" in shown, shown
            assert "recoveries:   1 recovery" in shown, shown
        finally:
            stop(procs.values())
        assert_same(out, ref, atol=1e-6)
