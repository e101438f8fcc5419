"""Starts the ranks of a ragshard job on this machine.

    ragshard-launch --standalone --nproc N script.py [script args...]
    ragshard-launch --planner HOST:PORT --job JOB --nproc N \\
        --sockets /run/d0.sock,/run/d1.sock [--nodes node-0,node-1] [--create-job] \\
        script.py [script args...]

`--standalone` is the single-machine default: the launcher starts a planner and one daemon for
the run (ragshard-planner and ragshardd, found on PATH, where `pip install .` puts them) in a
private temporary directory (mode 0700: the planner's data and token, the daemon's socket, their
logs), the planner on 127.0.0.1 (a port the kernel picks) and the daemon's data plane on
loopback, creates the job (`--job`, default "standalone"), runs the ranks, and afterwards stops
the daemon and the planner and removes the directory, whether the ranks succeeded or not, and
also when the launcher gets SIGINT, SIGTERM or SIGHUP (RAGSHARD_KEEP_LOGS=1 keeps the directory,
for its logs). A program missing from PATH is named, with PATH, before anything starts.

Ranks are spread over the daemons in order: with N ranks and D sockets, daemon i gets ranks
[i*N/D, (i+1)*N/D). On several hosts, as torchrun's --nnodes and --node-rank: each host runs
`ragshard-launch --nnodes H --node-rank K --sockets <its daemons' sockets> --nodes <their node
ids>` with the same other arguments (N the job's world size), and starts ranks
[K*N/H, (K+1)*N/H) on its own daemons; host 0 creates the job (--create-job), the others wait
for it (up to RAGSHARD_JOB_WAIT_S, 120 s) before their ranks start; --nodes defaults to
node-<K*D+i>. The same command on a replacement of a lost host 0 joins the job while it
recovers from that host's loss (any other job of that name is refused, named).
Each rank runs `script.py` under the same interpreter with RAGSHARD_PLANNER,
RAGSHARD_JOB, RAGSHARD_RANK, RAGSHARD_WORLD_SIZE, RAGSHARD_SOCKET, RAGSHARD_NODE,
RAGSHARD_LOCAL_RANK and RAGSHARD_LOCAL_WORLD_SIZE set (read them with `ragshard.Env()`), and the planner's token and TLS settings as RAGSHARD_TOKEN_FILE,
RAGSHARD_TLS_CA, RAGSHARD_TLS_CERT, RAGSHARD_TLS_KEY and RAGSHARD_TLS_SERVER_NAME (from
--token-file, --tls-ca, --tls-cert, --tls-key and --tls-server-name, whose defaults are those
variables: a planner that serves TLS needs --tls-ca, its CA). `--create-job` creates the job
first (mesh N/R x R with --replicate R). When a rank fails the others are stopped, and the
launcher exits with the first failing rank's code; when the launcher gets SIGINT, SIGTERM or
SIGHUP, it stops the ranks (SIGTERM, then SIGKILL after 10 s) and exits with 128 + the signal.
(`python -m ragshard.launch` is the same program.)

`--max-restarts N` restarts a rank whose process dies (up to N times per rank) and creates the
job with a recovery deadline (`--recovery-deadline S`, default 120): the new process attaches to
the state its daemon kept, and the other ranks, which exit with 75 on their daemons' recovery
notice, are restarted without counting (docs/recovery.md). Restarts start a fresh interpreter.
`--redundancy parity:K|replica` (with --max-restarts) also keeps every rank's state redundant
across the daemons, so that a lost daemon is rebuilt on a replacement started with the same node
id (docs/recovery.md, "A lost node"): parity:K needs the daemons in groups of K + 1, replica at
least 2. With --replicate R >= 2 the default is `hsdp` (where each rank has an HSDP replica on
another daemon): a lost daemon is rebuilt from the other replica groups, at no memory of its
own. A restarted rank whose daemon is not up yet waits for its socket within the recovery
deadline (RAGSHARD_DAEMON_WAIT_S), which costs no restart. `--on-node-loss shrink` (with
--max-restarts) shrinks the job in place where a lost daemon gets no replacement within the
recovery deadline (docs/recovery.md, "Shrinking in place"): the ranks of the other daemons go on
as a successor job of fewer ranks (the same global batch), and the lost daemon's restarted
ranks leave with 76, which the launcher lets go. Either whole HSDP replica groups were lost
(--replicate 2 or more, each group on daemons of its own), or one shard group (--replicate 1)
keeps whole copies of each daemon's state (--redundancy replica or parity:1), from which the
survivors re-cut the shards for their number. `--steps-per-commit K` (with --max-restarts) journals
and protects the state once every K optimizer steps rather than after each: a step costs less, and
a recovery goes back to the start of the K steps under way (docs/recovery.md, "Steps per
commit"); the ranks get it as RAGSHARD_STEPS_PER_COMMIT.

As torchrun does, when more than one rank shares a daemon (a node) and OMP_NUM_THREADS is not
set, each rank gets OMP_NUM_THREADS=1 (`--threads-per-rank` sets another number): several ranks'
intra-op thread pools on the same cores otherwise spin against each other and against the
daemon, which on a small machine makes a step many times slower.

`--preload torch` imports torch once in the launcher and forks the ranks from it rather than
starting an interpreter per rank (ragshard/_preload.py): the ranks start seconds sooner where
CPUs are few. They are forked before the launcher talks to the planner.

Ranks may also be started by torchrun, one torchrun per node, with RAGSHARD_PLANNER naming the
planner (and RAGSHARD_TOKEN_FILE its token): the job defaults to torchrun's run id
(TORCHELASTIC_RUN_ID; RAGSHARD_JOB names another), the daemon socket to
/run/ragshard/daemon.sock (RAGSHARD_SOCKET names another), and `ragshard.connect()` creates the
job from torchrun's WORLD_SIZE where it does not exist yet:

    RAGSHARD_PLANNER=HOST:PORT RAGSHARD_SOCKET=/run/d0.sock \\
        torchrun --standalone --nproc-per-node 4 script.py
"""
import argparse
import os
import signal
import subprocess
import sys
import time

