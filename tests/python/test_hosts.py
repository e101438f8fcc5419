"""Hosts of their own (ragshard.hosts) and a cluster on them (ragshard.cluster.NamespacedCluster):
each host a network namespace with its own address on a private bridge and a private /tmp.

What a test may count on from them: a host's /tmp is its own; hosts reach each other's
addresses and this process reaches none; a host whose link goes down leaves its peers' packets
unanswered (no reset: a connection attempt times out rather than being refused); and nothing
of them remains afterwards, also when the block fails. And a training across such hosts (a
planner and two daemons each on its own host, a launcher on each daemon's host starting its two
ranks: --nnodes 2 --node-rank K) ends equal to the same training on loopback.

Namespaces need root: where they cannot be made the tests fail naming why when
RAGSHARD_REQUIRE_NAMESPACES=1 (.ci/run sets it) and skip with that reason elsewhere."""
import os
import socket
import subprocess
import sys

import pytest
import torch
# beside this file; it puts the build's package on the path
from cluster_runs import BUILD, ROOT, env

from ragshard import hosts as hosts_module  # noqa: E402
from ragshard.cluster import LocalCluster, NamespacedCluster  # noqa: E402
from ragshard.hosts import Hosts  # noqa: E402

WHY = hosts_module.unavailable()
if WHY:
    if os.environ.get("RAGSHARD_REQUIRE_NAMESPACES") == "1":
        pytest.fail(f"hosts in namespaces are required here: {WHY}", pytrace=False)
    pytest.skip(WHY, allow_module_level=True)

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "4", "--optimizer", "adamw"]

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
    with Hosts(["a", "b"]) as h:
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
        holders = [h.holder(n) for n in h.names]
    assert tag not in namespaces()
    for pid in holders:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"

    # A block that fails is cleaned up too.
    with pytest.raises(RuntimeError, match="on purpose"):
        with Hosts(["c"]) as h:
            tag = h.tag
            raise RuntimeError("on purpose")
    assert tag not in namespaces()


def test_a_training_across_hosts_ends_as_on_loopback(tmp_path):
    # The same training on loopback, through ragshard.launch.
    ref = str(tmp_path / "loopback")
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", c.planner,
                            "--job", "loop", "--create-job", "--nproc", "4", "--sockets",
                            ",".join(c.sockets), EXAMPLE, "--out", ref] + SMALL,
                           env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr

    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
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
        a = torch.load(out + ".pt")
    b = torch.load(ref + ".pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
