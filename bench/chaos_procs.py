"""The processes of bench/chaos_report.py's trials: what is alive and must be killed at exit
(`_live`, swept by `sweep`), the signal handler that turns the first SIGINT/SIGTERM into
`Interrupted`, a training's launchers on hosts of their own seen as one process (`HostLaunch`,
`host_launchers`), and the helpers that read a trial's logs, kill a launcher's session and stop
a cluster, naming what needed SIGKILL. A trial's files live outside /tmp (WORK_ROOT), which
each host has of its own."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback


# ---------------------------------------------------------------------------------- signals

class Interrupted(KeyboardInterrupt):
    pass


_signalled = []
_live = {"procs": [], "sessions": [], "clusters": []}  # swept at exit, whatever happened


def sweep():
    """Kills whatever a trial started that is still alive (after an interrupt)."""
    for p in _live["procs"]:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
            except OSError:
                pass
    for sid in _live["sessions"]:
        kill_session(sid)
    for c in _live["clusters"]:
        for p in c.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
        c.stop()
    for k in _live:
        _live[k] = []


def _on_signal(signum, frame):
    """The first SIGINT/SIGTERM raises (the `finally`s clean up); later ones are ignored, so
    that the cleanup itself is not cut short."""
    if _signalled:
        return
    _signalled.append(signum)
    raise Interrupted(f"signal {signum}")


# ---------------------------------------------------------------------------------- helpers

def read_from(path, offset=0):
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def error_line(out):
    """The line of a rank's output that says why it failed: the last line naming an error,
    else the last non-empty line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "failed" in ln or "lost" in ln:
            return ln
    return lines[-1] if lines else ""


def session_members(sid):
    """Pids of live processes in session `sid` (a launcher started with start_new_session)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # fields: state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(d))
    return pids


def kill_session(sid):
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(sid):  # a member that left the group but not the session
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_cluster_checked(c):
    """Stops the cluster's processes as LocalCluster.stop does (SIGCONT, SIGTERM, 10 s, then
    SIGKILL) and returns the ones that needed SIGKILL, for the report."""
    stuck = []
    names = {}
    for p in c.procs:  # planner, daemons node-0.., restarted planners, replacement daemons
        args = list(p.args) if isinstance(p.args, (list, tuple)) else []
        names[p.pid] = f"daemon {args[args.index('--node-id') + 1]}" \
            if "--node-id" in args[:-1] else "planner"
    for p in c.procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
            except OSError:
                pass
    deadline = time.monotonic() + 10
    for p in c.procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stuck.append(names.get(p.pid, str(p.pid)))
            p.kill()
            p.wait()
    return stuck


def keep_logs(keep_dir, fault, trial, dirs):
    if not keep_dir:
        return None
    dest = os.path.join(keep_dir, f"{fault}-{trial:02d}")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest, exist_ok=True)
    for d in dirs:
        if not d or not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src = os.path.join(d, name)
            if os.path.isfile(src) and name.endswith((".log", ".txt")):
                shutil.copy(src, os.path.join(dest, name))
    return dest


def brief_tail(path, n=1500):
    """The end of a log, on one line."""
    return " ".join(read_from(path).split())[-n:]


# A trial's directory, seen by every host (each has a /tmp of its own).
WORK_ROOT = "/var/tmp"


class HostLaunch:
    """A training's launchers (a ragshard.launch per host, each in a session of its own) seen as
    one: it runs while any of them does, and its exit code is the first non-zero one among them
    (in the order they were added), else 0; `failed()` says at once when one has failed. A
    launcher lost with its host leaves it (`drop`), its replacement joins it (`add`)."""

    def __init__(self):
        self.procs = []

    def add(self, p):
        self.procs.append(p)
        _live["sessions"].append(p.pid)

    def drop(self, p):
        """`p` killed with its session (its ranks) and no longer counted."""
        self.procs.remove(p)
        kill_session(p.pid)
        p.wait()

    def poll(self):
        codes = [p.poll() for p in self.procs]
        return None if None in codes else next((c for c in codes if c), 0)

    def failed(self):
        """The exit code of a launcher that ended non-zero, or None."""
        return next((c for c in (p.poll() for p in self.procs) if c), None)

    @property
    def returncode(self):
        return self.poll()

    def wait(self, timeout=None):
        """Waits for every launcher (subprocess.TimeoutExpired past `timeout` s)."""
        end = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            p.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self.poll()

    def kill(self):
        for p in self.procs:
            kill_session(p.pid)
            p.wait()

    def members(self):
        """The live processes of the launchers' sessions."""
        return [pid for p in self.procs for pid in session_members(p.pid)]


