"""Starts the ranks of a ragshard job on this machine.

    ragshard-launch --planner HOST:PORT --job JOB --nproc N \\
        --sockets /run/d0.sock,/run/d1.sock [--nodes node-0,node-1] [--create-job] \\
        script.py [script args...]

Ranks are spread over the daemons in order: with N ranks and D sockets, daemon i gets ranks
[i*N/D, (i+1)*N/D). Each rank runs `script.py` under the same interpreter with RAGSHARD_PLANNER,
RAGSHARD_JOB, RAGSHARD_RANK, RAGSHARD_WORLD_SIZE, RAGSHARD_SOCKET and RAGSHARD_NODE set (read
them with `ragshard.Env()`). `--create-job` creates the job first (mesh N/R x R with --replicate R).
When a rank fails the others are stopped, and the launcher exits with the first failing rank's
code. (`python -m ragshard.launch` is the same program.)

As torchrun does, when more than one rank shares a daemon (a node) and OMP_NUM_THREADS is not
set, each rank gets OMP_NUM_THREADS=1 (`--threads-per-rank` sets another number): several ranks'
intra-op thread pools on the same cores otherwise spin against each other and against the
daemon, which on a small machine makes a step many times slower.

`--preload torch` imports torch once in the launcher and forks the ranks from it rather than
starting an interpreter per rank (ragshard/_preload.py): the ranks start seconds sooner where
CPUs are few. They are forked before the launcher talks to the planner.

Ranks may also be started by torchrun, one torchrun per node, with RAGSHARD_PLANNER,
RAGSHARD_JOB and RAGSHARD_SOCKET naming the planner, the job and that node's daemon socket:

    RAGSHARD_PLANNER=HOST:PORT RAGSHARD_JOB=JOB RAGSHARD_SOCKET=/run/d0.sock \\
        torchrun --nnodes 1 --nproc-per-node 4 script.py
"""
import argparse
import os
import signal
import subprocess
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(prog="ragshard-launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner", required=True, help="planner address HOST:PORT")
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--sockets", required=True, help="comma-separated daemon sockets")
    p.add_argument("--nodes", default="", help="comma-separated node ids (default node-<i>)")
    p.add_argument("--create-job", action="store_true",
                   help="create the job (mesh: N/R ranks per shard group x R replicas)")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP replicas R for --create-job (default 1: plain FSDP)")
    p.add_argument("--policy", default="ragged",
                   help="planning policy for --create-job: ragged, ragged-paper or auto")
    p.add_argument("--strategy", default="",
                   help="policy auto: k=K,p=AxB,g=AxB,os=AxB (or k=K,shard=AxB) instead of the "
                        "planner's search; the ranks get it as RAGSHARD_STRATEGY")
    p.add_argument("--tokens-per-step", type=int, default=0,
                   help="policy auto: the global batch in tokens, for the cost model")
    p.add_argument("--token-file", default=os.environ.get("RAGSHARD_TOKEN_FILE", ""),
                   help="bearer token file for the planner (default: RAGSHARD_TOKEN_FILE)")
    p.add_argument("--threads-per-rank", type=int, default=0,
                   help="OMP_NUM_THREADS for each rank (default: OMP_NUM_THREADS if set, else 1 "
                        "when several ranks share a daemon, as torchrun does)")
    p.add_argument("--preload", default="",
                   help="comma-separated modules (e.g. torch) imported once by the launcher, "
                        "which forks the ranks from itself instead of starting an interpreter "
                        "per rank (each rank's torch import is seconds of CPU)")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    a.sockets = [s for s in a.sockets.split(",") if s]
    a.preload = [m for m in a.preload.split(",") if m]
    a.nodes = [n for n in a.nodes.split(",") if n] or [f"node-{i}" for i in range(len(a.sockets))]
    if a.nproc < 1:
        p.error("--nproc must be at least 1")
    if not a.sockets:
        p.error("--sockets: at least one daemon socket")
    if len(a.nodes) != len(a.sockets):
        p.error(f"--nodes names {len(a.nodes)} nodes for {len(a.sockets)} sockets")
    if a.replicate < 1 or a.nproc % a.replicate:
        p.error(f"--replicate {a.replicate} does not divide --nproc {a.nproc}")
    if a.nproc % len(a.sockets):
        p.error(f"--nproc {a.nproc} does not split evenly over {len(a.sockets)} daemons")
    if a.threads_per_rank < 0:
        p.error(f"--threads-per-rank {a.threads_per_rank}: must be at least 1 "
                "(0 takes the default)")
    if not os.path.exists(a.script):
        p.error(f"script not found: {a.script}")
    return a


def rank_envs(a, threads):
    per_node = a.nproc // len(a.sockets)
    for r in range(a.nproc):
        env = dict(os.environ)
        env.update(RAGSHARD_PLANNER=a.planner, RAGSHARD_JOB=a.job, RAGSHARD_RANK=str(r),
                   RAGSHARD_WORLD_SIZE=str(a.nproc), RAGSHARD_SOCKET=a.sockets[r // per_node],
                   RAGSHARD_NODE=a.nodes[r // per_node], RAGSHARD_TOKEN_FILE=a.token_file)
        if a.strategy:
            env["RAGSHARD_STRATEGY"] = a.strategy
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        yield env


def create_job(a):
    if a.create_job:
        from ragshard import create_job as create
        create(a.planner, a.job, a.nproc // a.replicate, a.replicate, a.policy, "",
               a.token_file, strategy=a.strategy, tokens_per_step=a.tokens_per_step)


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    per_node = a.nproc // len(a.sockets)
    threads = a.threads_per_rank or (os.environ.get("OMP_NUM_THREADS") or
                                     ("1" if per_node > 1 else ""))
    if a.preload:
        from ragshard import _preload
        _preload.import_modules(a.preload)
        procs = [_preload.fork_rank(a.script, a.args, env, threads)
                 for env in rank_envs(a, threads)]
        try:
            create_job(a)
        except BaseException:
            for p in procs:
                p.abandon()
            raise
        for p in procs:
            p.start()
    else:
        create_job(a)
        procs = [subprocess.Popen([sys.executable, a.script] + a.args, env=env)
                 for env in rank_envs(a, threads)]
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc
                    print(f"ragshard.launch: a rank exited with {rc}; stopping the others",
                          file=sys.stderr)
                    for q in procs:
                        q.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for q in procs:
            q.send_signal(signal.SIGTERM)
        code = 130
    return code


if __name__ == "__main__":
    sys.exit(main())
