"""ragshard.launch: environment of the ranks, a failing rank stops the others (no hang), and bad
arguments are refused with a message."""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
ENV = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))

SCRIPT = """
import os, sys, time
r = int(os.environ["RAGSHARD_RANK"])
# One write per line: the ranks share the launcher's stdout, and print() writes its pieces one
# by one when Python's output is unbuffered.
os.write(1, f"rank {r} of {os.environ['RAGSHARD_WORLD_SIZE']} {os.environ['RAGSHARD_SOCKET']} "
            f"{os.environ['RAGSHARD_NODE']}\\n".encode())
if r == int(sys.argv[1]):
    sys.exit(3)
time.sleep(float(sys.argv[2]))
"""


def launch(tmp_path, args, fail_rank=-1, sleep=0.0):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", "127.0.0.1:1",
                           "--job", "j"] + args + [str(script), str(fail_rank), str(sleep)],
                          env=ENV, capture_output=True, text=True, timeout=120)


def test_ranks_get_their_environment(tmp_path):
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0,/s1"])
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == ["rank 0 of 4 /s0 node-0", "rank 1 of 4 /s0 node-0",
                     "rank 2 of 4 /s1 node-1", "rank 3 of 4 /s1 node-1"]


def test_a_failing_rank_stops_the_others(tmp_path):
    start = time.time()
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0"], fail_rank=1, sleep=60)
    assert r.returncode == 3
    assert "a rank exited with 3" in r.stderr
    assert time.time() - start < 30  # the others were stopped, not waited for


def test_bad_arguments_are_refused(tmp_path):
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0,/s1"])
    assert r.returncode == 2 and "does not split evenly" in r.stderr
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0", "--replicate", "3"])
    assert r.returncode == 2 and "--replicate 3 does not divide" in r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--nodes", "a,b"])
    assert r.returncode == 2 and "names 2 nodes for 1 sockets" in r.stderr