from . import _commit
from ._notice import RECOVERY_EXIT  # a rank leaving for a recovery in place (75)

STANDALONE_JOB = "standalone"
SHRINK_EXIT = 76  # ragshard._shrink.SHRINK_EXIT: a lost node's rank that a shrink left out
MAX_SPARES = 64  # --preload --max-restarts: spare processes forked with the ranks, at most


def parse(argv):
    p = argparse.ArgumentParser(prog="ragshard-launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--standalone", action="store_true",
                   help="start a planner and one daemon for this run (programs on PATH) in a "
                        "private temporary directory, create the job, and stop them afterwards")
    p.add_argument("--planner", default="", help="planner address HOST:PORT")
    p.add_argument("--job", default="",
                   help=f"job id (--standalone: default {STANDALONE_JOB})")
    p.add_argument("--nproc", type=int, required=True,
                   help="number of ranks (of the job: over every host with --nnodes)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts of the job, each running a launcher with its --node-rank")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's place among --nnodes (host 0 creates the job)")
    p.add_argument("--sockets", default="", help="comma-separated daemon sockets")
    p.add_argument("--nodes", default="", help="comma-separated node ids (default node-<i>)")
    p.add_argument("--create-job", action="store_true",
                   help="create the job (mesh: N/R ranks per shard group x R replicas); "
                        "--standalone always does")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP replicas R for --create-job (default 1: plain FSDP)")
    p.add_argument("--policy", default="ragged",
                   help="planning policy for --create-job: ragged, ragged-paper or auto")
    p.add_argument("--strategy", default="",
                   help="policy auto: k=K,p=AxB,g=AxB,os=AxB (or k=K,shard=AxB) instead of the "
                        "planner's search; the ranks get it as RAGSHARD_STRATEGY")
    p.add_argument("--tokens-per-step", type=int, default=0,
                   help="policy auto: the global batch in tokens, for the cost model")
    p.add_argument("--pool-bytes", type=int, default=0,
                   help="--standalone: the daemon's shared-memory pool (default: half of this "
                        "machine's memory; pages are taken as they are used)")
    p.add_argument("--cluster-profile", default="",
                   help="--standalone: the planner's cluster profile (needed by policy auto)")
    p.add_argument("--token-file", default=os.environ.get("RAGSHARD_TOKEN_FILE", ""),
                   help="bearer token file for the planner (default: RAGSHARD_TOKEN_FILE; "
                        "--standalone: the private planner's own)")
    for flag, var, what in (("--tls-ca", "RAGSHARD_TLS_CA",
                             "the planner's CA: connect over TLS"),
                            ("--tls-cert", "RAGSHARD_TLS_CERT",
                             "client certificate for mutual TLS (with --tls-key)"),
                            ("--tls-key", "RAGSHARD_TLS_KEY", "client key for mutual TLS"),
                            ("--tls-server-name", "RAGSHARD_TLS_SERVER_NAME",
                             "name to check in the planner's certificate")):
        p.add_argument(flag, default=os.environ.get(var, ""),
                       help=f"{what} (default: {var}; the ranks get it as {var}; --standalone: "
                            "none, its private planner is on loopback without TLS)")
    p.add_argument("--threads-per-rank", type=int, default=0,
                   help="OMP_NUM_THREADS for each rank (default: OMP_NUM_THREADS if set, else 1 "
                        "when several ranks share a daemon, as torchrun does)")
    p.add_argument("--preload", default="",
                   help="comma-separated modules (e.g. torch) imported once by the launcher, "
                        "which forks the ranks from itself instead of starting an interpreter "
                        "per rank (each rank's torch import is seconds of CPU)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart a rank whose process dies, up to this many times per rank; the "
                        "job (created here) then recovers it in place (docs/recovery.md): the "
                        "new process attaches to the state its daemon kept")
    p.add_argument("--recovery-deadline", type=float, default=None,
                   help="with --max-restarts: seconds a recovery in place may take before the "
                        "job fails, named (default 120)")
    p.add_argument("--redundancy", default="",
                   help="with --max-restarts: parity:K, replica or hsdp, the job's redundancy "
                        "across daemons, so that a lost daemon is rebuilt on a replacement "
                        "(docs/recovery.md; default: hsdp with --replicate 2 or more where "
                        "the replicas are on different daemons, else none)")
    p.add_argument("--on-node-loss", default="fail", choices=("fail", "shrink"),
                   help="with --max-restarts: what a lost daemon without a replacement within "
                        "the recovery deadline does: fail the job (default), or shrink it to the "
                        "other daemons' ranks (docs/recovery.md, \"Shrinking in place\"; needs "
                        "--replicate 2 or more, whole replica groups on daemons of their own, "
                        "or --redundancy replica or parity:1)")
    p.add_argument("--steps-per-commit", type=int, default=1,
                   help="with --max-restarts: optimizer steps per journal transaction and "
                        "protect (default 1: each step); a recovery redoes up to this many "
                        "(docs/recovery.md, \"Steps per commit\")")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    a.sockets = [s for s in a.sockets.split(",") if s]
    a.preload = [m for m in a.preload.split(",") if m]
    a.nodes = [n for n in a.nodes.split(",") if n]
    if a.standalone:
        given = [f for f, v in (("--planner", a.planner), ("--sockets", a.sockets),
                                ("--nodes", a.nodes)) if v]
        if given:
            p.error(f"--standalone starts its own planner and daemon: {', '.join(given)} "
                    "cannot be given with it")
        a.job = a.job or STANDALONE_JOB
        a.create_job = True
        a.sockets, a.nodes = [""], ["node-0"]  # the daemon's, once it runs
    else:
        missing = [f for f, v in (("--planner", a.planner), ("--job", a.job),
                                  ("--sockets", a.sockets)) if not v]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)} "
                    "(or --standalone)")
        for flag, value in (("--pool-bytes", a.pool_bytes), ("--cluster-profile",
                                                              a.cluster_profile)):
            if value:
                p.error(f"{flag} is for --standalone")
        # (on host K of --nnodes: node-<K*D+i>)
        a.nodes = a.nodes or [f"node-{a.node_rank * len(a.sockets) + i}"
                              for i in range(len(a.sockets))]
    if a.nproc < 1:
        p.error("--nproc must be at least 1")
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and a.standalone:
        p.error("--standalone runs on one host: --nnodes cannot be given with it")
    if a.nproc % a.nnodes:
        p.error(f"--nproc {a.nproc} does not split evenly over --nnodes {a.nnodes}")
    a.local = a.nproc // a.nnodes  # this host's ranks: [a.base, a.base + a.local)
    a.base = a.node_rank * a.local
    if len(a.nodes) != len(a.sockets):
        p.error(f"--nodes names {len(a.nodes)} nodes for {len(a.sockets)} sockets")
    if a.replicate < 1 or a.nproc % a.replicate:
        p.error(f"--replicate {a.replicate} does not divide --nproc {a.nproc}")
    if a.local % len(a.sockets):
        p.error(f"--nproc {a.nproc} does not split evenly over {len(a.sockets) * a.nnodes} "
                "daemons")
    if a.threads_per_rank < 0:
        p.error(f"--threads-per-rank {a.threads_per_rank}: must be at least 1 "
                "(0 takes the default)")
    if a.max_restarts < 0:
        p.error(f"--max-restarts {a.max_restarts}: must not be negative")
    if a.recovery_deadline is not None and not a.max_restarts:
        p.error("--recovery-deadline needs --max-restarts: nothing restarts a lost rank without "
                "it")
    if a.recovery_deadline is None:
        a.recovery_deadline = 120.0
    if not 0 < a.recovery_deadline <= 86400:
        p.error(f"--recovery-deadline {a.recovery_deadline}: must be in (0, 86400] seconds")
    if a.redundancy:
        _check_redundancy(p, a)
    if a.on_node_loss == "shrink" and not a.max_restarts:
        p.error("--on-node-loss shrink needs --max-restarts: the survivors' ranks go on through "
                "a recovery in place")
    if a.on_node_loss == "shrink" and a.replicate < 2 and not _whole_copies(a.redundancy):
        p.error("--on-node-loss shrink needs the lost daemons' state held elsewhere: --replicate "
                "2 or more (whole HSDP replica groups), or --redundancy replica or parity:1 "
                f"(whole copies, from which the survivors re-cut the shards); got --replicate "
                f"{a.replicate} and --redundancy '{a.redundancy or 'none'}'")
    try:
        _commit.check(a.steps_per_commit)
    except ValueError as e:
        p.error(str(e))
    if a.steps_per_commit > 1 and not a.max_restarts:
        p.error("--steps-per-commit needs --max-restarts: without it no step is journaled")
    if a.max_restarts and not a.create_job:
        p.error("--max-restarts needs a job this launcher creates (--create-job or "
                "--standalone), with its recovery deadline")
    if a.pool_bytes < 0:
        p.error(f"--pool-bytes {a.pool_bytes}: must be positive (0 takes the default)")
    if not os.path.exists(a.script):
        p.error(f"script not found: {a.script}")
    return a


