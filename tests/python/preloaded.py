"""`run(cmd, ...)`: subprocess.run for the tests' `python -m ragshard.launch ...` and `python
script.py ...` commands, forked from one interpreter that has imported torch once per pytest
process (under ctest, one per test file: a fork server) instead of a fresh interpreter per
command.

On CI's 2 cores a fresh interpreter's `import torch` (with torch._dynamo, which torch.optim's
first param group loads, and torch.distributed.checkpoint) is about 2 s of one core, paid by
every launcher and every one-process reference run before any rank starts: hundreds of times a
suite. The launcher's own `--preload torch` shares that import with its ranks; this shares it
with the launchers. What runs is the same code as `python -m ragshard.launch` (runpy, in a child
that gets the command's argv, environment, working directory and standard streams, in a process
group of its own); only the interpreter's start is shared, with what it read at import time
(the server's environment: TORCH_* settings, which the tests set none of that differ; a command's
OMP_NUM_THREADS is applied with torch.set_num_threads).
Commands of another interpreter or with other arguments (stdin, input, ...) go to
subprocess.run unchanged.

`spawn(cmd, host=PID, ...)`: the same, started and left running as subprocess.Popen would (in a
session of its own, stdout and stderr to one file), optionally on a host of its own
(ragshard.hosts): the child joins the network and mount namespaces of the host's holder process
`PID`, as `nsenter --target PID --net --mount` would, before it changes to its working directory.

The server is this file run as a script; it exits when the pytest process that started it
closes its stdin (or dies), killing the commands still running."""
import atexit
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_exit_status():
    """ragshard._preload.exit_status, loaded from its file (standard library only) without
    importing the ragshard package: the commands import the ragshard their own environment
    names, never one the server imported before forking them."""
    path = os.path.join(_ROOT, "python", "ragshard", "_preload.py")
    spec = importlib.util.spec_from_file_location("_ragshard_preload_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.exit_status


exit_status = _load_exit_status()

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint")
_lock = threading.Lock()
_server = None  # (Popen, socket path, its temporary directory)
_started = []  # atexit registered
_ANSWER_S = 60  # the server forks at once; and a killed command's status comes right after


def _routable(cmd):
    if not isinstance(cmd, (list, tuple)) or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    return (cmd[1] == "-m" and len(cmd) > 2 and cmd[2] == "ragshard.launch") or \
        str(cmd[1]).endswith(".py")


def _start():
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is not None:
            _server[2].cleanup()  # (it died: a new one)
            _server = None
        if _server is None:
            tmp = tempfile.TemporaryDirectory(prefix="ragshard-preloaded-")
            path = os.path.join(tmp.name, "sock")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                proc.kill()
                proc.wait()
                raise RuntimeError(f"preloaded: the fork server did not start ({line!r})")
            if not _started:
                atexit.register(_stop)
                _started.append(True)
            _server = (proc, path, tmp)
        return _server[1]


def _stop():
    global _server
    with _lock:
        if _server is not None:
            proc, _, tmp = _server
            proc.stdin.close()  # the server sees EOF, kills what still runs and exits
            proc.wait()
            tmp.cleanup()
            _server = None


def _read_line(conn):
    """One answer of the server (a pid, an exit status), within the connection's timeout."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError("preloaded: the fork server closed the connection")
        data += chunk
    return data


def run(cmd, env=None, timeout=None, capture_output=False, text=False, cwd=None, check=False,
        **kwargs):
    """subprocess.run(cmd, ...), forked from the preloaded server where `cmd` is this
    interpreter running ragshard.launch or a script; returns a subprocess.CompletedProcess."""
    if kwargs or not _routable(cmd):
        return subprocess.run(cmd, env=env, timeout=timeout, capture_output=capture_output,
                              text=text, cwd=cwd, check=check, **kwargs)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # Not captured: the test process's own descriptors 1 and 2, as a child would inherit.
        conn, pid = _send(cmd, env, cwd, [out.fileno(), err.fileno()] if capture_output
                          else [1, 2])
        with conn:
            conn.settimeout(timeout)
            try:
                code = int(_read_line(conn))
            except BaseException as e:  # a timeout, or the test interrupted: the command goes too
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                conn.settimeout(_ANSWER_S)
                _read_line(conn)
                if isinstance(e, socket.timeout):
                    raise subprocess.TimeoutExpired(cmd, timeout) from None
                raise
        streams = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            streams.append(data.decode(errors="replace") if text and data is not None else data)
    result = subprocess.CompletedProcess(list(cmd), code, streams[0], streams[1])
    if check:
        result.check_returncode()
    return result


def _send(cmd, env, cwd, fds, host=None):
    """Sends one command to the server; the connection, once the server forked it, and its pid."""
    path = _start()
    request = json.dumps({"argv": [str(a) for a in cmd[1:]],
                          "env": dict(os.environ if env is None else env),
                          "cwd": os.path.abspath(cwd or os.getcwd()), "host": host}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        sys.stdout.flush()
        sys.stderr.flush()
        socket.send_fds(conn, [struct.pack("!Q", len(request))], fds)
        conn.sendall(request)
        conn.settimeout(_ANSWER_S)
        return conn, int(_read_line(conn))
    except BaseException:
        conn.close()
        raise


class Spawned:
    """A command spawn() started: the part of subprocess.Popen's interface the tests use (pid,
    its process group's id too; returncode, poll, wait, send_signal, kill, communicate, whose
    first item is the command's output where spawn kept it)."""

    def __init__(self, cmd, conn, pid, out):
        self.args, self.pid, self.returncode = list(cmd), pid, None
        self._conn, self._out, self._got = conn, out, b""

    def _status(self, timeout):
        self._conn.settimeout(timeout)
        try:
            while not self._got.endswith(b"\n"):
                chunk = self._conn.recv(64)
                if not chunk:
                    raise RuntimeError("preloaded: the fork server closed the connection")
                self._got += chunk
        except (BlockingIOError, socket.timeout):
            return None
        self.returncode = int(self._got)
        self._conn.close()
        return self.returncode

    def poll(self):
        return self.returncode if self.returncode is not None else self._status(0)

    def wait(self, timeout=None):
        if self.returncode is None and self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        self.wait(timeout)
        if self._out is None:
            return None, None
        self._out.seek(0)
        return self._out.read().decode(errors="replace"), None


def spawn(cmd, host=None, env=None, cwd=None, stdout=None):
    """subprocess.Popen(cmd, env=env, cwd=cwd, stdout=..., stderr=STDOUT, text=True,
    start_new_session=True) for a command run() would fork, forked likewise; in the namespaces
    of process `host` where given (a host's holder). Its output goes to `stdout` (a file) where
    given, else to a file communicate() reads. Other commands: ValueError."""
    if not _routable(cmd):
        raise ValueError(f"preloaded.spawn: not a command it forks: {cmd[:3]}")
    out = None if stdout is not None else tempfile.TemporaryFile()
    fd = (stdout or out).fileno()
    try:
        conn, pid = _send(cmd, env, cwd, [fd, fd], host)
    except BaseException:
        if out is not None:
            out.close()
        raise
    return Spawned(cmd, conn, pid, out)


# The server.

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000


def _enter(pid):
    """Joins the network and mount namespaces of process `pid` (a host's holder), as nsenter
    does: both opened first, the network's joined first. The child is single-threaded (forked),
    as joining a mount namespace needs; the working directory is set after."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY) for ns in ("net", "mnt")]
    try:
        for fd, kind in zip(fds, (CLONE_NEWNET, CLONE_NEWNS)):
            if libc.setns(fd, kind) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into process {pid}'s namespaces: {os.strerror(err)}")
    finally:
        for fd in fds:
            os.close(fd)


def _sitecustomize(paths):
    """Imports the first sitecustomize.py of `paths` (the command's PYTHONPATH), as a fresh
    interpreter's start would have (the server's own start imported its own, or none)."""
    for path in paths:
        found = os.path.join(path, "sitecustomize.py")
        if os.path.isfile(found):
            spec = importlib.util.spec_from_file_location("sitecustomize", found)
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
            return


def _child(request, fds):
    """Runs one command in the forked child; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        if request.get("host"):
            _enter(int(request["host"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            # The server's import read its own OMP_NUM_THREADS; the command's count is set here.
            sys.modules["torch"].set_num_threads(int(threads))
        # PYTHONPATH as a fresh interpreter would read it, ahead of the server's own path.
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        _sitecustomize(extra)
        argv = request["argv"]
        if argv[0] == "-m":
            sys.path[:] = [os.getcwd(), *extra] + [p for p in sys.path[1:] if p not in extra]
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.path[:] = [os.path.dirname(script), *extra] + \
                [p for p in sys.path[1:] if p not in extra]
            sys.argv = argv
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: B036 - an uncaught error ends the command, as in an interpreter
        sys.excepthook(*sys.exc_info())  # (which prints it, as an interpreter's does)
        code = 1
    finally:
        try:
            threading._shutdown()  # as an interpreter's exit: its other threads are joined
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _fork_command(conn, listener, running, wake):
    """Reads one request from `conn` and forks its command; its exit status goes to `conn`
    (kept in `running`) once it ends."""
    conn.settimeout(_ANSWER_S)
    head, fds, _, _ = socket.recv_fds(conn, 8, 2)
    try:
        if len(head) != 8 or len(fds) != 2:
            raise ValueError(f"a request of {len(head)} bytes and {len(fds)} descriptors")
        (size,) = struct.unpack("!Q", head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("the client left mid-request")
            body += chunk
        request = json.loads(body)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in running.values():
                other.close()
            conn.close()
            for fd in wake:
                os.close(fd)
            _child(request, fds)
        try:
            os.setpgid(pid, pid)  # (the child does too: whichever runs first)
        except OSError:
            pass
    finally:
        for fd in fds:
            os.close(fd)
    running[pid] = conn  # before the answer: a client gone now still has its command reaped
    conn.sendall(b"%d\n" % pid)


def _serve(path):
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running = {}  # pid -> the connection its exit status goes to
    print("ready", flush=True)
    try:
        while True:
            readable, _, _ = select.select([listener, sys.stdin, wake_r], [], [])
            if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
                return
            if wake_r in readable:
                os.read(wake_r, 4096)
            if listener in readable:
                conn, _ = listener.accept()
                try:
                    _fork_command(conn, listener, running, (wake_r, wake_w))
                except (OSError, ValueError) as e:  # a client gone mid-request: not served
                    print(f"preloaded: a request was dropped: {e}", file=sys.stderr, flush=True)
                    for pid in [p for p, c in running.items() if c is conn]:
                        _kill_group(pid)  # (reaped below)
                    conn.close()
            while running:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = running.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(b"%d\n" % os.waitstatus_to_exitcode(status))
                    except OSError:
                        pass
                    conn.close()
    finally:
        for pid in running:
            _kill_group(pid)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _serve(sys.argv[1])
