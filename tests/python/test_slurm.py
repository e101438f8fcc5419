"""deploy/slurm/ragshard.sbatch on a real single-node Slurm (Debian's slurmctld, slurmd and
munge), started here in a temporary directory on loopback and free ports, and stopped, even on
failure: the script starts a planner and one daemon, then 2 ranks of the example, which read
who they are from srun's variables; the job ends cleanly. Skipped, with the reason, only where
Slurm's programs are not installed (scripts/install-deps.sh installs them)."""
import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
SCRIPT = os.path.join(ROOT, "deploy", "slurm", "ragshard.sbatch")
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue")


def _which(name):
    for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(done, what, seconds=60):
    """Polls `done` until it holds; fails naming `what` after `seconds` (a hang's bound)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


class SlurmCluster:
    """munged, slurmctld and slurmd of one node under `root`, as this user."""

    def __init__(self, root):
        self.root, self.procs = root, []
        self.node = socket.gethostname().split(".")[0]
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
        key = os.path.join(root, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(root, "munge", "munge.sock")
        user = getpass.getuser()
        r = root
        self.conf = os.path.join(root, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=ragshardtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
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
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _start(self, name, argv):
        log = open(os.path.join(self.root, "log", name + ".out"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))
        log.close()

    def start(self):
        self._start("munged", [_which("munged"), "-F", "-f", "--socket=" + self.munge_socket,
                               "--key-file=" + os.path.join(self.root, "munge", "munge.key"),
                               "--log-file=" + os.path.join(self.root, "log", "munged.log"),
                               "--pid-file=" + os.path.join(self.root, "munge", "munged.pid"),
                               "--seed-file=" + os.path.join(self.root, "munge", "seed")])
        _until(lambda: os.path.exists(self.munge_socket), "munged's socket")
        self._start("slurmctld", [_which("slurmctld"), "-D", "-f", self.conf])
        self._start("slurmd", [_which("slurmd"), "-D", "-f", self.conf, "-N", self.node])

        def idle():
            for p in self.procs:
                if p.poll() is not None:
                    pytest.fail(f"{p.args[0]} exited ({p.returncode}): " + self.logs())
            r = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], env=self.env,
                               capture_output=True, text=True)
            return r.stdout.strip() == "idle"
        _until(idle, "the node to be idle in sinfo")

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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [p for p in PROGRAMS if _which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}; "
                    "scripts/install-deps.sh installs slurmctld, slurmd and munge)")
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_the_sbatch_script_trains_the_example(slurm, tmp_path):
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
    r = subprocess.run([_which("sbatch"), "--wait", "--ntasks=2", "-o", log, SCRIPT,
                        sys.executable, EXAMPLE, "--steps", "3", "--layers", "2", "--dim", "64",
                        "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "32",
                        "--quiet", "--out", out],
                       env=env, capture_output=True, text=True, timeout=600)
    text = open(log).read() if os.path.exists(log) else ""
    assert r.returncode == 0, r.stdout + r.stderr + text + slurm.logs()
    assert "finished" in text, text
    # One daemon on the node, stopped by SIGTERM (it says so), not killed.
    assert text.count(f"ragshardd {slurm.node} ready") == 1, text
    assert text.count(f"ragshardd {slurm.node} stopped") == 1, text
    assert "Killed" not in text, text
    losses = json.load(open(out + ".json"))["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    # Each rank knew itself from srun's variables: ranks 0 and 1, on this node by its name.
    for rank in range(2):
        assert json.load(open(f"{out}.rank{rank}.json"))["node"] == slurm.node
    # The job ended cleanly: nothing left in the queue, no daemon or planner of it running.
    q = subprocess.run([_which("squeue"), "-h"], env=slurm.env, capture_output=True, text=True)
    assert q.stdout.strip() == "", q.stdout
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "rs")], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
