"""ragshard.Env: who a rank is, from ragshard.launch's variables, torchrun's or srun's, and
the defaults under bare torchrun."""
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
    assert (e.local_rank, e.local_world_size) == (None, None)  # not said: registered alone
    e = ragshard.Env({**JOB, "RAGSHARD_RANK": "3", "RAGSHARD_WORLD_SIZE": "4",
                      "RAGSHARD_LOCAL_RANK": "1", "RAGSHARD_LOCAL_WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "8"})
    assert (e.local_rank, e.local_world_size) == (1, 2)


def test_the_operations_timeout_comes_from_the_environment():
    ranked = {**JOB, "RAGSHARD_RANK": "0", "WORLD_SIZE": "1", "RAGSHARD_WORLD_SIZE": "1"}
    assert ragshard.Env(ranked).op_timeout_s == ragshard.OP_TIMEOUT_S == 120
    assert ragshard.Env({**ranked, "RAGSHARD_OP_TIMEOUT_S": "0"}).op_timeout_s == 120
    assert ragshard.Env({**ranked, "RAGSHARD_OP_TIMEOUT_S": "2.5"}).op_timeout_s == 2.5
    for bad, said in (("soon", "is not a number of seconds"), ("-1", r"is not in \[0, 86400\]")):
        with pytest.raises(ragshard.Error, match=f"RAGSHARD_OP_TIMEOUT_S.*{said}"):
            ragshard.Env({**ranked, "RAGSHARD_OP_TIMEOUT_S": bad})


def test_launch_tells_each_rank_its_nodes_ranks():
    from ragshard import launch
    a = launch.parse(["--planner", "127.0.0.1:1", "--job", "j", "--nproc", "4", "--sockets",
                      "/tmp/a.sock,/tmp/b.sock", __file__])
    envs = list(launch.rank_envs(a, 0))
    assert [(e["RAGSHARD_NODE"], e["RAGSHARD_LOCAL_RANK"], e["RAGSHARD_LOCAL_WORLD_SIZE"])
            for e in envs] == [("node-0", "0", "2"), ("node-0", "1", "2"),
                               ("node-1", "0", "2"), ("node-1", "1", "2")]


def test_torchrun_defaults_the_job_to_its_run_id_and_the_socket_to_the_daemons():
    # Only the planner (and the token) set: the job is torchrun's run id, the socket where
    # deploy/ puts the daemon's; RAGSHARD_JOB and RAGSHARD_SOCKET still win.
    bare = {"RAGSHARD_PLANNER": "127.0.0.1:7070", "RAGSHARD_TOKEN_FILE": "/t", "RANK": "1",
            "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "3f2a"}
    e = ragshard.Env(bare)
    assert (e.launcher, e.job, e.socket, e.token_file) == \
        ("torchrun", "3f2a", ragshard.DEFAULT_SOCKET, "/t")
    assert ragshard.DEFAULT_SOCKET == "/run/ragshard/daemon.sock"
    e = ragshard.Env({**bare, **JOB})
    assert (e.job, e.socket) == ("j", "/tmp/d0.sock")
    assert ragshard.Env({**JOB, "RAGSHARD_RANK": "0", "RAGSHARD_WORLD_SIZE": "1"}).launcher == \
        "ragshard-launch"
    assert ragshard.Env({**JOB, **SLURM}).launcher == "srun"


@pytest.mark.parametrize("run_id", [None, "none", ""])
def test_torchrun_without_a_run_id_of_its_own_names_ragshard_job(run_id):
    env = {"RAGSHARD_PLANNER": "127.0.0.1:7070", "RANK": "0", "WORLD_SIZE": "2"}
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    said = "unset" if run_id is None else f"'{run_id}'"
    with pytest.raises(ragshard.Error,
                       match=f"RAGSHARD_JOB is unset and TORCHELASTIC_RUN_ID is {said}"):
        ragshard.Env(env)
    assert ragshard.Env({**env, "RAGSHARD_JOB": "mine"}).job == "mine"


def test_torchrun_variables():
    e = ragshard.Env({**JOB, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (5, 8, 1, 4)
    assert e.node == "node-1"
    assert ragshard.Env({**JOB, "RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0",
                         "RAGSHARD_NODE": "gpu-17"}).node == "gpu-17"


SLURM = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURMD_NODENAME": "gpu-3"}


def test_slurm_variables():
    e = ragshard.Env({**JOB, **SLURM})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.node) == \
        (4, 5, 0, 1, "gpu-3")
    e = ragshard.Env({**JOB, **SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                      "SLURM_NODEID": "0", "RAGSHARD_NODE": "n0"})
    assert (e.rank, e.local_rank, e.local_world_size, e.node) == (1, 1, 2, "n0")
    # ragshard.launch's and torchrun's variables come first.
    assert ragshard.Env({**JOB, **SLURM, "RANK": "0", "WORLD_SIZE": "1"}).rank == 0


@pytest.mark.parametrize("env,message", [
    ({**JOB, **SLURM, "SLURM_PROCID": "5"}, "SLURM_PROCID=5 is not a rank of SLURM_NTASKS=5"),
    ({**JOB, **SLURM, "SLURM_LOCALID": "1"}, "SLURM_LOCALID=1 is not below this node's 1 ranks"),
    ({**JOB, **SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x"},
     r"SLURM_STEP_TASKS_PER_NODE='2\(x' is not a list of N or N\(xK\)"),
    ({**JOB, **SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 is not a node of"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"missing RAGSHARD_PLANNER \("),
    ({**SLURM}, "missing RAGSHARD_PLANNER, RAGSHARD_JOB, RAGSHARD_SOCKET"),
    ({**JOB}, "missing RAGSHARD_RANK, RAGSHARD_WORLD_SIZE"),
    ({**JOB, "RANK": "two", "WORLD_SIZE": "4"}, "RANK='two' is not an integer"),
    ({**JOB, "RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not a rank of WORLD_SIZE=4"),
    ({**JOB, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 is not below this node's 2 ranks"),
])
def test_bad_environments_are_named(env, message):
    with pytest.raises(ragshard.Error, match=message):
        ragshard.Env(env)
