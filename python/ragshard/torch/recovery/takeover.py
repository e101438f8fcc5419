"""Shrinking in place (docs/recovery.md, "Shrinking in place").

A job created with on_node_loss "shrink" (`ragshard-launch --on-node-loss shrink`) that loses a
node and gets no replacement daemon within its recovery deadline turns SHRUNK: the planner
creates its successor job (Job.successor_job_id) for the ranks of the other nodes
(Job.survivor_ranks; the successor's rank i is the old job's survivor_ranks[i]), and training
goes on there with the same global batch over fewer ranks.

A survivor's process, restarted on the recovery notice as in any recovery in place, finds the
old job unable to run. It follows the shrink (`follow`): it reads its state in the old job
through a salvage attach (its daemon keeps the old job's buffers until its survivors took them
over, or the job is deleted), joins the successor as its new rank, and once the successor's
plan is there takes the state over (`take_over`): the ranks agree on the last step all of them
completed, roll back to it, and copy their shards and their optimizers' state into the
successor's buffers, memory to memory in the node's pool; once all of them have, each node's
copy of the old job is released. Where whole HSDP replica groups were lost (which the planner
checks), each survivor's shard is cut exactly as its new rank's (checked here unit by unit) and
nothing crosses nodes; a job of one shard group re-cuts its shards over the successor's data
plane instead, the lost node's share read from its whole copy on another node (recut.py). A
restarted rank of the lost node leaves with SHRINK_EXIT once the planner says the job shrank
without it (ragshard.connect)."""
import sys
import time

import torch

from ..._core import Error
from .journal import PoolState, StepJournal, agree_on_committed, shard_tensors
from .recut import recut
from ..fsdp.views import as_tensor
from ... import _faults, _pool

__all__ = ["release", "salvage", "salvage_to_release", "take_over"]


def salvage(client, pred):
    """A salvage attachment of `client`'s rank of a shrink's successor job to the job `pred` it
    came from (as that job's rank survivor_ranks[rank]), and the shrink's description
    (ShardedModule.shrink). Error naming both where `pred` is gone (deleted)."""
    try:
        info = client.job_info(pred)
    except Error as e:
        raise Error(f"FAILED_PRECONDITION: rank {client.rank} of job '{client.job}' has not "
                    f"taken its state over from job '{pred}' (the shrink it came from), which "
                    f"is gone: {e}") from None
    rank = info["survivor_ranks"][client.rank]
    world = client.job_info()["world_size"]  # (asked first: nothing to close if it fails)
    held = client.for_job(pred, rank)
    try:
        held.attach(salvage=True)
    except Error:
        held.close()
        raise
    return held, {"job": client.job, "rank": client.rank, "world": world,
                  "from_job": pred, "from_rank": rank, "from_world": info["world_size"]}


def salvage_to_release(client, pred):
    """A salvage attachment to the shrunk job `pred` that this node's daemon still holds, for
    its release; None where the daemon released it already or the job is gone (deleted)."""
    try:
        held, _ = salvage(client, pred)
    except Error:
        return None
    return held


def release(held):
    """The shrunk job's buffers on this node back to its pool, once every rank took them over;
    where that fails they only stay until the job is deleted. A daemon busy with as many
    attaches as it runs at once (RESOURCE_EXHAUSTED) is asked again, for up to about 6 s."""
    for attempt in range(6):
        try:
            held.release_salvaged()
            return
        except Error as e:
            if str(e).startswith("RESOURCE_EXHAUSTED") and attempt < 5:
                time.sleep(0.2 * 2 ** attempt)
                continue
            print(f"ragshard: the buffers of job '{held.job}' stay in the pool until it is "
                  f"deleted: {e}", file=sys.stderr, flush=True)
            return


