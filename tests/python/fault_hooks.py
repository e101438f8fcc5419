"""The tests' fault hooks (ragshard._faults's points), registered when a rank imports this
module: the tests' launches preload it (`ragshard.launch --preload torch,fault_hooks`, with this
folder on PYTHONPATH), and each hook reads its setting from the environment:

* RAGSHARD_SHRINK_FAULT="rank=R,mark=PATH": the shrink successor's rank R kills itself with
  SIGKILL in the middle of its take-over (its shards moved, nothing marked), once: only while the
  file PATH does not exist (it is created first);
* RAGSHARD_CHECKPOINT_FAULT="pos=P,step=N,bytes=B": the rank at shard position P kills itself
  once it has written B bytes of its part of the save of step N;
* RAGSHARD_CHECKPOINT_WRITE_HOLD=1: an asynchronous save's write holds after its first piece
  until the training thread waits for it (the next step, or SaveHandle.result()).

A setting that is not of its form raises an error naming it."""
import os
import signal

from ragshard import _faults
from ragshard._core import Error
from ragshard.checkpoint import CheckpointError


def _spec(name, form, error):
    spec = os.environ.get(name, "")
    if not spec:
        return None
    try:
        return dict(kv.split("=", 1) for kv in spec.split(","))
    except ValueError:
        raise error(f"{name}: '{spec}' is not {form}") from None


def shrink_take_over(rank):
    f = _spec("RAGSHARD_SHRINK_FAULT", "rank=R,mark=PATH",
              lambda m: Error("INVALID_ARGUMENT: " + m))
    if f is None:
        return
    try:
        at, mark = int(f["rank"]), f["mark"]
    except (KeyError, ValueError):
        raise Error(f"INVALID_ARGUMENT: RAGSHARD_SHRINK_FAULT: '{os.environ['RAGSHARD_SHRINK_FAULT']}'"
                    " is not rank=R,mark=PATH") from None
    if at == rank and not os.path.exists(mark):
        open(mark, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_kill_after(pos, step):
    f = _spec("RAGSHARD_CHECKPOINT_FAULT", "pos=P,step=N,bytes=B", CheckpointError)
    if f is None:
        return None
    try:
        match = int(f["pos"]) == pos and int(f["step"]) == step
        return int(f["bytes"]) if match else None
    except (KeyError, ValueError):
        raise CheckpointError(f"RAGSHARD_CHECKPOINT_FAULT: '{os.environ['RAGSHARD_CHECKPOINT_FAULT']}'"
                              " is not pos=P,step=N,bytes=B") from None


def checkpoint_hold_write():
    return os.environ.get("RAGSHARD_CHECKPOINT_WRITE_HOLD", "") == "1"


_faults.register("shrink.take_over", shrink_take_over)
_faults.register("checkpoint.kill_after", checkpoint_kill_after)
_faults.register("checkpoint.hold_write", checkpoint_hold_write)
