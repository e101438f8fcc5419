"""A real Slurm for the tests (Debian's munged, slurmctld and slurmd), started by a test under a
directory of its own and stopped, even on failure (beside them: `import slurm_runs`): one node on
loopback (test_slurm.py), or nodes on hosts of their own (test_slurm_hosts.py)."""
import getpass
import os
import signal
import socket
import subprocess
import time

import pytest

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue")
HOSTNAME = socket.gethostname().split(".")[0]


def which(name):
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


def require_slurm():
    """Skips, naming what is missing, where Slurm's programs are not installed."""
    missing = [p for p in PROGRAMS if which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}; "
                    "scripts/install-deps.sh installs slurmctld, slurmd and munge)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(done, what, seconds=60):
    """Polls `done` until it holds; fails naming `what` after `seconds` (a hang's bound)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


# A slurmd on a host of its own: its spool in the host's own /tmp, and a cgroup root of the host's
# own (the host's /sys, which ip netns exec mounts, has none; slurmd mounts the v1 controllers it
# uses there, CgroupAutomount).
SLURMD_ON_A_HOST = ("mkdir -p /tmp/slurmd && (mountpoint -q /sys/fs/cgroup || mount -t tmpfs "
                    "cgroup_root /sys/fs/cgroup) && exec \"$0\" \"$@\"")


class SlurmCluster:
    """munged (here), slurmctld and a slurmd per node, configured under `root`, as this user.
    By default one node, this machine, on loopback and free ports. With `hosts` (a
    ragshard.hosts.Hosts) and `nodes` ({Slurm node name: host}), each slurmd runs on its host
    (its spool, pid file and cgroup root the host's own), slurmctld and the Slurm commands
    (`run`) on `ctl_host`."""

    def __init__(self, root, hosts=None, nodes=None, ctl_host="planner"):
        self.root, self.procs, self.hosts, self.ctl_host = root, [], hosts, ctl_host
        self.nodes = nodes or {HOSTNAME: None}
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(root, "munge", "munge.sock")
        user, r = getpass.getuser(), root
        if hosts is None:
            ctl, ports, node_dir = "127.0.0.1", (free_port(), free_port()), r
            addresses = {n: "127.0.0.1" for n in self.nodes}
        else:  # each host has its own ports and /tmp
            ctl, ports, node_dir = hosts.address(ctl_host), (6817, 6818), "/tmp"
            addresses = {n: hosts.address(h) for n, h in self.nodes.items()}
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=8 State=UNKNOWN"
                          for n, a in addresses.items())
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=ragshardtest
SlurmctldHost={HOSTNAME}({ctl})
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={r}/state
SlurmdSpoolDir={node_dir}/{"slurmd" if hosts else "spool"}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={node_dir}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
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
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        if hosts is not None:
            with open(os.path.join(root, "cgroup.conf"), "w") as f:
                f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=yes\n")
        # (OMP_NUM_THREADS left to the sbatch script: one thread per rank, as ragshard-launch's.)
        self.env = dict({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
                        SLURM_CONF=self.conf)

    def _command(self, host, argv):
        return argv if host is None or self.hosts is None else self.hosts.command(host, argv)

    def _start(self, name, host, argv):
        with open(os.path.join(self.root, "log", name + ".out"), "w") as log:
            self.procs.append(subprocess.Popen(self._command(host, argv), stdout=log,
                                               stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True))

    def run(self, argv, timeout=600, **more_env):
        """A Slurm command (on slurmctld's host). One still running at `timeout` fails the test
        with where its jobs stand (`scontrol show job`: state and reason) and the daemons' logs,
        so that a job that never ran or never ended says why."""
        try:
            return subprocess.run(self._command(self.ctl_host, argv),
                                  env=dict(self.env, **more_env), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            jobs = subprocess.run(self._command(self.ctl_host, [which("scontrol"), "show", "job"]),
                                  env=self.env, capture_output=True, text=True, timeout=60)
            pytest.fail(f"{os.path.basename(argv[0])} still running after {timeout} s; the "
                        f"jobs: {(jobs.stdout + jobs.stderr)[-3000:]}\n" + self.logs())

    def start(self):
        self._start("munged", None, [
            which("munged"), "-F", "-f", "--socket=" + self.munge_socket,
            "--key-file=" + os.path.join(self.root, "munge", "munge.key"),
            "--log-file=" + os.path.join(self.root, "log", "munged.log"),
            "--pid-file=" + os.path.join(self.root, "munge", "munged.pid"),
            "--seed-file=" + os.path.join(self.root, "munge", "seed")])
        until(lambda: os.path.exists(self.munge_socket), "munged's socket")
        self._start("slurmctld", self.ctl_host, [which("slurmctld"), "-D", "-f", self.conf])
        for name, host in self.nodes.items():
            slurmd = [which("slurmd"), "-D", "-f", self.conf, "-N", name]
            self._start(f"slurmd-{name}", host,
                        slurmd if self.hosts is None else ["sh", "-c", SLURMD_ON_A_HOST] + slurmd)

        def idle():
            for p in self.procs:
                if p.poll() is not None:
                    pytest.fail(f"{p.args} exited ({p.returncode}): " + self.logs())
            r = self.run([which("sinfo"), "-h", "-o", "%t %D"], timeout=60)
            return r.stdout.split() == ["idle", str(len(self.nodes))]
        until(idle, "every node to be idle in sinfo", seconds=120)
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
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