def _whole_copies(redundancy):
    from ragshard._shrink import whole_copies
    return whole_copies(redundancy)


def _check_redundancy(p, a):
    """--redundancy: the form, --max-restarts, and enough daemons for its groups."""
    if a.redundancy == "none":
        a.redundancy = ""
        return
    from ragshard._core import redundancy
    nodes = len(a.sockets) * a.nnodes
    try:  # the spelling and the node rules the planner and the daemon apply (C library)
        r = redundancy(a.redundancy, nodes, field="--redundancy")
    except ValueError as e:
        p.error(str(e))
    need = r["min_nodes"]
    if r["name"] == "hsdp" and a.replicate < 2:
        p.error("--redundancy hsdp rebuilds a lost daemon from another HSDP replica group: "
                f"it needs --replicate 2 or more (got {a.replicate})")
    if r["group"] and r["nodes_error"]:  # parity: not whole groups of K + 1
        p.error(f"--redundancy {a.redundancy} needs the daemons in groups of {r['group']}; "
                f"--sockets names {nodes}")
    if not a.max_restarts:
        p.error(f"--redundancy {a.redundancy} needs --max-restarts: nothing restarts the ranks of "
                "a lost daemon without it")
    if nodes < need:
        p.error(f"--redundancy {a.redundancy} needs at least {need} daemons; --sockets names "
                f"{nodes}")


