"""ragshard.launch: environment of the ranks, a failing rank stops the others (no hang), and bad
arguments are refused with a message; --standalone (a planner and a daemon of the run's own,
found on PATH, stopped and removed however the run ends) and bare torchrun (the job from the
run id, created by the ranks) each train the standard recipe (examples/train_hf.py: a
transformers Llama with tied embeddings, AdamW in decay and no-decay groups, warmup then cosine,
clipping) to the end."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
ENV = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
TINY = ["--backend", "ragshard", "--model", "llama", "--quiet", "--steps", "3"]
PRELOAD = "torch,transformers.models.llama.modeling_llama"
# The programs where the build puts them (pip install . puts them on PATH): the planner and the
# daemon for --standalone.
PROGRAMS = os.pathsep.join([os.path.join(BUILD, "server"), os.path.join(BUILD, "client"),
                            os.environ.get("PATH", "")])

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
    assert "rank 1 exited with 3; stopping the others" in r.stderr
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
    assert "rank 1 exited with 1" in r.stderr
    r = subprocess.run(base + ["exit"], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 7 and "rank 2 exited with 7" in r.stderr
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


def _answers(monkeypatch, *answers):
    """ragshard.job_info answers `answers` in turn (an exception is raised), the last one for
    good."""
    seen = list(answers)

    def job_info(*args):
        got = seen.pop(0) if len(seen) > 1 else seen[0]
        if isinstance(got, Exception):
            raise got
        return got
    monkeypatch.setattr(ragshard, "job_info", job_info)


def _recovering(lost):
    return {"status": "JOB_RECOVERING", "recovery": {"lost_node_id": lost}}


@pytest.mark.parametrize("answers,said", [
    # Joined: the job recovers from the loss of this launcher's node, at once or once the
    # planner counted the loss or answers again.
    ((_recovering("node-0"),), None),
    (({"status": "JOB_READY"}, _recovering(""), _recovering("node-0")), None),
    ((ragshard.Error("UNAVAILABLE: planner restarting"), _recovering("node-0")), None),
    # Refused at once: a job that cannot recover.
    (({"status": "JOB_DEGRADED", "error": "node 'node-0' lost; no redundancy"},),
     "(JOB_DEGRADED: node 'node-0' lost; no redundancy); node rank 0's launcher joins"),
    (({"status": "JOB_SHRUNK"},), "(JOB_SHRUNK)"),
    # Refused at the wait's end: a recovery of another node's loss or of rank processes only,
    # a job that runs on.
    ((_recovering("node-1"),), "(JOB_RECOVERING, from the loss of node 'node-1')"),
    ((_recovering(""),), "(JOB_RECOVERING, from the loss of rank processes)"),
    (({"status": "JOB_READY"},), "(JOB_READY); node rank 0's launcher joins an existing job "
                                 "only as the replacement of a lost host among its nodes "
                                 "(node-0, node-9)"),
])
def test_node_rank_0_joins_an_existing_job_only_as_a_lost_hosts_replacement(
        monkeypatch, capsys, answers, said):
    from types import SimpleNamespace
    from ragshard import launch as launcher
    monkeypatch.setenv("RAGSHARD_JOB_WAIT_S", "0.3")  # two answers, a third past the wait
    _answers(monkeypatch, *answers)
    a = SimpleNamespace(planner="127.0.0.1:1", job="j", token_file="", tls_ca=None,
                        tls_cert=None, tls_key=None, tls_server_name=None,
                        nodes=["node-0", "node-9"])
    if said is None:
        launcher._join_as_replacement(a)
        assert "node rank 0 joins it as the replacement of a lost host" in \
            capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError) as e:
            launcher._join_as_replacement(a)
        assert said in str(e.value) and "use another --job" in str(e.value), str(e.value)


def test_bad_arguments_are_refused(tmp_path):
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0,/s1"])
    assert r.returncode == 2 and "does not split evenly" in r.stderr
    r = launch(tmp_path, ["--nproc", "0", "--sockets", "/s0"])
    assert r.returncode == 2 and "--nproc must be at least 1" in r.stderr
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0", "--replicate", "3"])
    assert r.returncode == 2 and "--replicate 3 does not divide" in r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--nodes", "a,b"])
    assert r.returncode == 2 and "names 2 nodes for 1 sockets" in r.stderr
    r = launch(tmp_path, ["--nproc", "2"])
    assert r.returncode == 2
    assert "required: --sockets (or --standalone)" in r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--standalone", "--sockets", "/s0"])
    assert r.returncode == 2 and "--sockets cannot be given with it" in r.stderr
    r = launch(tmp_path, ["--nproc", "2", "--sockets", "/s0", "--pool-bytes", "1"])
    assert r.returncode == 2 and "--pool-bytes is for --standalone" in r.stderr
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0", "--nnodes", "2", "--node-rank", "2"])
    assert r.returncode == 2 and "--node-rank 2 must be in [0, --nnodes 2)" in r.stderr
    r = launch(tmp_path, ["--nproc", "3", "--sockets", "/s0", "--nnodes", "2"])
    assert r.returncode == 2 and "--nproc 3 does not split evenly over --nnodes 2" in r.stderr
    r = launch(tmp_path, ["--nproc", "4", "--sockets", "/s0,/s1", "--nnodes", "4"])
    assert r.returncode == 2 and "does not split evenly over 8 daemons" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--standalone", "--nproc", "2",
                        "--nnodes", "2", EXAMPLE], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--nnodes cannot be given with it" in r.stderr


def standalone(args, env_path=PROGRAMS, timeout=300):
    return subprocess.run([sys.executable, "-m", "ragshard.launch", "--standalone",
                           "--pool-bytes", str(64 << 20)] + args,
                          env=dict(ENV, PATH=env_path), capture_output=True, text=True,
                          timeout=timeout)


def losses(out, steps):
    got = json.load(open(out + ".json"))["losses"]
    assert len(got) == steps and all(x == x and 0 < x < 100 for x in got), got
    return got


def test_standalone_trains_to_the_end(tmp_path):
    out = str(tmp_path / "standalone")
    r = standalone(["--nproc", "2", "--preload", PRELOAD, EXAMPLE, "--out", out] + TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    losses(out, 3)


# A rank of a --standalone run: rank 0 writes down the run's private directory and the pids of
# the processes that use it (the planner's --data-dir and the daemon's --socket are in it), then
# sleeps; rank 1 waits for that and fails (or, with "wait", waits to be stopped).
SERVERS = """
import os, sys, time
d = os.path.dirname(os.environ["RAGSHARD_SOCKET"])
if os.environ["RAGSHARD_RANK"] == "0":
    pids = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and d.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                pids.append(int(p))
        except OSError:
            pass
    open(sys.argv[1] + ".tmp", "w").write(" ".join([d] + [str(p) for p in pids]))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
