"""ragshard: RaggedShard FSDP for PyTorch training loops.

`ragshard._core` is the C++ client library (a C ABI through ctypes): a `Client` attaches to
the node's `ragshardd`, and its numpy arrays view the daemon's buffers without copying.
`ragshard.torch` shards a `torch.nn.Module` over it (`fully_shard`), `ragshard.launch` starts ranks.
"""
import json
import os
import re
import time

from ._core import (RECOVERY_EXIT, Client, DeviceBuffer, Error, Handle,  # noqa: F401
                    RecoveryInProgress, create_job, delete_job, job_info, job_world_size)
from ._shrink import SHRINK_EXIT, left_in_shrink  # noqa: F401

__all__ = ["Client", "DeviceBuffer", "Error", "Handle", "RecoveryInProgress", "RECOVERY_EXIT",
           "SHRINK_EXIT", "job_info",
           "create_job", "delete_job", "Env",
           "connect", "ensure_job", "DEFAULT_SOCKET", "OP_TIMEOUT_S"]


# Where ragshardd's socket is on a node set up as deploy/ (systemd, Kubernetes) does it: ranks
# under torchrun look there unless RAGSHARD_SOCKET names another.
DEFAULT_SOCKET = "/run/ragshard/daemon.sock"


OP_TIMEOUT_S = 120  # a rank's operations' timeout unless RAGSHARD_OP_TIMEOUT_S says otherwise


class Env:
    """Who this rank is, from its environment.

    Started by `ragshard.launch` (or `ragshard-launch`): RAGSHARD_RANK, RAGSHARD_WORLD_SIZE and
    RAGSHARD_NODE, with RAGSHARD_LOCAL_RANK and RAGSHARD_LOCAL_WORLD_SIZE (this node's ranks).
    Started by `torchrun`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
    GROUP_RANK (the node's index; the node is called node-<GROUP_RANK> unless RAGSHARD_NODE
    names it). Started by Slurm's `srun` (one task per rank): SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE with SLURM_NODEID (this node's task count), and
    SLURMD_NODENAME (the node, unless RAGSHARD_NODE names it). Either way RAGSHARD_PLANNER,
    RAGSHARD_JOB and RAGSHARD_SOCKET name the planner, the job and the node's daemon socket,
    RAGSHARD_TOKEN_FILE the planner's token, and RAGSHARD_TLS_CA the planner's CA where it
    serves TLS (with RAGSHARD_TLS_CERT and RAGSHARD_TLS_KEY, this rank's certificate for mutual
    TLS, and RAGSHARD_TLS_SERVER_NAME, the name to check in the planner's certificate): `tls_ca`,
    `tls_cert`, `tls_key` and `tls_server_name`, "" where unset.

    Under torchrun only RAGSHARD_PLANNER is needed: the job defaults to torchrun's run id
    (TORCHELASTIC_RUN_ID, which `torchrun --standalone` makes up and `--rdzv-id` names; its
    default "none" is refused, naming RAGSHARD_JOB) and the socket to DEFAULT_SOCKET, and
    `connect()` creates the job from WORLD_SIZE where it does not exist (with
    RAGSHARD_RECOVERY_DEADLINE_S > 0, one that recovers lost ranks in place within that many
    seconds: docs/recovery.md). RAGSHARD_OP_TIMEOUT_S (default OP_TIMEOUT_S): how long one of
    the rank's operations may take before its daemon fails the job naming what it waited for
    (`op_timeout_s`). `launcher` says which
    of "ragshard-launch", "torchrun" and "srun" started the rank. `local_world_size` (None where
    the launcher does not say) lets the node's daemon register the node's ranks with the
    planner in one call (docs/daemon.md, "Registration").
    """

    def __init__(self, environ=None):
        e = os.environ if environ is None else environ
        torchrun = "RAGSHARD_RANK" not in e and "RANK" in e
        slurm = "RAGSHARD_RANK" not in e and not torchrun and "SLURM_PROCID" in e
        self.launcher = "torchrun" if torchrun else "srun" if slurm else "ragshard-launch"
        rank_var, world_var = (("RANK", "WORLD_SIZE") if torchrun
                               else ("SLURM_PROCID", "SLURM_NTASKS") if slurm
                               else ("RAGSHARD_RANK", "RAGSHARD_WORLD_SIZE"))
        needed = ("RAGSHARD_PLANNER", rank_var, world_var) if torchrun else (
            "RAGSHARD_PLANNER", "RAGSHARD_JOB", rank_var, world_var, "RAGSHARD_SOCKET")
        missing = [k for k in needed if k not in e]
        if missing:
            raise Error("INVALID_ARGUMENT: this rank does not know its job: missing "
                        + ", ".join(missing) + " (start ranks with ragshard-launch, with "
                        "torchrun and RAGSHARD_PLANNER set, or with srun and RAGSHARD_PLANNER, "
                        "RAGSHARD_JOB, RAGSHARD_SOCKET set)")
        self.planner = e["RAGSHARD_PLANNER"]
        self.job = e.get("RAGSHARD_JOB") or (_torchrun_job(e) if torchrun else "")
        self.rank = _int(e, rank_var)
        self.world_size = _int(e, world_var)
        self.socket = e.get("RAGSHARD_SOCKET") or (DEFAULT_SOCKET if torchrun else "")
        self.token_file = e.get("RAGSHARD_TOKEN_FILE", "")
        self.tls_ca = e.get("RAGSHARD_TLS_CA", "")
        self.tls_cert = e.get("RAGSHARD_TLS_CERT", "")
        self.tls_key = e.get("RAGSHARD_TLS_KEY", "")
        self.tls_server_name = e.get("RAGSHARD_TLS_SERVER_NAME", "")
        # A job created here (under torchrun) recovers lost ranks in place within this many
        # seconds (docs/recovery.md); 0: it does not.
        self.recovery_deadline_s = _seconds(e, "RAGSHARD_RECOVERY_DEADLINE_S")
        # How long one of its operations may take (unset or 0: OP_TIMEOUT_S): past that its
        # daemon fails the job naming what it waited for (a peer that answers nothing).
        self.op_timeout_s = _seconds(e, "RAGSHARD_OP_TIMEOUT_S") or OP_TIMEOUT_S
        local_var, local_size_var = (("SLURM_LOCALID", None) if slurm else
                                     ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if torchrun else
                                     ("RAGSHARD_LOCAL_RANK", "RAGSHARD_LOCAL_WORLD_SIZE"))
        self.local_rank = _int(e, local_var) if local_var in e else None
        self.local_world_size = (_slurm_tasks_here(e) if slurm else
                                 _int(e, local_size_var) if local_size_var in e else None)
        default_node = (f"node-{_int(e, 'GROUP_RANK')}" if torchrun and "GROUP_RANK" in e
                        else e.get("SLURMD_NODENAME", "") if slurm else "")
        self.node = e.get("RAGSHARD_NODE", default_node)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise Error(f"INVALID_ARGUMENT: {rank_var}={self.rank} is not a rank of "
                        f"{world_var}={self.world_size}")
        if self.local_rank is not None and self.local_world_size is not None and \
                not 0 <= self.local_rank < self.local_world_size:
            raise Error(f"INVALID_ARGUMENT: {local_var}={self.local_rank} is not below "
                        f"this node's {self.local_world_size} ranks")


