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
            f"{os.environ['RAGSHARD_NODE']} "
            f"omp={os.environ.get('OMP_NUM_THREADS', '-')}\\n".encode())
if r == int(sys.argv[1]):
    sys.exit(3)
time.sleep(float(sys.argv[2]))
"""


def launch(tmp_path, args, fail_rank=-1, sleep=0.0, env=ENV):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", "127.0.0.1:1",
                           "--job", "j"] + args + [str(script), str(fail_rank), str(sleep)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_ranks_get_their_environment(tmp_path):
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0,/s1"])
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == ["rank 0 of 4 /s0 node-0 omp=1", "rank 1 of 4 /s0 node-0 omp=1",
                     "rank 2 of 4 /s1 node-1 omp=1", "rank 3 of 4 /s1 node-1 omp=1"]


def test_ranks_sharing_a_node_get_one_thread_unless_told_otherwise(tmp_path):
    # As torchrun: one rank per daemon keeps the interpreter's default; several get 1 thread,
    # OMP_NUM_THREADS from the caller or --threads-per-rank win.
    quiet = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0,/s1"], env=quiet)
    assert sorted(r.stdout.splitlines()) == ["rank 0 of 2 /s0 node-0 omp=-",
                                             "rank 1 of 2 /s1 node-1 omp=-"], r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0"], env=dict(quiet, OMP_NUM_THREADS="3"))
    assert {line.split()[-1] for line in r.stdout.splitlines()} == {"omp=3"}, r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--threads-per-rank", "2"],
               env=quiet)
    assert {line.split()[-1] for line in r.stdout.splitlines()} == {"omp=2"}, r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--threads-per-rank", "-1"])
    assert r.returncode == 2 and "--threads-per-rank -1: must be at least 1" in r.stderr


def test_a_failing_rank_stops_the_others(tmp_path):
    start = time.time()
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0"], fail_rank=1, sleep=60)
    assert r.returncode == 3
    assert "a rank exited with 3" in r.stderr
    assert time.time() - start < 30  # the others were stopped, not waited for


def test_preloaded_ranks_run_the_script_as_main_with_their_own_environment(tmp_path):
    script = tmp_path / "preloaded.py"
    script.write_text(
        "import atexit, os, sys, torch\n"
        "r = os.environ['RAGSHARD_RANK']\n"
        "atexit.register(lambda: os.write(1, f'exit handler {r}\\n'.encode()))\n"
        "os.write(1, f'rank {r} {__name__} {sys.argv[1:]} threads={torch.get_num_threads()} '\n"
        "            f'{os.environ[\"RAGSHARD_SOCKET\"]}\\n'.encode())\n"
        "if r == '1' and sys.argv[1] == 'fail':\n"
        "    raise ValueError('rank 1 failed on purpose')\n"
        "if r == '2' and sys.argv[1] == 'exit':\n"
        "    sys.exit(7)\n")
    base = [sys.executable, "-m", "ragshard.launch", "--preload", "torch", "--planner",
            "127.0.0.1:1", "--job", "j", "--nproc", "4", "--sockets", "/s0,/s1", str(script)]
    r = subprocess.run(base + ["ok", "--flag"], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert lines == sorted([f"rank {i} __main__ ['ok', '--flag'] threads=1 /s{i // 2}"
                            for i in range(4)] + [f"exit handler {i}" for i in range(4)])
    r = subprocess.run(base + ["fail"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "ValueError: rank 1 failed on purpose" in r.stderr
    assert "a rank exited with 1" in r.stderr
    r = subprocess.run(base + ["exit"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 7 and "a rank exited with 7" in r.stderr
    r = subprocess.run(base[:4] + ["no_such_module"] + base[5:] + ["ok"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--preload no_such_module" in r.stderr
    assert "rank" not in r.stdout  # no rank ran


def test_preloaded_ranks_never_start_when_the_job_cannot_be_created(tmp_path):
    # Nothing listens on the planner address: creating the job fails, and the forked ranks,
    # waiting for it, exit without running the script.
    script = tmp_path / "never.py"
    script.write_text("import os\nos.write(1, b'ran\\n')\n")
    r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--preload", "json",
                        "--planner", "127.0.0.1:1", "--job", "j", "--nproc", "2", "--sockets",
                        "/s0", "--create-job", str(script)],
                       env=dict(ENV, RAGSHARD_PLANNER_RETRY_S="1"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "ran" not in r.stdout, r.stdout + r.stderr
    assert "planner at 127.0.0.1:1 unreachable" in r.stderr


def test_bad_arguments_are_refused(tmp_path):
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0,/s1"])
    assert r.returncode == 2 and "does not split evenly" in r.stderr
    r = launch(tmp_path, ["--nproc", "0", "--sockets", "/s0"])
    assert r.returncode == 2 and "--nproc must be at least 1" in r.stderr
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0", "--replicate", "3"])
    assert r.returncode == 2 and "--replicate 3 does not divide" in r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--nodes", "a,b"])
    assert r.returncode == 2 and "names 2 nodes for 1 sockets" in r.stderr
