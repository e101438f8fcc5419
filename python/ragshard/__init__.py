"""ragshard: RaggedShard FSDP for PyTorch training loops.

`ragshard._core` is the C++ client library (pybind11): a `Client` attaches to the node's
`ragshardd`, and its numpy arrays view the daemon's buffers without copying. `ragshard.torch`
shards a `torch.nn.Module` over it (`fully_shard`), `ragshard.launch` starts ranks.
"""
import json
import os

from ._core import Client, Error, Handle, create_job, delete_job  # noqa: F401

__all__ = ["Client", "Error", "Handle", "create_job", "delete_job", "Env", "connect"]


class Env:
    """What `python3 -m ragshard.launch` tells each rank, through RAGSHARD_* variables."""

    def __init__(self):
        missing = [k for k in ("RAGSHARD_PLANNER", "RAGSHARD_JOB", "RAGSHARD_RANK",
                               "RAGSHARD_WORLD_SIZE", "RAGSHARD_SOCKET") if k not in os.environ]
        if missing:
            raise Error("INVALID_ARGUMENT: not started by ragshard.launch (missing "
                        + ", ".join(missing) + ")")
        self.planner = os.environ["RAGSHARD_PLANNER"]
        self.job = os.environ["RAGSHARD_JOB"]
        self.rank = int(os.environ["RAGSHARD_RANK"])
        self.world_size = int(os.environ["RAGSHARD_WORLD_SIZE"])
        self.socket = os.environ["RAGSHARD_SOCKET"]
        self.node = os.environ.get("RAGSHARD_NODE", "")
        self.token_file = os.environ.get("RAGSHARD_TOKEN_FILE", "")


def connect(env=None, timeout_ms=120000):
    """A Client for this rank (not yet registered)."""
    env = env or Env()
    return Client(env.planner, env.socket, env.job, env.rank, env.node, timeout_ms,
                  env.token_file)


def plan_of(client):
    """The client's plan as a dict (protobuf JSON with the proto's field names)."""
    return json.loads(client.plan_json())
