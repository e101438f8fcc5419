"""deploy/slurm/ragshard.sbatch across hosts of their own (ragshard.cluster.NamespacedCluster):
a Slurm of two nodes, each a host with its own address and /tmp (Debian's slurmd, one on each,
`-N sn0` and `-N sn1`), slurmctld and the ragshard planner on a third, munged here. `sbatch
--nodes 2 --ntasks-per-node 2` runs the script on sn0; it starts a daemon on each node (srun,
one task per node), creates the job at the planner and starts the 4 ranks (srun), which read who
they are from srun's variables. The training ends equal to the same training under
ragshard-launch on loopback, each node's two ranks on its own daemon, and nothing of the job is
left running.

Needs root (namespaces: cluster_runs.require_namespaces says what happens without) and Slurm's
programs (skipped, naming them, where they are not installed; scripts/install-deps.sh installs
them)."""
import json
import os
import sys

# beside these files; they put the build's package on the path
from cluster_runs import BUILD, ROOT, env, require_namespaces
from host_runs import EXAMPLE, SMALL, assert_same, loopback_reference
from slurm_runs import SlurmCluster, require_slurm, which
from test_slurm import SCRIPT

from ragshard.cluster import NamespacedCluster  # noqa: E402

require_namespaces()

NODES = {"sn0": "spare-0", "sn1": "spare-1"}  # Slurm's node name -> its host


def test_sbatch_across_hosts_ends_as_ragshard_launch(tmp_path):
    require_slurm()
    ref = loopback_reference(str(tmp_path / "loopback"))

    with NamespacedCluster(BUILD, daemons=0, spare_hosts=len(NODES), shared=[ROOT]) as c:
        slurm = SlurmCluster(os.path.join(c.dir, "slurm"), c.hosts, NODES)
        try:
            slurm.start()
            out, log = os.path.join(c.dir, "run"), os.path.join(c.dir, "job.out")
            bindir = os.path.join(c.dir, "bin")  # the programs as installed: one directory
            os.makedirs(bindir)
            for prog in ("server/ragshard-planner", "server/ragshardd", "ctl/ragshardctl"):
                os.symlink(os.path.join(BUILD, prog), os.path.join(bindir,
                                                                   os.path.basename(prog)))
            r = slurm.run([which("sbatch"), "--wait", "--nodes=2", "--ntasks-per-node=2",
                           "-o", log, SCRIPT, sys.executable, EXAMPLE, "--out", out] + SMALL,
                          RAGSHARD_BIN=bindir, RAGSHARD_PLANNER=c.planner,
                          RAGSHARD_TOKEN_FILE=c.token_file, RAGSHARD_POOL_BYTES=str(128 << 20),
                          PYTHONPATH=env()["PYTHONPATH"])
            text = open(log).read() if os.path.exists(log) else ""
            assert r.returncode == 0, r.stdout + r.stderr + text + slurm.logs()
            assert "finished" in text, text
            for name in NODES:  # one daemon on each node, stopped by SIGTERM, not killed
                assert text.count(f"ragshardd {name} ready") == 1, text
                assert text.count(f"ragshardd {name} stopped") == 1, text
            assert "Killed" not in text, text
            # Each rank knew itself from srun's variables: ranks 0, 1 on sn0, 2, 3 on sn1.
            for rank in range(4):
                with open(f"{out}.rank{rank}.json") as f:
                    assert json.load(f)["node"] == f"sn{rank // 2}"
            q = slurm.run([which("squeue"), "-h"])
            assert q.stdout.strip() == "", q.stdout
            assert_same(out, ref)  # (inside: the cluster's directory goes with it)
        finally:
            slurm.stop()
