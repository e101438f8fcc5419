"""RankRecovery: the one owner of a rank's recovery state (docs/recovery.md), which a
ShardedModule holds as `model.recovery` and its optimizers call through a declared interface.

In a job that recovers lost ranks in place, everything a rank keeps from one step to the next
lives in its daemon's pool (journal.py): an optimizer step is a transaction over it
(`transaction`), a restarted process adopts its state and agrees with the other ranks on the step
to go on from (`resume`), a lost node's replacement is rebuilt from the others' redundancy, and a
shrink's successor takes the state over from the job it came from (takeover.py, recut.py). In a
job without recovery the same object says so (`enabled` False) and its transaction does nothing.
"""
import contextlib
import json
import sys

import torch

from ..._commit import ENV as STEPS_PER_COMMIT_ENV, steps_per_commit
from ..._core import Error
from ..._shrink import SHRINK_EXIT, follow, whole_copies
from ... import connect
from ..fsdp.views import as_tensor
from .journal import (PoolState, StepJournal, agree_on_committed, rebuild_state,
                      redundancy_step, shard_tensors)
from .recut import in_place, recut_step
from .takeover import release, salvage, salvage_to_release, take_over
from ... import _pool

__all__ = ["RankRecovery", "attach"]

# A journal's base (a training step less a transaction's number: negative where a load went
# back to an earlier step) plus this is non-negative, as the exact extremes take them.
_BASE_SHIFT = 1 << 61


def attach(client, inventory, register, inventory_at):
    """Registers `inventory` (unless `register` is False) and attaches; without a client,
    connects from the environment. Returns (the client, None, None); where the job shrank
    (takeover.py), (a client of this rank in the job that goes on, registered with
    `inventory_at(its world size)`, a salvage attachment to the job that holds the rank's state
    (None where it was released), the shrink: {job, rank, world, from_job, from_rank,
    from_world})."""
    client = client if client is not None else connect()
    try:
        if register:
            client.register(json.dumps(inventory), True)
        client.attach()
        return client, None, None
    except Error as e:
        refused = e
    try:
        live = follow(client.job_info, client.job, client.rank, decided=True)
    except Error as e:
        if "shrank without" in str(e):  # this rank's node was lost, and came back late
            print(f"ragshard: {e}; exiting with {SHRINK_EXIT}", file=sys.stderr, flush=True)
            sys.exit(SHRINK_EXIT)
        live = None  # the planner's answer is not a shrink's: the refusal stands
    if live is None:
        raise refused
    job, rank, held_job, held_rank = live
    held = client.for_job(held_job, held_rank)
    try:
        held.attach(salvage=True)
    except Error as e:
        if not str(e).startswith("NOT_FOUND"):
            held.close()
            raise
        # Released once every rank took it over: the successor's marks say so (else the
        # take-over fails naming the job, in RankRecovery._pending).
        held.close()
        held = None
    world = client.job_info(job)["world_size"]
    new = client.for_job(job, rank)
    new.register(json.dumps(inventory_at(world)), True)
    new.attach()
    shrink = {"job": job, "rank": rank, "world": world, "from_job": held_job,
              "from_rank": held_rank, "from_world": client.job_info(held_job)["world_size"]}
    client.close()  # (the caller's client of the shrunk job: the new one replaces it)
    return new, held, shrink


