"""A rank told of a recovery in place leaves cleanly (docs/recovery.md, "What happens when a rank
process dies"): the notice raises RecoveryInProgress, a BaseException (a SystemExit with status
75), so the script's `finally` blocks and atexit handlers run and the process exits 75; a script
that catches it and goes on gets a named Error at its next ragshard call.

Without a cluster, small scripts get the notice through the client library's own check of a
call's answer (ragshard._core._check, with the library's last error the daemon's notice), each
started as a fresh interpreter, forked by ragshard-launch --preload (ragshard/_preload.py) and
forked by the tests' fork server (preloaded.py). With one, a rank of examples/train_tiny.py is
killed and the others, told by their daemons, show their marks and exit 75."""
import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard._core import RECOVERY_EXIT, RecoveryInProgress  # noqa: E402

EXAMPLES = os.path.join(ROOT, "examples")
NOTICE = "ABORTED: ragshard recovery in progress: rank 1 of job 'j' on node 'n' was lost"

# The script of the tests without a cluster: argv is its marks directory and what it does.
SCRIPT = """
import atexit, os, sys, threading, time
MARKS, MODE = sys.argv[1], sys.argv[2]


def mark(name, text=""):
    # Whole or not at all (a rename): a forked rank may end while another thread marks.
    path = os.path.join(MARKS, name)
    with open(path + ".part", "w") as f:
        f.write(text)
    os.rename(path + ".part", path)


atexit.register(mark, "atexit")
import ragshard
from ragshard import _core, _notice

_notice.NOTICE_GRACE_S = 1.0


class Notice:
    # The C library, whose last error is the daemon's recovery notice.
    def __getattr__(self, name):
        return getattr(real, name)

    def rs_last_error(self):
        return NOTICE.encode()


real, _core._lib = _core._lib, Notice()


def call(code=10):
    # One ragshard call, answered by the library with `code` (0: success).
    _core._check(code)


def in_thread():
    def run():
        try:
            call()
        except ragshard.RecoveryInProgress as e:
            mark("thread", f"{e.code}")
    t = threading.Thread(target=run, daemon=False)
    t.start()
    t.join()


if MODE == "uncaught":
    try:
        call()
    except Exception as e:
        mark("caught-as-exception", repr(e))
    finally:
        mark("finally", repr(sys.exc_info()[1]))
elif MODE == "caught":
    try:
        call()
    except ragshard.RecoveryInProgress as e:
        mark("caught", f"{e.code} {isinstance(e, SystemExit)} {e}")
    try:
        call(0)  # a call that would succeed
    except ragshard.Error as e:
        mark("named", str(e))
    sys.exit(3)
elif MODE == "call-in-finally":
    try:
        call()
    finally:
        mark("finally")
        call(0)  # on the way out: raises the notice again, not an Error
elif MODE == "thread":
    try:
        in_thread()  # the main thread waits for it, then raises the notice too
        mark("main-goes-on")
    finally:
        mark("finally", repr(sys.exc_info()[1]))
elif MODE in ("thread-busy", "thread-idle"):
    def later():  # the notice comes while the main thread is in its loop, or its sleep
        time.sleep(0.2)
        in_thread()
    threading.Thread(target=later, daemon=True).start()
if MODE == "thread-busy":
    try:
        spin = time.monotonic() + 60
        while time.monotonic() < spin:  # no ragshard call: Python code, told at a bytecode
            pass
        mark("spun-out")
    finally:
        mark("finally", repr(sys.exc_info()[1]))
elif MODE == "thread-idle":
    time.sleep(60)  # C code the notice cannot interrupt: the watchdog ends the process
""".replace("NOTICE.encode()", repr(NOTICE.encode()))


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "notice.py"
    path.write_text(SCRIPT)
    return str(path)


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"), e.get("PYTHONPATH", "")])
    return e


# The three ways a rank's interpreter starts: its own, forked by ragshard-launch --preload, and
# forked by the tests' fork server.
FORK_RANK = """
import sys, time
from ragshard import _preload
p = _preload.fork_rank(sys.argv[1], sys.argv[2:], None, 0)
import os
p.start(dict(os.environ))
while p.poll() is None:
    time.sleep(0.02)
print(p.returncode)
"""


