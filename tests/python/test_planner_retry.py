"""The client library rides through planner restarts for RAGSHARD_PLANNER_RETRY_S seconds (60 by
default), then fails saying for how long it tried; a bad value is refused, naming the variable.
(The ride through a real restart is tests/server/planner/planner_restart_test.cc.)"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))


def run(code, retry):
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"),
               RAGSHARD_PLANNER_RETRY_S=retry)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


CREATE = "import ragshard; ragshard.create_job('127.0.0.1:1', 'j', 2)"


def test_an_unreachable_planner_is_retried_for_the_window_then_named():
    r = run(CREATE, "1")
    assert r.returncode != 0
    assert "UNAVAILABLE: planner at 127.0.0.1:1 unreachable" in r.stderr
    assert "(tried for " in r.stderr and "attempts)" in r.stderr


def test_a_bad_window_is_refused_naming_the_variable():
    r = run(CREATE, "soon")
    assert r.returncode != 0
    assert "RAGSHARD_PLANNER_RETRY_S='soon' is not a number of seconds" in r.stderr
