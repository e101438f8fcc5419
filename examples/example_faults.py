"""train_tiny.py's fault points for the recovery tests and benchmarks: --kill-at kills the rank
(SIGKILL) at a point of one of its steps, --hold-at holds it there, writing its pid to a mark
file, until the test kills it (and its node's daemon) or removes the mark (it goes on then, and
writes MARK.done: a restarted rank does not hold there again), --raise-at raises an uncaught
exception there (a rank that crashes)."""
import contextlib
import os
import signal
import time


class Kill:
    """--kill-at (repeatable): this rank's SIGKILL at points of its steps, each once (while its
    mark file does not exist)."""

    def __init__(self, specs, rank, holds=(), client=None, raises=()):
        self.client = client  # the rank's Client: its protection (--redundancy) ends a step
        self.points = {}  # (0-based step, phase) -> mark file
        self.holds = set()  # the points of --hold-at
        self.raises = set()  # the points of --raise-at
        for spec, how in ([(s, "kill") for s in specs] + [(s, "hold") for s in holds] +
                          [(s, "raise") for s in raises]):
            r, step, phase, mark = spec.split(":", 3)
            if phase not in ("forward", "backward", "step", "protected", "between"):
                raise SystemExit(f"--kill-at: phase '{phase}' is not one of forward, backward, "
                                 "step, protected, between")
            if int(r) == rank:
                self.points[(int(step) - 1, phase)] = mark
                if how == "hold":
                    self.holds.add((int(step) - 1, phase))
                if how == "raise":
                    self.raises.add((int(step) - 1, phase))

    def armed(self, step, phase):
        mark = self.points.get((step, phase))
        return mark is not None and not os.path.exists(mark) and \
            not os.path.exists(mark + ".done")

    def at(self, step, phase):
        if self.armed(step, phase):
            if (step, phase) in self.holds:
                with open(self.points[(step, phase)] + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(self.points[(step, phase)] + ".tmp", self.points[(step, phase)])
                # Until the test kills this process (and its node's daemon), or removes the mark
                # (a partition: the rank goes on, into whatever its node's link allows).
                while os.path.exists(self.points[(step, phase)]):
                    time.sleep(0.05)
                open(self.points.pop((step, phase)) + ".done", "w").close()
                return
            open(self.points[(step, phase)], "w").close()
            if (step, phase) in self.raises:
                raise RuntimeError(f"--raise-at: step {step + 1}, {phase} (a crash on purpose)")
            os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def inside_optimizer(self, step):
        """During the optimizer step: at "step", after the first torch optimizer inside has
        updated its pieces, before the step completes (on a rank with no pieces to update, no
        torch optimizer inside, once the step committed, before its protection starts,
        --redundancy, if it has one); at "protected", once the step committed and its
        protection started (it runs in the background of the next step)."""
        armed = [p for p in ("step", "protected") if self.armed(step, p)]
        if not armed:
            yield
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook
        hook = register_optimizer_step_post_hook(lambda *_: self.at(step, "step"))
        protect = None
        if self.client is not None:
            protect = self.client.protect

            def protected():
                self.at(step, "step")
                return _Then(protect(), lambda: self.at(step, "protected"))
            self.client.protect = protected
        try:
            yield
        finally:
            hook.remove()
            if protect is not None:
                del self.client.protect  # the class's method again


class _Then:
    """A handle whose wait() runs `then` once the operation is done."""

    def __init__(self, handle, then):
        self.handle, self.then = handle, then

    def wait(self, *args, **kwargs):
        out = self.handle.wait(*args, **kwargs)
        self.then()
        return out