def rank_envs(a, threads):
    """This host's ranks' environments, in rank order."""
    per_node = a.local // len(a.sockets)
    for r in range(a.base, a.base + a.local):
        d = (r - a.base) // per_node  # its daemon, among this host's
        env = dict(os.environ)
        env.update(RAGSHARD_PLANNER=a.planner, RAGSHARD_JOB=a.job, RAGSHARD_RANK=str(r),
                   RAGSHARD_WORLD_SIZE=str(a.nproc), RAGSHARD_SOCKET=a.sockets[d],
                   RAGSHARD_NODE=a.nodes[d], RAGSHARD_LOCAL_RANK=str(r % per_node),
                   RAGSHARD_LOCAL_WORLD_SIZE=str(per_node), RAGSHARD_TOKEN_FILE=a.token_file,
                   RAGSHARD_TLS_CA=a.tls_ca, RAGSHARD_TLS_CERT=a.tls_cert,
                   RAGSHARD_TLS_KEY=a.tls_key, RAGSHARD_TLS_SERVER_NAME=a.tls_server_name)
        if a.strategy:
            env["RAGSHARD_STRATEGY"] = a.strategy
        if a.steps_per_commit > 1:
            env[_commit.ENV] = str(a.steps_per_commit)
        if a.max_restarts:  # a restarted rank waits for its daemon, as long as a recovery may
            # (past a shrink's deadline, which it learns from the planner while it waits, and
            # then leaves: its recovery began before the rank's restart)
            wait = a.recovery_deadline * (2 if a.on_node_loss == "shrink" else 1)
            env["RAGSHARD_DAEMON_WAIT_S"] = str(min(wait, 86400))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        yield env


