"""deploy/slurm/ragshard.sbatch on a real single-node Slurm (Debian's slurmctld, slurmd and
munge), started here in a temporary directory on loopback and free ports, and stopped, even on
failure: the script starts a planner and one daemon, then 2 ranks of the example, which read
who they are from srun's variables; the job ends cleanly. Skipped, with the reason, only where
Slurm's programs are not installed (scripts/install-deps.sh installs them)."""
import json
import os
import subprocess
import sys

import pytest
from slurm_runs import SlurmCluster, require_slurm, which  # beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
SCRIPT = os.path.join(ROOT, "deploy", "slurm", "ragshard.sbatch")
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    require_slurm()
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_the_sbatch_script_trains_the_example(slurm, tmp_path):
    node, = slurm.nodes
    out = str(tmp_path / "run")
    bindir = tmp_path / "bin"  # the programs as installed: one directory
    bindir.mkdir()
    for prog in ("server/ragshard-planner", "server/ragshardd", "ctl/ragshardctl"):
        os.symlink(os.path.join(BUILD, prog), bindir / os.path.basename(prog))
    env = dict(slurm.env, RAGSHARD_BIN=str(bindir),
               RAGSHARD_RUN_DIR=str(tmp_path / "rs"), RAGSHARD_DATA_LISTEN="127.0.0.1:0",
               RAGSHARD_POOL_BYTES=str(128 << 20),
               PYTHONPATH=os.path.join(BUILD, "python") + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    log = str(tmp_path / "job.out")
    r = subprocess.run([which("sbatch"), "--wait", "--ntasks=2", "-o", log, SCRIPT,
                        sys.executable, EXAMPLE, "--steps", "3", "--layers", "2", "--dim", "64",
                        "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "32",
                        "--quiet", "--out", out],
                       env=env, capture_output=True, text=True, timeout=600)
    text = open(log).read() if os.path.exists(log) else ""
    assert r.returncode == 0, r.stdout + r.stderr + text + slurm.logs()
    assert "finished" in text, text
    # One daemon on the node, stopped by SIGTERM (it says so), not killed.
    assert text.count(f"ragshardd {node} ready") == 1, text
    assert text.count(f"ragshardd {node} stopped") == 1, text
    assert "Killed" not in text, text
    losses = json.load(open(out + ".json"))["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    # Each rank knew itself from srun's variables: ranks 0 and 1, on this node by its name.
    for rank in range(2):
        assert json.load(open(f"{out}.rank{rank}.json"))["node"] == node
    # The job ended cleanly: nothing left in the queue, no daemon or planner of it running.
    q = subprocess.run([which("squeue"), "-h"], env=slurm.env, capture_output=True, text=True)
    assert q.stdout.strip() == "", q.stdout
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "rs")], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
