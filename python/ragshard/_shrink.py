"""Following a shrink (docs/recovery.md, "Shrinking in place"; torch/shrink.py takes the state
over): where a rank's job shrank, the job that goes on and the rank's place there."""
import time

from ._core import Error

__all__ = ["SHRINK_EXIT", "follow", "left_in_shrink", "shrunk_ranks", "whole_copies"]

# A rank's exit status when its job shrank without it (its node was lost): ragshard-launch
# lets it go, and the job goes on without it.
SHRINK_EXIT = 76
_SUCCESSOR_WAIT_S = 30.0  # the planner creates the successor just after the shrink


def follow(info_of, job, rank, decided=False):
    """Where rank `rank` of job `job` shrank (once or more; `info_of(job)` is the planner's
    answer, as ragshard._core.job_info gives it): (the job that goes on, this rank's rank there,
    the job whose buffers hold this rank's state, its rank there); None where the job did not
    shrink. Error "... shrank without rank R ..." where this rank was on a lost node. `decided`:
    a job still RECOVERING is waited on until its recovery ends (a shrink comes at the recovery
    deadline; the daemon may give up on the recovery a little before the planner does)."""
    info = info_of(job)
    while decided and info.get("status") == "JOB_RECOVERING":
        ends = int(info.get("recovery", {}).get("deadline_unix_ms", 0)) / 1000.0
        if time.time() > ends + _SUCCESSOR_WAIT_S:
            break
        time.sleep(0.2)
        info = info_of(job)
    if info.get("status") != "JOB_SHRUNK":
        return None
    while info.get("status") == "JOB_SHRUNK":
        survivors = info["survivor_ranks"]
        if rank not in survivors:
            raise Error(f"FAILED_PRECONDITION: job '{job}' shrank without rank {rank}: "
                        f"{info.get('error', '')}")
        held, held_rank = job, rank
        job, rank = info["successor_job_id"], survivors.index(rank)
        info = _successor(info_of, job)
    return job, rank, held, held_rank


def _successor(info_of, job):
    """The planner's answer for a shrink's successor, which it creates right after the shrink:
    NOT_FOUND is waited out for a while."""
    deadline = time.monotonic() + _SUCCESSOR_WAIT_S
    while True:
        try:
            return info_of(job)
        except Error as e:
            if not str(e).startswith("NOT_FOUND") or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def left_in_shrink(info_of, job, rank):
    """The planner's words where rank `rank` of `job` was left out of a shrink, else None (the
    job did not shrink, or the planner cannot say)."""
    try:
        follow(info_of, job, rank)
    except Error as e:
        return str(e) if "shrank without" in str(e) else None
    return None


def shrunk_ranks(info_of, job):
    """Where `job` shrank (once or more): (the job that goes on, its world size, {each surviving
    rank of `job`: its rank there}); None where it did not shrink (ragshard-launch restarts the
    survivors there)."""
    info = info_of(job)
    if info.get("status") != "JOB_SHRUNK":
        return None
    ranks = {r: r for r in range(int(info["world_size"]))}
    while info.get("status") == "JOB_SHRUNK":
        place = {old: new for new, old in enumerate(info["survivor_ranks"])}
        ranks = {r: place[at] for r, at in ranks.items() if at in place}
        job = info["successor_job_id"]
        info = _successor(info_of, job)
    return job, int(info["world_size"]), ranks


def whole_copies(redundancy):
    """Whether redundancy `redundancy` (JobOptions.redundancy's text) holds each node's state
    whole on another node, from which a shrink's survivors may re-cut the shards
    (torch/recovery/recut.py): the C library's rule (engine/redundancy.h); False for a spelling
    that is none."""
    from ._core import redundancy as parse
    try:
        return parse(redundancy)["whole_copies"]
    except ValueError:
        return False
