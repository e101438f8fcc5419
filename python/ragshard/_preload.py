"""ragshard.launch --preload: ranks forked from one interpreter that has imported the given
modules, instead of a fresh interpreter per rank.

On a small machine a rank's `import torch` is seconds of CPU, paid once per rank; forked ranks
share the launcher's import. The ranks are forked before the launcher talks to the planner (no
gRPC thread is ever forked) and wait on a pipe until it has created the job; each then runs the
script as `__main__` with its own environment, argv and thread count, and exits through the
interpreter's exit handlers. With --max-restarts the launcher also forks spares then, which a
restarted rank's process becomes (its environment sent through the pipe): a restart then costs
a fork, not an interpreter and its imports.
"""
import atexit
import importlib
import json
import os
import runpy
import signal
import sys


_unstarted = set()  # the launcher's write ends of the pipes of ranks not yet started


class ForkedRank:
    """A forked rank, with the part of subprocess.Popen's interface that the launcher uses."""

    def __init__(self, pid, go):
        self.pid, self._go, self.returncode = pid, go, None

    def start(self, env=None):
        """Lets the rank run its script, with `env` where given (a spare forked without one:
        a restarted rank's)."""
        data = b"1" if env is None else b"E" + json.dumps(dict(env)).encode()
        while data:
            data = data[os.write(self._go, data):]
        self._close()

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def abandon(self):
        """Ends a rank that never started (closing its pipe: it exits 0 without running)."""
        if self._go >= 0:
            self._close()

    def _close(self):
        _unstarted.discard(self._go)
        os.close(self._go)
        self._go = -1


def import_modules(names):
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise SystemExit(f"ragshard.launch: --preload {name}: {e}") from None


def fork_rank(script, args, env, threads):
    """Forks one rank; it runs `script` once ForkedRank.start() is called (with `env`, or the
    environment start() gives: a spare forked with env None)."""
    sys.stdout.flush()
    sys.stderr.flush()
    go_r, go_w = os.pipe()
    # The launcher's SIGINT, SIGTERM and SIGHUP handlers stop the launcher: the rank gets the
    # defaults of a fresh interpreter, and none of them reaches it between the fork and then.
    stop = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(go_r)
        _unstarted.add(go_w)
        return ForkedRank(pid, go_w)
    code = 1
    try:  # whatever happens, the rank never returns into the launcher's code
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        # Only the launcher holds the other ranks' pipes: each sees its end when the launcher
        # closes it.
        for fd in _unstarted | {go_w}:
            os.close(fd)
        data = b""
        while chunk := os.read(go_r, 1 << 16):
            data += chunk
        os.close(go_r)
        if data[:1] == b"E":  # a spare, started as a rank that is restarted
            env = json.loads(data[1:])
        code = _run(script, args, env, threads) if data[:1] in (b"1", b"E") else 0
    finally:
        os._exit(code)


def exit_status(e):
    """The status an interpreter exits with on SystemExit `e` (a message is printed: 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _run(script, args, env, threads):
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        if threads and "torch" in sys.modules:
            # The launcher's import read its own OMP_NUM_THREADS; the rank's count is set here.
            sys.modules["torch"].set_num_threads(int(threads))
        sys.argv = [script] + list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: B036 - a rank's uncaught error ends it, as in a fresh interpreter
        sys.excepthook(*sys.exc_info())  # (which prints it; ragshard's marks the rank lost)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code & 0xFF
