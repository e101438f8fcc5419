"""Running a benchmark's command in a process session of its own, so that on a timeout the
command and every process it started are killed together; and the processes a command started
(`descendants`, from /proc)."""
import os
import signal
import subprocess


def run_in_session(cmd, env, timeout, on_start=None):
    """Runs `cmd`; returns (exit code, its output). `on_start(pid)` is called once it runs."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    if on_start is not None:
        on_start(p.pid)
    try:
        text = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        text = f"timed out after {timeout} s"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return p.returncode, text


def descendants(pid):
    """Pids of the live processes under `pid` (children, theirs, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            pass
    return out
