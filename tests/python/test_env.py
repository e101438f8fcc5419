"""ragshard.Env: who a rank is, from ragshard.launch's variables or from torchrun's."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build")),
                                "python"))

import ragshard  # noqa: E402

JOB = {"RAGSHARD_PLANNER": "127.0.0.1:7070", "RAGSHARD_JOB": "j",
       "RAGSHARD_SOCKET": "/tmp/d0.sock"}


def test_launch_variables():
    e = ragshard.Env({**JOB, "RAGSHARD_RANK": "3", "RAGSHARD_WORLD_SIZE": "4",
                      "RAGSHARD_NODE": "node-1", "RANK": "9"})
    assert (e.rank, e.world_size, e.node, e.socket) == (3, 4, "node-1", "/tmp/d0.sock")


def test_torchrun_variables():
    e = ragshard.Env({**JOB, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (5, 8, 1, 4)
    assert e.node == "node-1"
    assert ragshard.Env({**JOB, "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0",
                         "RAGSHARD_NODE": "gpu-17"}).node == "gpu-17"


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "missing RAGSHARD_PLANNER, RAGSHARD_JOB, RAGSHARD_SOCKET"),
    ({**JOB}, "missing RAGSHARD_RANK, RAGSHARD_WORLD_SIZE"),
    ({**JOB, "RANK": "two", "WORLD_SIZE": "4"}, "RANK='two' is not an integer"),
    ({**JOB, "RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not a rank of WORLD_SIZE=4"),
    ({**JOB, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
])
def test_bad_environments_are_named(env, message):
    with pytest.raises(ragshard.Error, match=message):
        ragshard.Env(env)
