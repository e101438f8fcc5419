"""ragshard: RaggedShard FSDP for PyTorch training loops.

`ragshard._core` is the C++ client library (a C ABI through ctypes): a `Client` attaches to
the node's `ragshardd`, and its numpy arrays view the daemon's buffers without copying.
`ragshard.torch` shards a `torch.nn.Module` over it (`fully_shard`), `ragshard.launch` starts ranks.
"""
import json
import os

from ._core import Client, DeviceBuffer, Error, Handle, create_job, delete_job  # noqa: F401

__all__ = ["Client", "DeviceBuffer", "Error", "Handle", "create_job", "delete_job", "Env", "connect"]


class Env:
    """Who this rank is, from its environment.

    Started by `ragshard.launch` (or `ragshard-launch`): RAGSHARD_RANK, RAGSHARD_WORLD_SIZE and
    RAGSHARD_NODE. Started by `torchrun`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
    GROUP_RANK (the node's index; the node is called node-<GROUP_RANK> unless RAGSHARD_NODE
    names it). Either way RAGSHARD_PLANNER, RAGSHARD_JOB and RAGSHARD_SOCKET name the planner,
    the job and the node's daemon socket, and RAGSHARD_TOKEN_FILE the planner's token.
    """

    def __init__(self, environ=None):
        e = os.environ if environ is None else environ
        torchrun = "RAGSHARD_RANK" not in e and "RANK" in e
        rank_var, world_var = (("RANK", "WORLD_SIZE") if torchrun
                               else ("RAGSHARD_RANK", "RAGSHARD_WORLD_SIZE"))
        missing = [k for k in ("RAGSHARD_PLANNER", "RAGSHARD_JOB", rank_var, world_var,
                               "RAGSHARD_SOCKET") if k not in e]
        if missing:
            raise Error("INVALID_ARGUMENT: this rank does not know its job: missing "
                        + ", ".join(missing) + " (start ranks with ragshard-launch, or with "
                        "torchrun and RAGSHARD_PLANNER, RAGSHARD_JOB, RAGSHARD_SOCKET set)")
        self.planner = e["RAGSHARD_PLANNER"]
        self.job = e["RAGSHARD_JOB"]
        self.rank = _int(e, rank_var)
        self.world_size = _int(e, world_var)
        self.socket = e["RAGSHARD_SOCKET"]
        self.token_file = e.get("RAGSHARD_TOKEN_FILE", "")
        self.local_rank = _int(e, "LOCAL_RANK") if "LOCAL_RANK" in e else None
        self.local_world_size = (_int(e, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in e
                                 else None)
        default_node = f"node-{_int(e, 'GROUP_RANK')}" if torchrun and "GROUP_RANK" in e else ""
        self.node = e.get("RAGSHARD_NODE", default_node)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise Error(f"INVALID_ARGUMENT: {rank_var}={self.rank} is not a rank of "
                        f"{world_var}={self.world_size}")
        if self.local_rank is not None and self.local_world_size is not None and \
                not 0 <= self.local_rank < self.local_world_size:
            raise Error(f"INVALID_ARGUMENT: LOCAL_RANK={self.local_rank} is not below "
                        f"LOCAL_WORLD_SIZE={self.local_world_size}")


def _int(environ, name):
    try:
        return int(environ[name])
    except ValueError:
        raise Error(f"INVALID_ARGUMENT: {name}='{environ[name]}' is not an integer") from None


def connect(env=None, timeout_ms=120000):
    """A Client for this rank (not yet registered)."""
    env = env or Env()
    return Client(env.planner, env.socket, env.job, env.rank, env.node, timeout_ms,
                  env.token_file)


def plan_of(client):
    """The client's plan as a dict (protobuf JSON with the proto's field names)."""
    return json.loads(client.plan_json())