def _torchrun_job(environ):
    """torchrun's run id as the job id; refused where torchrun has none of its own."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id in ("", "none"):
        said = (f"TORCHELASTIC_RUN_ID is '{run_id}'" if "TORCHELASTIC_RUN_ID" in environ
                else "TORCHELASTIC_RUN_ID is unset")
        raise Error(f"INVALID_ARGUMENT: this rank does not know its job: RAGSHARD_JOB is unset "
                    f"and {said} (torchrun's default without --rdzv-id): set RAGSHARD_JOB, or "
                    "start torchrun with --standalone or --rdzv-id ID")
    return run_id


def _slurm_tasks_here(environ):
    """This node's task count under srun: SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 tasks on each
    of 3 nodes, then 1) at SLURM_NODEID; None where either is missing."""
    spec, node = environ.get("SLURM_STEP_TASKS_PER_NODE"), environ.get("SLURM_NODEID")
    if spec is None or node is None:
        return None
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise Error(f"INVALID_ARGUMENT: SLURM_STEP_TASKS_PER_NODE='{spec}' is not a list "
                        "of N or N(xK)")
        counts += [int(m[1])] * int(m[2] or 1)
    i = _int(environ, "SLURM_NODEID")
    if not 0 <= i < len(counts):
        raise Error(f"INVALID_ARGUMENT: SLURM_NODEID={i} is not a node of "
                    f"SLURM_STEP_TASKS_PER_NODE='{spec}'")
    return counts[i]


def _seconds(environ, name):
    try:
        value = float(environ.get(name, "0") or "0")
    except ValueError:
        raise Error(f"INVALID_ARGUMENT: {name}='{environ[name]}' is not a number of "
                    "seconds") from None
    if not 0 <= value <= 86400:
        raise Error(f"INVALID_ARGUMENT: {name}={value} is not in [0, 86400] seconds")
    return value


def _int(environ, name):
    try:
        return int(environ[name])
    except ValueError:
        raise Error(f"INVALID_ARGUMENT: {name}='{environ[name]}' is not an integer") from None


def connect(env=None, timeout_ms=None):
    """A Client for this rank (not yet registered), whose operations time out after
    `timeout_ms` (default: the environment's RAGSHARD_OP_TIMEOUT_S, else OP_TIMEOUT_S). Under
    torchrun the job is created first where it does not exist (ensure_job)."""
    env = env or Env()
    if timeout_ms is None:
        timeout_ms = int(getattr(env, "op_timeout_s", OP_TIMEOUT_S) * 1000)
    if env.launcher == "torchrun":
        ensure_job(env)
    _await_daemon(env.socket, _daemon_wait_s(), lambda: _leave_if_shrunk_without(env))
    return Client(env.planner, env.socket, env.job, env.rank, env.node, timeout_ms,
                  env.token_file, local_ranks=env.local_world_size or 0, **_tls(env))


def _daemon_wait_s():
    """RAGSHARD_DAEMON_WAIT_S: how long a rank waits for its daemon's socket (0: not at all)."""
    text = os.environ.get("RAGSHARD_DAEMON_WAIT_S", "") or "0"
    try:
        wait = float(text)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= 86400:
        raise ValueError(f"RAGSHARD_DAEMON_WAIT_S: '{text}' is not a number of seconds in "
                         "[0, 86400]")
    return wait


def _leave_if_shrunk_without(env):
    """A restarted rank of a lost node, waiting for its daemon: where the planner says the job
    shrank without this rank (docs/recovery.md, "Shrinking in place"), it exits with
    SHRINK_EXIT, which ragshard-launch lets go."""
    said = left_in_shrink(lambda job: job_info(env.planner, job, env.token_file, **_tls(env)),
                          env.job, env.rank)
    if said:
        import sys
        print(f"ragshard: {said}; exiting with {SHRINK_EXIT}", file=sys.stderr, flush=True)
        sys.exit(SHRINK_EXIT)


def _await_daemon(path, wait_s, waiting=None):
    """Until the daemon at Unix socket `path` accepts a connection and its side channel
    (`path`.fd, which a daemon makes last) is there, for at most `wait_s` seconds (a restarted
    rank of a lost node whose replacement daemon is still starting; docs/recovery.md), calling
    `waiting()` about once a second meanwhile. Returns at once where the daemon is up, or where
    there is nothing to wait for."""
    import socket as _socket
    if wait_s <= 0 or not path:
        return
    deadline = time.monotonic() + wait_s
    asked = time.monotonic()
    while True:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            s.connect(path)
            if os.path.exists(path + ".fd"):
                return
            e = "its side channel is not there yet"
        except OSError as err:
            e = err
        finally:
            s.close()
        if time.monotonic() >= deadline:
            raise Error(f"UNAVAILABLE: no daemon at {path} after waiting {wait_s:g} s "
                        f"(RAGSHARD_DAEMON_WAIT_S): {e}")
        if waiting is not None and time.monotonic() - asked >= 1.0:
            waiting()
            asked = time.monotonic()
        time.sleep(0.05)


def _tls(env):
    """The TLS options of an Env, as Client, create_job and job_world_size take them (None,
    the process's environment, for an object that lacks one)."""
    return {k: getattr(env, k, None) for k in ("tls_ca", "tls_cert", "tls_key",
                                                 "tls_server_name")}


def ensure_job(env):
    """Creates `env.job` with `env.world_size` ranks (plain FSDP, policy ragged) unless it
    exists. Every rank may call it at once: the planner creates a job id once and answers the
    others ALREADY_EXISTS, so ranks that start together create exactly one job. A job that
    exists with another world size is refused, naming both sizes."""
    try:
        create_job(env.planner, env.job, env.world_size, 1, token_file=env.token_file,
                   recovery_deadline_ms=int(getattr(env, "recovery_deadline_s", 0) * 1000),
                   **_tls(env))
        return
    except Error as e:
        if not str(e).startswith("ALREADY_EXISTS"):
            raise
    world = job_world_size(env.planner, env.job, env.token_file, **_tls(env))
    if world != env.world_size:
        raise Error(f"FAILED_PRECONDITION: job '{env.job}' exists with world size {world}, but "
                    f"this rank's world size is {env.world_size} (WORLD_SIZE): start as many "
                    "ranks as the job has, or use another job id (RAGSHARD_JOB)")


def plan_of(client):
    """The client's plan as a dict (protobuf JSON with the proto's field names)."""
    return json.loads(client.plan_json())