def host_launchers(launch, c, job, where, nnodes, per_host, argv, log, create=True):
    """Adds to HostLaunch `launch` a `ragshard.launch --nnodes NNODES --node-rank K` (with
    --create-job unless `create` is false: the job made before) per (node rank K, host, daemon
    index) of `where`, on that host of NamespacedCluster `c` with its daemon, each in a session
    of its own, writing `log`; `argv`
    the launcher's other flags, the script and its arguments. Each is added as it starts (the
    sweep kills it however the trial ends). Returns `launch`."""
    for k, host, i in where:
        launch.add(c.spawn(host, [sys.executable, *c.launcher(job, k, i, nnodes, nnodes * per_host,
                                                              create), *argv],
                           env=c.env(), stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, start_new_session=True))
    return launch


def run_to_end(launch, log_path, what, timeout=600):
    """Waits up to `timeout` s for an uninterrupted run's HostLaunch, kills what is left of it,
    and raises naming `what` unless it exited 0."""
    try:
        launch.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        launch.kill()
    if launch.returncode != 0:
        raise RuntimeError(f"{what} exited {launch.returncode}: {brief_tail(log_path)}")


def job_show(build, c, job):
    """`ragshardctl job show JOB` on the planner's host of NamespacedCluster `c`."""
    return c.run("planner", [os.path.join(build, "ctl", "ragshardctl"), "--planner", c.planner,
                             "--token-file", c.token_file, "job", "show", job],
                 capture_output=True, text=True, timeout=60)


def await_launcher(p, since, limit, log_path, res):
    """Waits up to `limit` s after `since` (a kill's time) for the HostLaunch `p` to end: still
    running then is a hang (TimeoutError naming the log's end); a launcher that fails ends the
    wait at once. Records in `res` the seconds it took, its exit code and what of its sessions
    outlived it."""
    while p.poll() is None and p.failed() is None and time.monotonic() - since < limit:
        time.sleep(0.01)  # (the seconds are a figure of the report)
    if p.poll() is None and p.failed() is None:
        raise TimeoutError(f"a hang: the training still running {limit:g} s after the kill: "
                           f"{brief_tail(log_path)}")
    res["seconds"] = round(time.monotonic() - since, 3)
    res["exit_code"] = p.failed() or p.returncode
    res["leftover_after_launcher"] = p.members()


def end_trial(res, launch, cluster, log, keep_dir, fault, trial, workdir):
    """A trial's way out, however it went: its launch's session killed, its cluster stopped
    (what would not stop is recorded), and a failed trial's logs kept."""
    if launch is not None:
        launch.kill()
    res["stuck_at_stop"] = stop_cluster_checked(cluster)
    if not res["passed"] and log is not None:
        log.flush()
        res["logs"] = keep_logs(keep_dir, fault, trial, [workdir, cluster.dir])


def failed_trial(res, e, keep_dir, fault, trial, dirs):
    """A trial that raised `e`: failed, with the error, its traceback and,
    unless end_trial kept them already, its logs. The campaign goes on."""
    res["passed"] = False
    res["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:1500]
    res["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
    if keep_dir and "logs" not in res:
        res["logs"] = keep_logs(keep_dir, fault, trial, dirs)


class TrialRun:
    """One trial's way in and out (`with TrialRun(res, fault, trial, keep_dir) as t:`): its work
    directory (`t.workdir`, with `t.out` and `t.log_path`), its launcher log (`t.open_log()`),
    its cluster (`with t.cluster(NamespacedCluster(...)) as c:`) and its launch (`t.launch`, a
    HostLaunch). However the trial goes, the launch's session is killed and the cluster stopped
    (end_trial); an Exception fails the trial (failed_trial) and the campaign goes on, while an
    interrupt goes through; the log is closed and the directory removed."""

    def __init__(self, res, fault, trial, keep_dir):
        self.res, self.fault, self.trial, self.keep_dir = res, fault, trial, keep_dir
        self.workdir = tempfile.mkdtemp(prefix="ragshard-chaos-", dir=WORK_ROOT)
        self.out = os.path.join(self.workdir, "train")
        self.log_path = os.path.join(self.workdir, "launcher.log")
        self.launch, self.log, self._cluster = None, None, None

    def open_log(self):
        self.log = open(self.log_path, "w")
        return self.log

    @contextlib.contextmanager
    def cluster(self, cluster):
        with cluster as c:
            self._cluster = c
            _live["clusters"].append(c)
            try:
                yield c
            finally:
                end_trial(self.res, self.launch, c, self.log, self.keep_dir, self.fault,
                          self.trial, self.workdir)

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        try:
            if kind is not None and issubclass(kind, Exception):
                failed_trial(self.res, e, self.keep_dir, self.fault, self.trial,
                             [self.workdir] + ([self._cluster.dir] if self._cluster else []))
                return True  # the trial failed; the campaign goes on
            return False
        finally:
            if self.log is not None:
                self.log.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