if sys.argv[2] == "fail":
    sys.exit(1)
time.sleep(120)
"""


def servers_of(record):
    d, *pids = open(record).read().split()
    return d, [int(p) for p in pids]


def assert_all_gone(d, pids):
    assert not os.path.exists(d), f"{d} was left behind"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and
                _cmdline_has(p, d)], f"a process still uses {d}"


def _cmdline_has(pid, text):
    try:
        return text.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False


def test_a_failing_standalone_rank_leaves_nothing_behind(tmp_path):
    script, record = tmp_path / "servers.py", str(tmp_path / "servers")
    script.write_text(SERVERS)
    start = time.time()
    r = standalone(["--nproc", "2", str(script), record, "fail"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exited with 1; stopping the others" in r.stderr
    assert time.time() - start < 60  # rank 0 was stopped, not waited for
    d, pids = servers_of(record)
    assert len(pids) == 2, pids  # the planner and the daemon
    assert_all_gone(d, pids)


def test_a_stopped_standalone_launcher_leaves_nothing_behind(tmp_path):
    script, record = tmp_path / "servers.py", str(tmp_path / "servers")
    script.write_text(SERVERS)
    p = subprocess.Popen([sys.executable, "-m", "ragshard.launch", "--standalone", "--pool-bytes",
                          str(64 << 20), "--nproc", "2", str(script), record, "wait"],
                         env=dict(ENV, PATH=PROGRAMS), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not os.path.exists(record) and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert os.path.exists(record), p.poll()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM and "SIGTERM; stopping the ranks" in err, err
    assert_all_gone(*servers_of(record))


def test_standalone_names_a_program_not_on_path(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("import os\nos.write(1, b'ran\\n')\n")
    r = standalone(["--nproc", "2", str(script)], env_path="/usr/bin:/bin")
    assert r.returncode == 1 and "ran" not in r.stdout, r.stdout + r.stderr
    assert "ragshard-planner is not on PATH (/usr/bin:/bin)" in r.stderr
    only_planner = tmp_path / "bin"
    only_planner.mkdir()
    os.symlink(os.path.join(BUILD, "server", "ragshard-planner"), only_planner / "ragshard-planner")
    r = standalone(["--nproc", "2", str(script)], env_path=f"{only_planner}:/usr/bin:/bin")
    assert r.returncode == 1 and "ran" not in r.stdout, r.stdout + r.stderr
    assert f"ragshardd is not on PATH ({only_planner}:/usr/bin:/bin)" in r.stderr


@pytest.fixture(scope="module")
def one_daemon():
    with LocalCluster(BUILD, daemons=1, pool_bytes=64 << 20) as c:
        yield c


def torchrun_env(cluster, **extra):
    """Bare torchrun's rank environment: the planner, its token and the socket, nothing else."""
    e = {k: v for k, v in ENV.items() if not k.startswith(("RAGSHARD_", "TORCHELASTIC_"))}
    e.update(PATH=PROGRAMS, RAGSHARD_PLANNER=cluster.planner,
             RAGSHARD_TOKEN_FILE=cluster.token_file, RAGSHARD_SOCKET=cluster.sockets[0], **extra)
    return e