def run(script, marks, mode, how):
    os.makedirs(marks, exist_ok=True)
    args = [script, str(marks), mode]
    if how == "interpreter":
        r = subprocess.run([sys.executable] + args, env=env(), capture_output=True, text=True,
                           timeout=120)
        return r.returncode, r.stderr
    if how == "launch-preload":
        r = subprocess.run([sys.executable, "-c", FORK_RANK] + args, env=env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1]), r.stderr
    r = preloaded.run([sys.executable] + args, env=env(), capture_output=True, text=True,
                      timeout=120)
    return r.returncode, r.stderr


def marks_of(marks):
    out = {}
    for path in glob.glob(os.path.join(marks, "*")):
        if path.endswith(".part"):  # a mark the process ended before it was whole
            continue
        with open(path) as f:
            out[os.path.basename(path)] = f.read()
    return out


def test_the_notice_is_a_base_exception_with_status_75():
    e = RecoveryInProgress(NOTICE)
    assert isinstance(e, BaseException) and isinstance(e, SystemExit)
    assert not isinstance(e, Exception) and not isinstance(e, ragshard.Error)
    assert e.code == RECOVERY_EXIT == 75 and str(e) == NOTICE
    assert ragshard.RECOVERY_EXIT is RECOVERY_EXIT and ragshard.RecoveryInProgress is \
        RecoveryInProgress
    from ragshard import launch
    assert launch.RECOVERY_EXIT is RECOVERY_EXIT  # the launcher's is the one definition


@pytest.mark.parametrize("how", ["interpreter", "launch-preload", "fork-server"])
def test_an_uncaught_notice_runs_finally_and_atexit_and_exits_75(script, tmp_path, how):
    code, err = run(script, tmp_path / "m", "uncaught", how)
    got = marks_of(tmp_path / "m")
    assert code == RECOVERY_EXIT, err
    assert "caught-as-exception" not in got  # not an Exception
    assert got.get("finally", "").startswith("RecoveryInProgress("), got
    assert "atexit" in got, got
    assert "ragshard recovery in progress" in err and "exits with 75" in err, err
    assert "Traceback" not in err, err


def test_a_script_that_catches_it_gets_a_named_error_next(script, tmp_path):
    code, err = run(script, tmp_path / "m", "caught", "interpreter")
    got = marks_of(tmp_path / "m")
    assert code == 3, err  # the script's own choice
    assert got["caught"] == f"75 True {NOTICE}", got
    named = got["named"]
    assert named.startswith("FAILED_PRECONDITION: ") and NOTICE in named and \
        "must exit (status 75" in named, named
    assert "atexit" in got


def test_a_call_in_a_finally_block_on_the_way_out_raises_the_notice_again(script, tmp_path):
    code, err = run(script, tmp_path / "m", "call-in-finally", "interpreter")
    assert code == RECOVERY_EXIT, err
    assert {"finally", "atexit"} <= set(marks_of(tmp_path / "m")), err
    assert "Traceback" not in err and "FAILED_PRECONDITION" not in err, err


@pytest.mark.parametrize("how", ["interpreter", "launch-preload"])
@pytest.mark.parametrize("mode", ["thread", "thread-busy"])
def test_a_notice_in_another_thread_reaches_the_main_one(script, tmp_path, how, mode):
    """The main thread, waiting for the thread that got the notice or busy in Python code that
    calls no ragshard, raises it as it would KeyboardInterrupt: finally, atexit, 75."""
    code, err = run(script, tmp_path / "m", mode, how)
    got = marks_of(tmp_path / "m")
    assert code == RECOVERY_EXIT, err
    # The thread that got the notice catches it (75) unless the main thread, told at its next
    # bytecode, ends the process first: a forked rank exits without waiting for the thread.
    assert got.get("thread", "75") == "75", got
    assert got.get("finally", "").startswith("RecoveryInProgress("), got
    assert "atexit" in got and "main-goes-on" not in got and "spun-out" not in got, got