def create_job(a):
    if a.create_job and a.node_rank > 0:
        _await_job(a)
    elif a.create_job:
        from ragshard import Error, create_job as create
        try:
            create(a.planner, a.job, a.nproc // a.replicate, a.replicate, a.policy, "",
                   a.token_file, strategy=a.strategy, tokens_per_step=a.tokens_per_step,
                   tls_ca=a.tls_ca, tls_cert=a.tls_cert, tls_key=a.tls_key,
                   tls_server_name=a.tls_server_name,
                   recovery_deadline_ms=int(a.recovery_deadline * 1000) if a.max_restarts else 0,
                   redundancy=a.redundancy,
                   on_node_loss="" if a.on_node_loss == "fail" else a.on_node_loss)
        except Error as e:
            if a.nnodes < 2 or not str(e).startswith("ALREADY_EXISTS"):
                raise
            _join_as_replacement(a)


def _join_as_replacement(a):
    """Node rank 0's launcher found the job made already: it is the replacement of a lost host
    0 (the same command on another host) when the job recovers from the loss of one of this
    launcher's nodes (the planner's recovery names it as the lost node). It waits up to
    RAGSHARD_JOB_WAIT_S for that (a loss the planner has not counted yet, a planner restarting),
    and refuses any other job of that name, naming its state: one that cannot recover (failed,
    degraded, shrunk, deleted) at once."""
    from ragshard import job_info
    wait = float(os.environ.get("RAGSHARD_JOB_WAIT_S", "120"))
    deadline = time.time() + wait
    state = "unknown"
    while True:
        try:
            job = job_info(a.planner, a.job, a.token_file, a.tls_ca, a.tls_cert, a.tls_key,
                           a.tls_server_name)
        except Exception as e:  # a planner restarting: asked again until the deadline
            job, state = None, f"the planner did not answer: {e}"
        if job is not None:
            status = job.get("status", "JOB_STATUS_UNSPECIFIED")
            lost = (job.get("recovery") or {}).get("lost_node_id", "")
            if status == "JOB_RECOVERING" and lost in a.nodes:
                print(f"ragshard-launch: job '{a.job}' exists ({status}, node '{lost}' lost): "
                      "node rank 0 joins it as the replacement of a lost host", file=sys.stderr,
                      flush=True)
                return
            state = status
            if status == "JOB_RECOVERING":
                state += f", from the loss of {f'node {lost!r}' if lost else 'rank processes'}"
            if job.get("error"):
                state += f": {job['error']}"
            if status not in ("JOB_READY", "JOB_REGISTERING", "JOB_RECOVERING"):
                raise RuntimeError(
                    f"job '{a.job}' exists already ({state}); node rank 0's launcher joins an "
                    "existing job only as the replacement of a lost host among its nodes "
                    f"({', '.join(a.nodes)}), while the job recovers; use another --job for a "
                    "new training")
        if time.time() > deadline:
            raise RuntimeError(
                f"job '{a.job}' exists already ({state}); node rank 0's launcher joins an "
                f"existing job only as the replacement of a lost host among its nodes "
                f"({', '.join(a.nodes)}), while the job recovers from that loss (waited "
                f"{wait:.0f} s, RAGSHARD_JOB_WAIT_S); use another --job for a new training")
        time.sleep(0.2)


