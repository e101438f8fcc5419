"""fully_shard's timeline. With RAGSHARD_TRACE=DIR each rank records one (DIR/rank<R>.json at
exit): every operation it waited for (issued, run by the daemon, waited; time.monotonic_ns(),
the daemon's clock too), each unit's forward and backward compute, and the start of each step's
forward. The client records the operations into `client.trace`; this records the rest."""
import atexit
import json
import os
import time


class Trace:
    """The compute events of a ShardedModule's timeline, in `client.trace` (a list where tracing
    is on, else None). `directory`: where the timeline is written at exit (empty or None: no
    timeline); `unit_names`: the units' names, written with it."""

    def __init__(self, client, unit_names, directory):
        self._client = client
        self._computing = {}  # (phase, unit) -> when its compute began
        if not directory:
            return
        client.trace = []
        path = os.path.join(directory, f"rank{client.rank}.json")

        def write():
            os.makedirs(directory, exist_ok=True)
            with open(path, "w") as f:
                json.dump({"units": list(unit_names), "events": client.trace}, f)
        atexit.register(write)

    @property
    def on(self):
        return self._client.trace is not None

    def step(self):
        """A training step's forward begins."""
        if self.on:
            self._client.trace.append({"event": "step", "t": time.monotonic_ns()})

    def begins(self, phase, ui):
        """Unit `ui`'s compute of `phase` ("forward" or "backward") begins."""
        if self.on:
            self._computing[(phase, ui)] = time.monotonic_ns()

    def ends(self, phase, ui):
        t0 = self._computing.pop((phase, ui), None) if self.on else None
        if t0 is not None:
            self._client.trace.append({"event": phase, "unit": ui, "start": t0,
                                       "end": time.monotonic_ns()})
