"""Secure by default (issue 26): a planner started without --token-file keeps a token of its own
in DATA_DIR/token (mode 0600, in a 0700 directory), every call needs it, and another local user,
who cannot read it, is refused: their DeleteJob leaves the job alone. The other user is `nobody`
(uid 65534), through setpriv."""
import os
import stat
import subprocess

import pytest

from ragshard import create_job
from ragshard.cluster import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
CTL = os.path.join(BUILD, "client", "ragshardctl")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def ctl(c, *args, env=None, user=()):
    return subprocess.run(list(user) + [CTL, "--planner", c.planner, "--retry-s", "0"] +
                          list(args), env=env, capture_output=True, text=True, timeout=60)


def without_token():
    env = dict(os.environ)
    env.pop("RAGSHARD_TOKEN_FILE", None)
    return env


def test_a_planner_started_with_defaults_keeps_a_private_token_that_every_call_needs():
    with LocalCluster(BUILD, daemons=1) as c:
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
    with LocalCluster(BUILD, daemons=1) as c:
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