def _await_job(a):
    """Another host's launcher creates the job: until the planner has it."""
    from ragshard import job_info
    wait = float(os.environ.get("RAGSHARD_JOB_WAIT_S", "120"))
    deadline = time.time() + wait
    while True:
        try:
            job_info(a.planner, a.job, a.token_file, a.tls_ca, a.tls_cert, a.tls_key,
                     a.tls_server_name)
            return
        except Exception as e:  # NOT_FOUND until host 0 created it; a planner not up yet
            if time.time() > deadline:
                raise RuntimeError(f"job '{a.job}' was not created within {wait:.0f} s "
                                   f"(host 0 of --nnodes {a.nnodes} creates it): {e}") from e
        time.sleep(0.2)


class _Stopped(BaseException):
    """The launcher got SIGINT, SIGTERM or SIGHUP."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _on_stop_signal(signum, frame):
    # Once: a second signal must not cut short the cleanup that the first starts (it is bounded).
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise _Stopped(signum)


def _shielded(cleanup, *args):
    """cleanup(*args) with the stop signals held until it is done (then they are delivered)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        cleanup(*args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop(procs, grace_s=10.0):
    """SIGTERM to the ranks still running, SIGKILL to those left after `grace_s`; waits for all."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            for p in procs:
                p.send_signal(signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


def start_rank(a, env, spares):
    """One rank's process again (a restart: the job exists): a spare forked with the ranks
    (--preload), else a fresh interpreter. Never a new fork: the launcher has talked to the
    planner since, and a child forked from a process with gRPC's threads may hang in its first
    call."""
    if spares:
        p = spares.pop()
        p.start(env)
        return p
    return subprocess.Popen([sys.executable, a.script] + a.args, env=env)


def start_ranks(a, threads, spares):
    """The ranks, started once the job exists (with --preload forked before that, waiting,
    and with --max-restarts as many spares per restart, kept in `spares`); if anything fails on
    the way, those already begun are stopped."""
    procs = []
    try:
        if not a.preload:
            create_job(a)
            for env in rank_envs(a, threads):
                procs.append(subprocess.Popen([sys.executable, a.script] + a.args, env=env))
            return procs
        from ragshard import _preload
        _preload.import_modules(a.preload)
        for env in rank_envs(a, threads):
            procs.append(_preload.fork_rank(a.script, a.args, env, threads))
        # A recovery restarts every rank (the lost one, and the others on the notice).
        for _ in range(min(a.local * a.max_restarts, MAX_SPARES)):
            spares.append(_preload.fork_rank(a.script, a.args, None, threads))
        create_job(a)
        for p in procs:
            p.start()
        return procs
    except BaseException:
        for p in procs + spares:
            if hasattr(p, "abandon"):
                p.abandon()
        spares.clear()
        _shielded(_stop, procs)
        raise


def run(a):
    """Runs the ranks to the end: 0, the first failing rank's code (the others are stopped), or
    128 + the signal that stopped the launcher."""
    per_node = a.local // len(a.sockets)
    threads = a.threads_per_rank or (os.environ.get("OMP_NUM_THREADS") or
                                     ("1" if per_node > 1 else ""))
    envs = list(rank_envs(a, threads))
    spares = []
    live = dict(enumerate(start_ranks(a, threads, spares)))
    restarts, recoveries = [0] * a.local, [0] * a.local
    code = 0
    try:
        while live and code == 0:
            for r, p in list(live.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del live[r]
                if rc == 0:
                    continue
                if a.on_node_loss == "shrink" and rc == SHRINK_EXIT:
                    print(f"ragshard.launch: rank {a.base + r} left: the job shrank without it "
                          "(its daemon was lost)", file=sys.stderr, flush=True)
                    _follow_shrink(a, envs)
                    continue
                if a.max_restarts and rc == RECOVERY_EXIT and \
                        recoveries[r] < 10 * (a.max_restarts + 1):
                    # The rank left for its job's recovery in place: not a failure of its own.
                    recoveries[r] += 1
                    live[r] = start_rank(a, envs[r], spares)
                    continue
                if restarts[r] < a.max_restarts:
                    restarts[r] += 1
                    print(f"ragshard.launch: rank {a.base + r} exited with {rc}; restarting it "
                          f"({restarts[r]} of {a.max_restarts})", file=sys.stderr, flush=True)
                    live[r] = start_rank(a, envs[r], spares)
                    continue
                code = rc if rc > 0 else 128 - rc
                print(f"ragshard.launch: rank {a.base + r} exited with {rc}; stopping the others",
                      file=sys.stderr)
                # Ranks that exited by now too are named: a rank killed, and another that
                # failed on its absence first seen here, name the cause among them.
                # A recovery's exit, or a shrink's where the job shrinks, is no failure.
                benign = {None, 0}
                if a.max_restarts:
                    benign.add(RECOVERY_EXIT)
                if a.on_node_loss == "shrink":
                    benign.add(SHRINK_EXIT)
                for q, other in live.items():
                    orc = other.poll()
                    if orc not in benign:
                        print(f"ragshard.launch: rank {a.base + q} exited with {orc} too",
                              file=sys.stderr)
                break
            else:
                time.sleep(0.05)
    except _Stopped as e:
        code = 128 + e.signum
        print(f"ragshard.launch: {signal.Signals(e.signum).name}; stopping the ranks",
              file=sys.stderr)
    finally:
        for p in spares:
            p.abandon()  # the spares left exit without running
        _shielded(_stop, list(live.values()) + spares)
    return code


def _follow_shrink(a, envs):
    """Once the job shrank, the survivors' later restarts go to the job that goes on, as their
    rank there (a restarted process needs the shrunk job only to take its state over, once)."""
    from ragshard import job_info
    from ragshard._shrink import shrunk_ranks
    try:
        found = shrunk_ranks(lambda j: job_info(a.planner, j, a.token_file, a.tls_ca,
                                                a.tls_cert, a.tls_key, a.tls_server_name),
                             a.job)
    except Exception as e:  # the ranks follow the shrink themselves (ragshard._shrink.follow)
        print(f"ragshard.launch: reading the shrink from the planner: {e}", file=sys.stderr)
        return
    if found is None:
        return
    job, world, ranks = found
    for r, new in ranks.items():  # (the job's ranks; this host's are a.base on)
        if a.base <= r < a.base + a.local:
            envs[r - a.base].update(RAGSHARD_JOB=job, RAGSHARD_RANK=str(new),
                                    RAGSHARD_WORLD_SIZE=str(world))


def run_standalone(a):
    """run(a) against a planner and a daemon of its own, which are stopped (and their directory
    removed) however the run ends."""
    from ragshard.cluster import LocalCluster
    pool = a.pool_bytes or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    cluster = LocalCluster(None, daemons=1, pool_bytes=pool, default_token=True,
                           cluster_profile=a.cluster_profile or None)
    try:
        try:
            cluster.start()
        except (OSError, RuntimeError) as e:  # a program not on PATH, or one that did not start
            print(f"ragshard-launch: --standalone: {e}", file=sys.stderr)
            return 1
        a.planner, a.sockets, a.nodes = cluster.planner, cluster.sockets, cluster.nodes
        a.token_file = cluster.token_file
        a.tls_ca = a.tls_cert = a.tls_key = a.tls_server_name = ""  # plaintext on loopback
        return run(a)
    finally:
        _shielded(cluster.stop)


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    previous = {s: signal.signal(s, _on_stop_signal) for s in _STOP_SIGNALS}
    try:
        return run_standalone(a) if a.standalone else run(a)
    except _Stopped as e:  # before the ranks ran (their start stops those it began)
        print(f"ragshard.launch: {signal.Signals(e.signum).name}; stopped", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
