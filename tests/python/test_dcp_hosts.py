"""DCP checkpoints on hosts of their own (ragshard.cluster.NamespacedCluster): three hosts, each
with its own network namespace and a private /tmp, sharing only the checkpoint directory (the
cluster's work directory, outside /tmp, as NFS would be). save_dcp's plans and results travel
through the job's keys on the planner, so nothing but the checkpoint itself is shared.

* ragshard at 3 hosts x 2 ranks (examples/train_hf.py's Llama, one launcher per host:
  --nnodes 3 --node-rank K) writes a DCP checkpoint after step 4; FSDP2 at W=2 continues it.
* FSDP2 at W=4 writes one after step 4; ragshard at 3 hosts x 1 rank continues it.
  Each continuation's steps 5-8 match its writer's within 1e-5 (test_porting.py's check).
* A save to a path under /tmp, which each host has of its own, fails on every rank naming the
  directory the other hosts do not see, and leaves no checkpoint on any host: save_dcp's, and
  ragshard's own format's (checkpoint.save, through examples/train_tiny.py --save).

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import os

import pytest
from cluster_runs import BUILD, ROOT, require_namespaces  # beside this file
from test_porting import (EXAMPLE, SAVE_AFTER, STEPS, check_continuation, launch_on_hosts,
                          run_fsdp2, run_ragshard)

from ragshard.cluster import NamespacedCluster  # noqa: E402

require_namespaces()

HOSTS = 3
BATCH = ["--global-batch", "12"]  # splits evenly over 2, 3, 4 and 6 ranks


@pytest.fixture(scope="module")
def cluster():
    with NamespacedCluster(BUILD, daemons=HOSTS, pool_bytes=128 << 20, shared=[ROOT]) as c:
        yield c


HF = [EXAMPLE, "--backend", "ragshard", "--quiet", "--model", "llama", "--steps", str(STEPS)] + \
    BATCH
TINY = [os.path.join(ROOT, "examples", "train_tiny.py"), "--layers", "1", "--dim", "32",
        "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "16", "--quiet", "--steps", "2"]


def ragshard_run(c, name, nproc, args):
    return run_ragshard(c, c.dir, name, nproc, HOSTS, ["--model", "llama", "--steps", str(STEPS)]
                        + BATCH + args)


def test_checkpoints_cross_to_fsdp2_and_back_with_only_the_checkpoint_shared(cluster):
    c = cluster
    ours = os.path.join(c.dir, "ragshard-ckpt")
    writer = ragshard_run(c, "ragshard-writes", 2 * HOSTS,
                          ["--save-dcp", ours, "--save-after", str(SAVE_AFTER)])
    assert writer["world"] == 2 * HOSTS
    assert ".metadata" in os.listdir(ours) and not os.path.exists(ours + ".partial")
    cont = run_fsdp2(c.dir, "fsdp2-continues", 2, ["--model", "llama", "--steps", str(STEPS),
                                                   "--load-dcp", ours] + BATCH)
    check_continuation(cont, writer, "FSDP2 W=2 from ragshard 3 hosts x 2's checkpoint")

    theirs = os.path.join(c.dir, "fsdp2-ckpt")
    fsdp2 = run_fsdp2(c.dir, "fsdp2-writes", 4, ["--model", "llama", "--steps", str(STEPS),
                                                 "--save-dcp", theirs, "--save-after",
                                                 str(SAVE_AFTER)] + BATCH)
    cont = ragshard_run(c, "ragshard-continues", HOSTS, ["--load-dcp", theirs])
    assert cont["world"] == HOSTS
    check_continuation(cont, fsdp2, "ragshard 3 hosts x 1 from FSDP2 W=4's checkpoint")


def test_a_save_where_other_hosts_cannot_see_it_fails_on_every_rank(cluster):
    c = cluster
    private = "/tmp/private-ckpt"  # each host's own /tmp
    for fmt, script, args, staging, leftovers in [
            ("save_dcp", HF, ["--steps", "2", "--save-dcp", private, "--save-after", "1"],
             private + ".partial", [private, private + ".partial"]),
            ("save", TINY, ["--save", private, "--save-step", "1"],
             os.path.join(private, ".step_00000001.partial"),
             [os.path.join(private, ".step_00000001.partial"),
              os.path.join(private, "step_00000001")])]:
        got = launch_on_hosts(c, f"private-{fmt.replace('_', '-')}", HOSTS, HOSTS,
                              script + args)
        for k, (code, text) in enumerate(got):
            assert code != 0, f"{fmt}: host {k}'s launcher exited 0:\n{text[-3000:]}"
            if k == 0:  # rank 0 sees its own directory; it learns the others failed
                assert f"{fmt}: another rank failed; nothing was committed" in text, \
                    text[-3000:]
            else:
                assert f"{fmt}: rank {k} (host " in text and "does not see the directory rank " \
                    f"0 made for the save, {staging} (absent here)" in text, text[-3000:]
                assert "filesystem every rank's host shares" in text
        for node in c.nodes:
            for path in leftovers:
                assert not os.path.exists(c.hosts.seen(node, path)), (fmt, node, path)
