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
import socket
import subprocess
import sys

import pytest
# beside these files; they put the build's package on the path
from cluster_runs import BUILD, ROOT, env, require_namespaces
from host_runs import EXAMPLE, SMALL, assert_same
from test_slurm import PROGRAMS, SCRIPT, _until, _which

from ragshard.cluster import LocalCluster, NamespacedCluster  # noqa: E402

require_namespaces()

NODES = {"sn0": "spare-0", "sn1": "spare-1"}  # Slurm's node name -> its host
# A slurmd on a host: its spool in the host's own /tmp, and a cgroup root of the host's own (the
# host's /sys, which ip netns exec mounts, has none; slurmd mounts the v1 controllers it uses
# there, CgroupAutomount).
SLURMD_HOST = ("mkdir -p /tmp/slurmd && (mountpoint -q /sys/fs/cgroup || mount -t tmpfs "
               "cgroup_root /sys/fs/cgroup) && exec \"$0\" \"$@\"")


class HostsSlurm:
    """munged (here), slurmctld (on the planner's host) and a slurmd on each host of NODES,
    configured under `root` (seen by every host); each slurmd's spool, pid file and state in its
    host's own /tmp."""

    def __init__(self, c, root):
        self.c, self.root, self.procs = c, root, []
        for d in ("munge", "state", "log"):
            os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(root, "munge", "munge.sock")
        self.conf = os.path.join(root, "slurm.conf")
        nodes = "\n".join(f"NodeName={n} NodeAddr={c.hosts.address(h)} CPUs=8 State=UNKNOWN"
                          for n, h in NODES.items())
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=ragshardhosts
SlurmctldHost={socket.gethostname().split(".")[0]}({c.hosts.address("planner")})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir=/tmp/slurmd
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile=/tmp/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        with open(os.path.join(root, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
        # (OMP_NUM_THREADS left to the script: one thread per rank, as ragshard-launch's.)
        self.env = dict({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                        SLURM_CONF=self.conf)

    def _start(self, name, host, argv):
        with open(os.path.join(self.root, "log", name + ".out"), "w") as log:
            command = argv if host is None else self.c.hosts.command(host, argv)
            self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))

    def run(self, argv, **more):
        """A Slurm command on the planner's host (slurmctld's)."""
        return self.c.run("planner", argv, env=dict(self.env, **more), capture_output=True,
                          text=True, timeout=600)

    def start(self):
        self._start("munged", None, [
            _which("munged"), "-F", "-f", "--socket=" + self.munge_socket,
            "--key-file=" + os.path.join(self.root, "munge", "munge.key"),
            "--log-file=" + os.path.join(self.root, "log", "munged.log"),
            "--pid-file=" + os.path.join(self.root, "munge", "munged.pid"),
            "--seed-file=" + os.path.join(self.root, "munge", "seed")])
        _until(lambda: os.path.exists(self.munge_socket), "munged's socket")
        self._start("slurmctld", "planner", [_which("slurmctld"), "-D", "-f", self.conf])
        for name, host in NODES.items():
            self._start(f"slurmd-{name}", host, ["sh", "-c", SLURMD_HOST, _which("slurmd"),
                                                 "-D", "-f", self.conf, "-N", name])

        def idle():
            for p in self.procs:
                if p.poll() is not None:
                    pytest.fail(f"{p.args} exited ({p.returncode}): " + self.logs())
            r = self.run([_which("sinfo"), "-h", "-o", "%t %D"])
            return r.stdout.split() == ["idle", str(len(NODES))]
        _until(idle, "both nodes to be idle in sinfo", seconds=120)
        return self

    def logs(self):
        out = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, 15)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()


def test_sbatch_across_hosts_ends_as_ragshard_launch(tmp_path):
    missing = [p for p in PROGRAMS if _which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}; "
                    "scripts/install-deps.sh installs slurmctld, slurmd and munge)")
    ref = str(tmp_path / "loopback")
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", c.planner,
                            "--job", "loop", "--create-job", "--nproc", "4", "--sockets",
                            ",".join(c.sockets), EXAMPLE, "--out", ref] + SMALL,
                           env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr

    with NamespacedCluster(BUILD, daemons=0, spare_hosts=len(NODES), shared=[ROOT]) as c:
        slurm = HostsSlurm(c, os.path.join(c.dir, "slurm"))
        try:
            slurm.start()
            out, log = os.path.join(c.dir, "run"), os.path.join(c.dir, "job.out")
            bindir = os.path.join(c.dir, "bin")  # the programs as installed: one directory
            os.makedirs(bindir)
            for prog in ("server/ragshard-planner", "server/ragshardd", "ctl/ragshardctl"):
                os.symlink(os.path.join(BUILD, prog), os.path.join(bindir,
                                                                   os.path.basename(prog)))
            r = slurm.run([_which("sbatch"), "--wait", "--nodes=2", "--ntasks-per-node=2",
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
            q = slurm.run([_which("squeue"), "-h"])
            assert q.stdout.strip() == "", q.stdout
            assert_same(out, ref)  # (inside: the cluster's directory goes with it)
        finally:
            slurm.stop()