def jobs_of(cluster):
    r = subprocess.run([os.path.join(BUILD, "ctl", "ragshardctl"), "--planner",
                        cluster.planner, "--token-file", cluster.token_file, "jobs", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {j["jobId"]: int(j["worldSize"]) for j in json.loads(r.stdout).get("jobs", [])}


def test_bare_torchrun_creates_one_job_and_trains_to_the_end(one_daemon, tmp_path):
    before = set(jobs_of(one_daemon))
    out = str(tmp_path / "torchrun")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", EXAMPLE, "--out",
                        out] + TINY, env=torchrun_env(one_daemon), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    losses(out, 3)
    created = {k: v for k, v in jobs_of(one_daemon).items() if k not in before}
    assert len(created) == 1, created  # the run id's job, made once by two ranks
    assert list(created.values()) == [2]


def test_a_torchrun_rank_of_another_world_size_than_the_job_is_refused(one_daemon, monkeypatch):
    ragshard.create_job(one_daemon.planner, "three", 3, token_file=one_daemon.token_file)
    env = ragshard.Env(torchrun_env(one_daemon, RANK="0", WORLD_SIZE="2",
                                    TORCHELASTIC_RUN_ID="three"))
    with pytest.raises(ragshard.Error, match="job 'three' exists with world size 3, but this "
                                             "rank's world size is 2"):
        ragshard.connect(env)
    # The same size joins the existing job; a missing one is created.
    ragshard.ensure_job(ragshard.Env(torchrun_env(one_daemon, RANK="2", WORLD_SIZE="3",
                                                  TORCHELASTIC_RUN_ID="three")))
    ragshard.ensure_job(ragshard.Env(torchrun_env(one_daemon, RANK="0", WORLD_SIZE="2",
                                                  TORCHELASTIC_RUN_ID="fresh")))
    assert jobs_of(one_daemon)["fresh"] == 2


def test_a_shrink_is_followed_to_the_job_that_goes_on():
    """ragshard._shrink over the planner's answers (a job shrank twice: 6 ranks, node of ranks
    2, 3 lost, then the node of the new ranks 0, 1): each survivor's rank in the job that goes
    on, the job whose buffers hold its state, a lost rank named, and the launcher's mapping."""
    from ragshard._shrink import follow, left_in_shrink, shrunk_ranks
    jobs = {
        "j": {"status": "JOB_SHRUNK", "world_size": 6, "survivor_ranks": [0, 1, 4, 5],
              "successor_job_id": "j/shrink-1", "error": "node 'node-1' was lost"},
        "j/shrink-1": {"status": "JOB_SHRUNK", "world_size": 4, "survivor_ranks": [2, 3],
                       "successor_job_id": "j/shrink-1/shrink-1", "error": "node 'node-0'"},
        "j/shrink-1/shrink-1": {"status": "JOB_READY", "world_size": 2},
        "k": {"status": "JOB_READY", "world_size": 2}}
    asked = []

    def info_of(job):
        asked.append(job)
        if job not in jobs:
            raise ragshard.Error(f"NOT_FOUND: job '{job}'")
        return jobs[job]
    assert follow(info_of, "j", 4) == ("j/shrink-1/shrink-1", 0, "j/shrink-1", 2)
    assert follow(info_of, "j", 5) == ("j/shrink-1/shrink-1", 1, "j/shrink-1", 3)
    assert follow(info_of, "k", 1) is None
    with pytest.raises(ragshard.Error, match="job 'j' shrank without rank 2"):
        follow(info_of, "j", 2)
    assert "shrank without rank 0" in left_in_shrink(info_of, "j/shrink-1", 0)
    assert left_in_shrink(info_of, "j", 5) is None
    assert shrunk_ranks(info_of, "j") == ("j/shrink-1/shrink-1", 2, {4: 0, 5: 1})
    assert shrunk_ranks(info_of, "k") is None