def _same_cuts(old, new, plan_old, plan_new, units):
    """Each unit's shard of this rank is cut the same in both jobs (the same tensors, offsets,
    sizes and position), else Error naming the first unit that is not."""
    if len(plan_old["units"]) != len(plan_new["units"]):
        raise Error(f"FAILED_PRECONDITION: the shrink's successor job '{new.job}' has "
                    f"{len(plan_new['units'])} units, job '{old.job}' "
                    f"{len(plan_old['units'])}: a shrink moves a shard only between the same "
                    "cuts")
    for ui in units:
        a, b = plan_old["units"][ui], plan_new["units"][ui]
        # Which replica group the rank is in (os_group) may differ: the cut is the same.
        cut_old, cut_new = old.layout(ui), new.layout(ui)
        cut_old.pop("os_group")
        cut_new.pop("os_group")
        if a != b or cut_old != cut_new or \
                old.shard_elems(ui) != new.shard_elems(ui):
            raise Error(f"FAILED_PRECONDITION: the shrink's successor job '{new.job}' cuts unit "
                        f"{ui} ('{a.get('name', ui)}') of rank {new.rank} unlike rank {old.rank} "
                        f"of job '{old.job}': a shrink moves a shard only between the same cuts "
                        "(whole shard groups lost)")


def take_over(old, new, plan_old, plan_new, control, journal, units, survivors):
    """The successor's rank `new` takes over the state of rank `old` (a salvage attachment to
    the shrunk job): every rank agrees on the last step all of them completed there (over
    `control`, the successor's), brings its old state back to it (its undo copies), and copies
    its parameter shards and its optimizers' state into the successor's buffers; `journal`
    (the successor's) then says that step. A job of one shard group that shrank re-cuts its
    shards instead (recut.py; `survivors`: the old job's survivor_ranks). Returns the training
    step, the bytes copied and whether the shards were re-cut."""
    if old.replicas == 1 and old.world_size != new.world_size:
        step, moved, _ = recut(old, new, plan_old, plan_new, control, units, survivors)
        _faults.point("shrink.take_over", rank=new.rank)
        return _resume_at(old, journal, step), moved, True
    _same_cuts(old, new, plan_old, plan_new, units)
    pool = PoolState(old)
    held = StepJournal(pool, lambda: shard_tensors(old, units))
    step = agree_on_committed(control, held.committed)
    held.roll_back(step)
    moved = 0
    for ui in units:
        src, dst = as_tensor(old.param_shard(ui)), as_tensor(new.param_shard(ui))
        dst.copy_(src)
        moved += src.numel() * src.element_size()
        as_tensor(new.grad_shard(ui)).zero_()
    _faults.point("shrink.take_over", rank=new.rank)
    to = PoolState(new)
    for name, numel, dtype in held.held_names():
        if name.startswith(_pool.SHARD):
            continue  # copied above, every unit's
        src, _ = pool.tensor(name, numel, getattr(torch, dtype))
        dst, _ = to.tensor(name, numel, getattr(torch, dtype))
        dst.copy_(src)
        moved += src.numel() * src.element_size()
    # The successor keeps its optimizers' state laid out as the job it came from (recut.py).
    to.tensor(_pool.SHRINK_IN_PLACE, 1, torch.int64)[0][0] = \
        int(pool.tensor(_pool.SHRINK_IN_PLACE, 1, torch.int64)[0][0])
    return _resume_at(old, journal, step), moved, False


def _resume_at(old, journal, step):
    """The successor's `journal` at transaction `step` of the job it came from, with that
    job's base (a load's: docs/recovery.md, "Checkpoints"); returns the training step."""
    base = int(PoolState(old).tensor(_pool.JOURNAL_META, _pool.JOURNAL_META_FIELDS,
                                     torch.int64)[0][_pool.BASE])
    journal.meta[_pool.COMMITTED] = journal.meta[_pool.BEGUN] = step
    journal.meta[_pool.BASE] = journal.meta[_pool.BASE_BEFORE] = base
    return journal.step
