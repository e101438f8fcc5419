"""The daemon's recovery notice in a rank's process (docs/recovery.md, "What happens when a rank
process dies"): the job is recovering in place, and the process must end with RECOVERY_EXIT so
that a new one attaches again. The ragshard call that gets the notice raises
RecoveryInProgress, a SystemExit: the script's `finally` blocks and atexit handlers run, and
the interpreter exits with the status. The process remembers the notice: later calls raise it
again (in a thread not told yet, or one on its way out) or an Error naming it (a script that
caught it and went on). Standard library only: ragshard._core raises what this module decides.
"""
import ctypes
import os
import sys
import threading

# The daemon's notice that the job is recovering in place (server/daemon/recovery_state.cc).
RECOVERY_NOTICE = "ragshard recovery in progress"
# A rank's exit status when its job recovers in place (EX_TEMPFAIL): ragshard-launch restarts it
# without counting a restart, and the new process attaches to the same state (docs/recovery.md).
RECOVERY_EXIT = 75
# How long the main thread has to raise a notice another thread got (a hook's, an asynchronous
# save's) before the process exits on its own: it is raised at the main thread's next bytecode,
# unless that thread is blocked in C code (a sleep, a foreign wait).
NOTICE_GRACE_S = 30.0

_notice = None  # the first notice this process got (its message); None: none
_told = set()  # the threads RecoveryInProgress was raised in
_main_told = threading.Event()  # the main thread was one of them
_delivered = []  # the main thread's id, once another thread's notice was sent to it


class RecoveryInProgress(SystemExit):
    """The daemon's recovery notice: the job is recovering in place from a lost rank or node,
    and this process must end so that a new one attaches again and redoes the interrupted step
    (docs/recovery.md). A BaseException, as KeyboardInterrupt is: `except Exception` does not
    catch it, `finally` blocks and atexit handlers run, and uncaught it ends the process with
    status RECOVERY_EXIT and no traceback (a SystemExit whose `code` is 75). A script that
    catches it and goes on gets an Error naming the recovery at its next ragshard call; a call
    made while it is being handled (in a `finally` block it runs through, or in the `except`
    clause that caught it) raises it again. `str()`: the daemon's notice."""

    def __init__(self, message=None):
        super().__init__(message or _notice or RECOVERY_NOTICE)
        self.code = RECOVERY_EXIT
        if _notice is not None and threading.current_thread() is threading.main_thread() and \
                not _main_told.is_set():
            # (also where another thread's notice put it here); one sent and not yet raised is
            # dropped: this one is it.
            _told.add(threading.get_ident())
            _main_told.set()
            if _delivered:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(_delivered[0]), None)


def told():
    """Whether this process got the recovery notice."""
    return _notice is not None


def notice(message=None):
    """Raises RecoveryInProgress in the calling thread: the daemon's notice `message` (the first
    one is remembered and printed), or the one remembered. The main thread is told too where
    another thread got the notice first, as KeyboardInterrupt reaches it: it raises
    RecoveryInProgress at its next bytecode (PyThreadState_SetAsyncExc), and a watchdog ends the
    process with RECOVERY_EXIT if it has not within NOTICE_GRACE_S. So a notice never leaves
    the process running, nor ending with another status, unless the main thread catches it."""
    global _notice
    if _notice is None:
        _notice = message or RECOVERY_NOTICE
        print(f"ragshard: {_notice}; this process exits with {RECOVERY_EXIT} to attach again",
              file=sys.stderr, flush=True)
    _told.add(threading.get_ident())
    if threading.current_thread() is not threading.main_thread() and \
            not _main_told.is_set() and not _delivered:
        _delivered.append(threading.main_thread().ident)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(_delivered[0]),
                                                   ctypes.py_object(RecoveryInProgress))
        threading.Thread(target=_exit_unless_main_told, daemon=True,
                         name="ragshard-recovery-exit").start()
    raise RecoveryInProgress(_notice)


def after():
    """A ragshard call once this process got the notice: raises RecoveryInProgress in a thread
    not told yet, or one handling it (on its way out); else returns the text of the Error the
    call raises (the script caught the notice and went on)."""
    if threading.get_ident() not in _told or _handling():
        notice()
    return (f"FAILED_PRECONDITION: this process was told that its job is recovering in place "
            f"({_notice}) and must exit (status {RECOVERY_EXIT}, ragshard.RECOVERY_EXIT) for a "
            "new process to attach again: a script that catches RecoveryInProgress must let "
            "the process end")


def _handling():
    """Whether the calling thread is handling RecoveryInProgress: in an except clause or a
    finally block it runs through (or an exception raised there)."""
    e, seen = sys.exc_info()[1], 0
    while e is not None and seen < 16:
        if isinstance(e, RecoveryInProgress):
            return True
        e, seen = e.__context__, seen + 1
    return False


def _exit_unless_main_told():
    if _main_told.wait(NOTICE_GRACE_S):
        return
    try:
        print(f"ragshard: the recovery notice reached a thread other than the main one, which "
              f"did not take it within {NOTICE_GRACE_S:g} s; exiting with {RECOVERY_EXIT} now",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(RECOVERY_EXIT)
