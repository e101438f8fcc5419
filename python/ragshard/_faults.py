"""Fault points: the places where the tests inject a fault (a process killed in the middle of a
shrink's take-over or of a checkpoint's write, a write held across a step). Production code
calls `point` and registers nothing, so a point does nothing there; the behaviour is the tests'
own, in tests/python/fault_hooks.py, which the tests' launches import into the ranks (the
launcher's --preload)."""

_HOOKS = {}

# The points, and what each returns where a hook answers (None where none is registered):
#   "shrink.take_over" (rank): nothing; called once the shrink's successor rank `rank` has
#       moved its shards, before it marks the take-over done.
#   "checkpoint.kill_after" (pos, step): the bytes of its part of step `step`'s save after which
#       the rank at shard position `pos` dies, or None.
#   "checkpoint.hold_write" (): whether an asynchronous save's write is held until the training
#       thread waits for it.
POINTS = ("shrink.take_over", "checkpoint.kill_after", "checkpoint.hold_write")


def register(name, hook):
    """Tests only: `hook(**where)` answers point `name`."""
    if name not in POINTS:
        raise ValueError(f"fault point '{name}' does not exist (one of {', '.join(POINTS)})")
    _HOOKS[name] = hook


def point(name, **where):
    """What the hook registered for `name` answers, or None (production: always None)."""
    hook = _HOOKS.get(name)
    return None if hook is None else hook(**where)
