"""Secure by default (issue 26): a planner started without --token-file keeps a token of its own
in DATA_DIR/token (mode 0600, in a 0700 directory), every call needs it, and another local user,
who cannot read it, is refused: their DeleteJob leaves the job alone. The other user is `nobody`
(uid 65534), through setpriv."""
import os
import stat
import subprocess
import sys

import pytest

from ragshard import create_job
from ragshard.cluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
CTL = os.path.join(BUILD, "ctl", "ragshardctl")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def ctl(c, *args, env=None, user=()):
    return subprocess.run(list(user) + [CTL, "--planner", c.planner, "--retry-s", "0"] +
                          list(args), env=env, capture_output=True, text=True, timeout=60)


def without_token():
    env = dict(os.environ)
    env.pop("RAGSHARD_TOKEN_FILE", None)
    return env


def test_a_planner_started_with_defaults_keeps_a_private_token_that_every_call_needs():
    with LocalCluster(BUILD, daemons=1, default_token=True) as c:
        mode = os.stat(c.token_file).st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(c.token_file)).st_mode) == 0o700
        with open(c.token_file) as f:
            token = f.read().strip()
        assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, in hex
        create_job(c.planner, "mine", 2)  # this process carries it (RAGSHARD_TOKEN_FILE)
        r = ctl(c, "jobs", env=without_token())
        assert r.returncode != 0 and "missing bearer token" in r.stderr, r.stderr
        r = ctl(c, "jobs")
        assert r.returncode == 0 and "mine" in r.stdout, r.stderr
        # The token survives a restart: clients keep working with the file they hold.
        c.kill_planner()
        c.restart_planner()
        with open(c.token_file) as f:
            assert f.read().strip() == token
        r = ctl(c, "job", "show", "mine")
        assert r.returncode == 0, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as nobody")
def test_another_local_users_delete_job_is_refused_by_a_planner_started_with_defaults():
    with LocalCluster(BUILD, daemons=1, default_token=True) as c:
        os.chmod(c.dir, 0o711)  # the other user may reach what is open in it, not the token
        create_job(c.planner, "theirs", 2)
        # Without the token; then pointing at the token, which nobody may read.
        r = ctl(c, "job", "delete", "theirs", env=without_token(), user=NOBODY)
        assert r.returncode != 0, r.stdout
        assert "missing bearer token" in r.stderr, r.stderr
        r = ctl(c, "job", "delete", "theirs", user=NOBODY)
        assert r.returncode != 0, r.stdout
        assert c.token_file in r.stderr, r.stderr
        # A guessed token is no better.
        guess = os.path.join(c.dir, "guess")
        fd = os.open(guess, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"0" * 64 + b"\n")
        os.close(fd)
        os.chown(guess, 65534, 65534)
        r = ctl(c, "--token-file", guess, "job", "delete", "theirs", env=without_token(),
                user=NOBODY)
        assert r.returncode != 0 and "invalid bearer token" in r.stderr, r.stderr
        r = ctl(c, "job", "show", "theirs")
        assert r.returncode == 0 and "REGISTERING" in r.stdout, r.stdout + r.stderr


def listening_ports(pid):
    """The TCP ports process `pid` listens on (IPv4, from /proc: no ss needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.append(int(cols[1].split(":")[1], 16))
    return ports


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a command as nobody")
def test_a_strangers_injection_into_the_data_ports_leaves_the_training_equal_to_the_reference(
        tmp_path):
    """While 4 ranks train over 2 daemons, `nobody` connects to every TCP port the daemons
    listen on, over and over, and sends messages shaped like the daemons' (tests/server/daemon/
    ucx_injector.cc), once with no credential and once with a guessed one. The data ports reject
    every such connection before it has an endpoint: the training's losses equal the reference,
    and the daemons count what they rejected."""
    import threading
    from test_training import SMALL, compare, env, run_reference
    from ragshard.metrics import scrape
    injector = os.path.join(BUILD, "tests", "ucx_injector")
    with LocalCluster(BUILD, daemons=2, metrics=True) as c:
        create_job(c.planner, "injected", 4)
        out = str(tmp_path / "injected")
        p = subprocess.Popen(
            [sys.executable, "-m", "ragshard.launch", "--planner", c.planner, "--job",
             "injected", "--nproc", "4", "--sockets", ",".join(c.sockets),
             os.path.join(ROOT, "examples", "train_tiny.py"), "--out", out, "--steps", "6"] +
            SMALL, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tried = []

        def inject():
            credential = 0
            while p.poll() is None:
                for daemon in c.procs[1:3]:
                    for port in listening_ports(daemon.pid):
                        r = subprocess.run(NOBODY + [injector, f"127.0.0.1:{port}", "0.5",
                                                     str(credential)],
                                           capture_output=True, text=True, timeout=60)
                        tried.append((port, r.returncode, r.stdout.strip() + r.stderr[-300:]))
                credential = 0 if credential else 0x5EC12E7

        t = threading.Thread(target=inject)
        t.start()
        try:
            output, _ = p.communicate(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            t.join()
        assert p.returncode == 0, output[-4000:]
        assert tried and all(rc == 0 for _, rc, _ in tried), tried[:5]
        rejected = 0
        for node in c.nodes:
            for name, labels, value in scrape(c.metrics_urls[node]):
                if name == "ragshard_daemon_errors_total" and \
                        labels.get("cause") == "unauthenticated":
                    rejected += value
        print(f"{len(tried)} injector runs; the daemons rejected {rejected:.0f} connections")
        assert rejected >= 1, (tried[:5], output[-2000:])
    compare(out, run_reference(tmp_path, "injected", ["--steps", "6"]))