def test_a_notice_in_another_thread_ends_a_blocked_process(script, tmp_path):
    t = time.monotonic()
    code, err = run(script, tmp_path / "m", "thread-idle", "interpreter")
    assert code == RECOVERY_EXIT, err
    assert time.monotonic() - t < 30  # the grace (1 s here), not the main thread's 60 s sleep
    assert "did not take it within 1 s" in err, err


# The cluster run: each rank of train_tiny.py marks how it ended, by rank and pid.
RANK = """
import atexit, os, runpy, sys
marks, rank, pid = os.environ["EXIT_MARKS"], os.environ["RAGSHARD_RANK"], os.getpid()
examples = os.environ["EXIT_EXAMPLES"]


def mark(what, text=""):
    with open(os.path.join(marks, f"{rank}.{pid}.{what}"), "w") as f:
        f.write(text)


atexit.register(mark, "atexit")
import ragshard
sys.path.insert(0, examples)
sys.argv = [os.path.join(examples, "train_tiny.py")] + sys.argv[1:]
ended = "returned"
try:
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except ragshard.RecoveryInProgress:
        if rank != os.environ["EXIT_CATCH_RANK"]:
            raise
        ended = "caught"
    if ended == "caught":  # the script goes on: its next ragshard call
        try:
            ragshard.job_info(os.environ["RAGSHARD_PLANNER"], os.environ["RAGSHARD_JOB"],
                              os.environ.get("RAGSHARD_TOKEN_FILE", ""))
        except ragshard.Error as err:
            mark("named", str(err))
        sys.exit(ragshard.RECOVERY_EXIT)  # and leaves as the contract asks
except BaseException as e:
    ended = f"{ended}, {type(e).__name__} {getattr(e, 'code', '')}".removeprefix("returned, ")
    raise
finally:
    mark("finally", ended)
"""


def test_ranks_told_of_a_recovery_leave_cleanly(tmp_path):
    """2 daemons x 2 ranks, rank 1 killed between steps 3 and 4: ranks 0, 2 and 3 get their
    daemons' notice, run their finally blocks and atexit handlers and exit 75 (the launcher
    restarts them without counting: no "exited with" of theirs); rank 3 catches the notice,
    and its next ragshard call raises the named error before it exits 75 itself."""
    from ragshard.cluster import LocalCluster
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "rank.py").write_text(RANK)
    small = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
             "--vocab", "32", "--quiet", "--steps", "5"]
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        e = env()  # (with the cluster's token)
        e.update(EXIT_MARKS=str(marks), EXIT_CATCH_RANK="3", EXIT_EXAMPLES=EXAMPLES)
        cmd = [sys.executable, "-m", "ragshard.launch", "--preload", "torch", "--planner",
               c.planner, "--job", "exit", "--nproc", "4", "--sockets", ",".join(c.sockets),
               "--create-job", "--max-restarts", "1", "--recovery-deadline", "60",
               str(tmp_path / "rank.py"), "--out", str(tmp_path / "out"), *small,
               "--kill-at", f"1:3:between:{tmp_path / 'killed'}"]
        r = preloaded.run(cmd, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(tmp_path / "killed")
    said = [line for line in r.stderr.splitlines()
            if line.startswith("ragshard.launch: ") and "exited with" in line]
    assert said == ["ragshard.launch: rank 1 exited with -9; restarting it (1 of 1)"], said
    got = marks_of(marks)
    for rank in (0, 2, 3):
        told = [k.split(".")[1] for k, v in got.items()
                if k.startswith(f"{rank}.") and k.endswith(".finally") and
                v == ("caught, SystemExit 75" if rank == 3 else "RecoveryInProgress 75")]
        assert len(told) == 1, (rank, sorted(got))
        assert f"{rank}.{told[0]}.atexit" in got, (rank, sorted(got))
        named = got.get(f"{rank}.{told[0]}.named")
        if rank == 3:
            assert named is not None and "recovering in place" in named and \
                "must exit" in named, named
        else:
            assert named is None
    # Every rank's last process (rank 1's restart too) ended its script and its atexit.
    for rank in range(4):
        done = [k for k, v in got.items() if k.startswith(f"{rank}.") and
                k.endswith(".finally") and v == "returned"]
        assert len(done) == 1, (rank, sorted(got))
        assert done[0].replace(".finally", ".atexit") in got