class RankRecovery:
    """The recovery state of one rank's ShardedModule.

    `client`: the attached ragshard.Client; `layout`: the ShardLayout; `shards`: the RankShards
    (whose optimizer state and fp32 masters it places in the pool); `held`, `shrink`: what
    `attach` returned.

    Its interface: `enabled`, `redundancy`, `writes_initial_values` (a process with nothing to
    adopt fills the shards), `resume_step` (completed steps this rank's state holds), `shrink`
    (where a shrink's successor came from, or None), `state_in_place`, `recut_step(prefix)`,
    `transaction()` (an optimizer step), and `resume(...)` once the module is built."""

    def __init__(self, client, layout, shards, held=None, shrink=None):
        self._client, self._layout, self._shards = client, layout, shards
        self.enabled = bool(client.recoverable)
        self._adopted = self.enabled and client.adopted
        # A lost node's replacement (docs/recovery.md, "A lost node"): its state is rebuilt from
        # the other nodes' redundancy, not initialized.
        self._replacement = self.enabled and client.replacement
        self.redundancy = client.redundancy if self.enabled else ""
        # Whether each step's state is protected into parity or copies ("hsdp": the other
        # replica groups hold it already).
        self._protects = self.redundancy not in ("", "hsdp")
        # Whether a shrink may re-cut this job's shards (recut.py; state_in_place).
        self._may_recut = self.enabled and whole_copies(self.redundancy) and \
            layout.replicas == 1 and not layout.factored and \
            client.job_info().get("options", {}).get("on_node_loss") == "shrink"
        self._in_place = None
        self._held, self.shrink = held, shrink
        self._journal = None
        # Optimizer steps per transaction; the steps done in the open one (0: none open); the
        # optimizer steps under way (one inside another: ShardedMuon's AdamW).
        self.steps_per_commit = steps_per_commit() if self.enabled else 1
        self._window = self._nest = 0
        self._taken = self._recut = None  # a shrink's successor's marks (shrink/...)
        self._successor = None
        # Completed optimizer steps that this rank's state holds: 0 for a new job; after a
        # recovery in place, the last step every rank completed (the script resumes there).
        self.resume_step = 0
        if self.enabled:  # (the fp32 masters of bf16 or quantized units too: RankShards)
            shards.pool = PoolState(client)

    @property
    def writes_initial_values(self):
        """Whether the module fills the shards with initial values: not where this rank adopts
        the state its daemon kept, or is a replacement whose state is rebuilt."""
        return not (self._adopted or self._replacement)

    def resume(self, control, units, journaled):
        """Once the module is built (a collective where the job recovers): takes a shrink's
        state over, or agrees with the other ranks on the step to go on from and brings this
        rank's state there, and protects step 0 where the job keeps redundancy. `control`: the
        ControlUnits; `units`: the unit indices; `journaled()`: {name: tensor} of what a step
        changes."""
        if not self.enabled:
            return
        self._control = control
        [(_, low, high)] = control.extremes([self.steps_per_commit])
        if low != high:
            raise RuntimeError(f"ragshard recovery: the ranks step {low} to {high} optimizer steps "
                               f"per commit ({STEPS_PER_COMMIT_ENV}; this rank "
                               f"{self.steps_per_commit}): every rank of a job must take the same")
        self._journal = StepJournal(self._shards.pool, journaled)
        held = self._pending(self._held, self._replacement)
        try:
            if held is not None:
                self.resume_step, moved, recut = take_over(
                    held, self._client, _plan(held), self._layout.plan, control, self._journal,
                    units, self._client.job_info(held.job)["survivor_ranks"])
                self._recut[0] = int(recut)
                self._taken[1:] = torch.tensor([moved, self.shrink["from_world"]])
                self._taken[0] = 1 + self.resume_step
                # Once every rank has copied (a barrier), no take-over is done again: the
                # shrunk job's buffers on each node go back to its pool.
                control.all_reduce_scalar(0.0)
                release(held)
            elif self._adopted or self._replacement:  # (a successor's own recovery)
                self._recover(units)
        finally:
            self._held = None
            if held is not None:
                held.close()
        if self._taken is not None:  # (after _recover: a replacement's mark is rebuilt)
            self.shrink = self._shrink_from_mark()
        if self._protects and self._journal.committed == 0 and \
                control.all_reduce_scalar(self._lacks_parity(0)) > 0:
            # Step 0, the state every rank starts from (a node lost before the first step
            # commits is rebuilt to it), unless every node holds it already (a recovery back
            # to step 0: protecting it again would put a second parity beside it).
            self._protect_now()

    def _pending(self, held, replacement):
        """In a shrink's successor job (takeover.py), the salvage attachment to take the state
        over from until every rank has (a mark in each rank's pool, agreed by a sum): a rank
        restarted in the middle of a take-over makes every rank do it again, from `held` (the
        attachment `attach` made) or one made here to the job the successor came from. None
        once every rank took the state over, and in a job that is no shrink's successor."""
        info = self._client.job_info()
        pred = info.get("predecessor_job_id")
        if not pred:
            return held
        self._successor = (pred, info["world_size"])
        pool = self._shards.pool
        # [1 + the step taken over (0: not yet), the bytes copied, the world size of the job it
        # came from]: a rank restarted later in the successor (a recovery there) still says
        # where the shrink happened (`shrink`), even once that job is deleted. A replacement's
        # mark comes back with the rest of its state (rebuilt from redundancy): it does not vote.
        self._taken, _ = pool.tensor(_pool.SHRINK_TAKEN, 3, torch.int64)
        self._recut, _ = pool.tensor(_pool.SHRINK_RECUT, 1, torch.int64)  # recut.py
        taken = bool(int(self._taken[0])) or replacement
        if self._control.all_reduce_scalar(0.0 if taken else 1.0) == 0.0:
            # Every rank took the state over. This node may still hold the shrunk job's buffers
            # (every local rank died between the barrier and its release): released here; a
            # daemon that released them already answers NOT_FOUND.
            if held is None:
                held = salvage_to_release(self._client, pred)
            if held is not None:
                release(held)
                held.close()
            return None
        if held is None:
            held, self.shrink = salvage(self._client, pred)
        return held

    def _shrink_from_mark(self):
        """`shrink` in a shrink's successor, from this rank's mark (shrink/taken) and the
        planner's survivor_ranks (None once the job it came from is deleted)."""
        pred, world = self._successor
        step, moved, from_world = (int(x) for x in self._taken)
        from_rank = (self.shrink or {}).get("from_rank")
        client = self._client
        if from_rank is None:
            try:
                from_rank = client.job_info(pred)["survivor_ranks"][client.rank]
            except (Error, KeyError, IndexError):
                from_rank = None
        return {"job": client.job, "rank": client.rank, "world": world, "from_job": pred,
                "from_rank": from_rank, "from_world": from_world, "step": step - 1,
                "bytes": moved}

    def _protect_now(self):
        """This rank's state at the step it began, protected on every node before it returns."""
        self._client.protect().wait()
        self._client.protect_finish().wait()

    def _lacks_parity(self, step):
        """1.0 where this rank's node holds no parity of `step` (JobStats.parity_steps)."""
        return 0.0 if step in self._client.stats().get("parity_steps", []) else 1.0

    def _recover(self, units):
        """A recovered rank (docs/recovery.md): agrees with the others on the last step all of
        them completed, brings its state back to it, and drops the interrupted step's
        gradients. A replacement node's rank has no state: it takes no part in the agreement,
        and its state is rebuilt from the others' redundancy (`rebuild_state`). With redundancy,
        the ranks may roll forward one step instead (`redundancy_step`)."""
        have = not self._replacement
        step = agree_on_committed(self._control, self._journal.committed, have=have)
        again = False
        if self._protects:
            step, again = redundancy_step(self._client, self._control, self._journal, step,
                                          have=have)
        if have:
            self._journal.roll_to(step)
        if again:  # (no node was lost; the parity of `step` is whole everywhere from here on)
            self._protect_now()
        if self.redundancy:
            rebuild_state(self._client, self._replacement, self._journal, step)
        # The base a load set (the same on every rank at the same transaction), which a
        # replacement takes from the ranks that kept it; shifted to be non-negative.
        [(_, low, high)] = self._control.extremes(
            [None if self._replacement else self._journal.base + _BASE_SHIFT])
        if low != high:
            raise RuntimeError(f"ragshard recovery: the ranks' journals put step {step} at "
                               f"different training steps (bases {low - _BASE_SHIFT} to "
                               f"{high - _BASE_SHIFT})")
        self._journal.meta[_pool.BASE] = self._journal.meta[_pool.BASE_BEFORE] = \
            low - _BASE_SHIFT
        self.resume_step = self._journal.step
        for ui in units:
            as_tensor(self._client.grad_shard(ui)).zero_()

    @property
    def state_in_place(self):
        """Whether the optimizers keep their elementwise state in shard coordinates (each
        piece's state at its offset in the optimizer range, rather than packed): in a job whose
        shards a shrink may re-cut (on_node_loss shrink, one shard group, no separate factors,
        whole copies of each node: redundancy replica or parity:1), and in a shrink's successor
        as in the job it came from, or after a re-cut (recut.py; kept in the pool)."""
        if self._in_place is None:
            self._in_place = self.enabled and in_place(self._shards.pool, self._may_recut)
        return self._in_place

    def recut_step(self, prefix):
        """The step count that a re-cut agreed on for optimizer state `prefix` ("opt/<tag>"),
        or None where the job did not come from a re-cut."""
        if self._recut is None or int(self._recut[0]) != 1:
            return None
        return recut_step(self._shards.pool, prefix)

    @contextlib.contextmanager
    def load(self, step=None):
        """A load of the training state (ragshard.checkpoint.load, load_dcp, the module's
        load_state_dict) as one transaction where the job recovers in place: a rank lost in the
        middle of it goes back to the state from before, like any rank's in an interrupted
        step, and once it commits the state is at training step `step` (an int, or a function
        called once the load is done; None: the step the state was at), which `resume_step`
        says after a recovery (docs/recovery.md, "Checkpoints"). Every rank calls it."""
        if self._journal is None:
            yield
            return
        self._close_window()  # (the steps before the load, a transaction of their own)
        before = self._journal.step
        # Every rank between steps (no rank begins the load while another is in a step), so the
        # ranks' transactions differ by at most one, as their steps do.
        self._control.all_reduce_scalar(0.0)
        if self._protects:
            self._client.protect_finish().wait()
        self._journal.begin()
        try:
            yield
            self._journal.set_base(before if step is None else
                                   step() if callable(step) else step)
            if self._protects:
                # The loaded state, whole on every node before it commits (a node lost once it
                # has: the ranks roll forward to it; redundancy_step).
                self._protect_now()
        except BaseException:
            self._journal.abandon()
            raise
        self._journal.commit()

    @contextlib.contextmanager
    def transaction(self):
        """An optimizer step as part of a transaction over this rank's state (StepJournal) where
        the job recovers lost ranks in place; nothing otherwise. The first step of a
        transaction begins it (its undo copies), the K-th commits it (steps_per_commit; K = 1:
        each step its own). Nested steps (ShardedMuon's AdamW) are one step."""
        if self._journal is None:
            yield
            return
        self._nest += 1
        outermost = self._nest == 1
        try:
            if outermost and self._window == 0:
                if self._protects:
                    # The last transaction's protect, whole on every node before this one
                    # changes the state it reads (docs/recovery.md, "One consistent step").
                    self._client.protect_finish().wait()
                self._journal.begin()
            try:
                yield
            except BaseException:
                if outermost:
                    self._journal.abandon()
                    self._window = 0
                raise
            if outermost:
                self._window += 1
                if self._window == self.steps_per_commit:
                    self._close_window()
        finally:
            self._nest -= 1

    def _close_window(self):
        """Commits the open transaction, if any, with the steps it holds; where the job keeps
        redundancy, its state is protected in the background of the next steps' forward and
        backward (the daemon moves it between their operations)."""
        if self._window == 0:
            return
        steps, self._window = self._window, 0
        self._journal.commit(steps)
        if self._protects:
            self._client.protect().wait()


def journaled(client, shards, units, steps):
    """{name: tensor} of the state an optimizer step changes on this rank: its parameter shards
    (where it steps them: `steps`) and the optimizers' state (RankShards.named_state)."""
    out = shard_tensors(client, units) if steps else {}
    out.update(shards.named_state())
    return out


def _plan(client):
    from ... import plan_of
    return plan_of(client)

