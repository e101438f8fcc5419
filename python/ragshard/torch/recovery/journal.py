"""A rank's training state in its daemon's pool, stepped atomically (docs/recovery.md).

In a job that recovers lost rank processes in place (`Client.recoverable`), everything a rank
keeps from one step to the next lives in the daemon's pool: the parameter shards (the daemon's
own buffers), and the optimizers' state (`ShardedModule.optimizer_state`) and step counts in
state buffers, named buffers of the rank's own that a restarted process of the rank gets back
(`Client.state_buffer`). The rank process then holds only model code, activations and views.

An optimizer step is a transaction over that state (`StepJournal`): before it changes anything,
the step copies the state into undo buffers and marks the step begun; once done, it marks the
step committed. A process lost in the middle leaves the mark begun: the restarted rank puts the
undo copy back. Ranks agree on the last step every one of them committed (`resume`), since a
rank may have committed a step that another did not finish; those ahead roll back one step too
(their undo copy is that step's start, since no rank can begin the next step's update before
every rank has finished this one: the next forward's gathers need them all). With redundancy
across nodes they may roll forward one step instead, or back one more (`redundancy_step`). The script then
redoes the interrupted step from its start (`ShardedModule.resume_step`).

A transaction may also hold several optimizer steps (RankRecovery's steps per commit, K): the
undo copies are those of its first step's start, it commits after its K-th, and a rank lost in
the middle goes back to its start (the script redoes up to K steps). Transactions are still
numbered one by one; the journal's base makes the number a training step (`commit(steps)`).
"""
import json

import numpy as np
import torch

from ..fsdp.views import as_tensor
from ... import _pool

__all__ = ["PoolState", "StepJournal"]

_MANIFEST_BYTES = 1 << 16


class PoolState:
    """State buffers of this rank in the daemon's pool, as torch tensors."""

    def __init__(self, client):
        self.client = client

    def tensor(self, name, numel, dtype=torch.float32):
        """(a flat tensor of `numel` elements of `dtype` in state buffer `name`, whether it
        existed before: a restarted process adopts its values; a new one is zeros)."""
        item = torch.empty((), dtype=dtype).element_size()
        raw, existed = self.client.state_buffer(name, max(int(numel), 1) * item)
        # Beside the parameter shards (the optimizers' state, the undo copies): a CUDA tensor
        # on the cuda backend; host memory otherwise.
        return as_tensor(raw).view(dtype)[:int(numel)], existed


class StepJournal:
    """Begin and commit marks of the optimizer steps over `tensors()` (name -> tensor, the
    state a step changes), with an undo copy of each in the pool."""

    def __init__(self, pool, tensors):
        self.pool, self._tensors = pool, tensors
        self.meta, _ = pool.tensor(_pool.JOURNAL_META, _pool.JOURNAL_META_FIELDS,
                                  torch.int64)
        raw, _ = pool.client.state_buffer(_pool.JOURNAL_MANIFEST, _MANIFEST_BYTES)
        self._manifest_raw = raw
        # Every state tensor the rank held at its last commit (a shrink's successor takes them
        # over: shrink.py); the manifest above has only those of a step's start.
        raw, _ = pool.client.state_buffer(_pool.JOURNAL_HELD, _MANIFEST_BYTES)
        self._held_raw, self._held = raw, None
        self._undo = {}  # name -> its undo tensor
        self._recorded = None  # the names in the manifest as last written
        self._depth = 0

    committed = property(lambda self: int(self.meta[_pool.COMMITTED]),
                         doc="The last transaction (optimizer step or load) committed.")
    base = property(lambda self: int(self.meta[_pool.BASE]),
                    doc="What makes a transaction's number a training step (a load sets it).")
    step = property(lambda self: self.committed + self.base,
                    doc="The training step this rank's state is at: completed steps since the "
                        "job's start or since the step a loaded checkpoint held.")
    depth = property(lambda self: self._depth, doc="Open transactions (nested ones count).")

    def _undo_of(self, name, t):
        u = self._undo.get(name)
        if u is None:
            u, _ = self.pool.tensor(_pool.journal_undo(name), t.numel(), t.dtype)
            self._undo[name] = u
        return u

    def _record(self, tensors):
        """What the undo copies cover, in the pool: [name, elements, dtype] of each (a
        restarted process reads it, before its optimizers have asked for their state)."""
        self._recorded = _write_names(self._manifest_raw, tensors, self._recorded)

    def recorded_names(self):
        return _read_names(self._manifest_raw)

    def held_names(self):
        """[name, elements, dtype] of every state tensor the rank held at its last commit,
        the undo copies' too (a journal of an older version recorded only those)."""
        names = {n[0]: n for n in self.recorded_names()}
        names.update({n[0]: n for n in _read_names(self._held_raw)})
        return [names[k] for k in sorted(names)]

    def begin(self):
        """Before a step changes the state: the undo copies, then the mark. Nested calls (an
        optimizer stepping another inside) are one transaction."""
        self._depth += 1
        if self._depth > 1:
            return
        tensors = self._tensors()
        self._record(tensors)
        for name, t in tensors.items():
            self._undo_of(name, t).copy_(t)
        self.meta[_pool.BASE_BEFORE] = self.meta[_pool.BASE]
        self.meta[_pool.BEGUN] = self.meta[_pool.COMMITTED] + 1

    def set_base(self, step):
        """Inside a load's transaction: the state is at training step `step` once it commits."""
        self.meta[_pool.BASE] = int(step) - int(self.meta[_pool.BEGUN])

    def commit(self, steps=1):
        """Ends the transaction (the outermost of nested calls), which held `steps` optimizer
        steps: the training step moves on by that many."""
        self._depth -= 1
        if self._depth == 0:
            self.meta[_pool.BASE] += int(steps) - 1
            self._held = _write_names(self._held_raw, self._tensors(), self._held)
            self.meta[_pool.COMMITTED] = self.meta[_pool.BEGUN]

    def abandon(self):
        """A step that raised: its transaction stays begun (a restart undoes it)."""
        self._depth = 0

    def roll_to(self, to):
        """Brings this rank's state to the end of step `to`: forward where the rank began step
        `to` and its state is that step's already (redundancy_step says when), else back."""
        committed, begun = int(self.meta[_pool.COMMITTED]), int(self.meta[_pool.BEGUN])
        if committed < to:
            if begun != to:
                raise RuntimeError(f"ragshard recovery: this rank committed step {committed} "
                                   f"(began {begun}); it cannot roll forward to step {to}")
            self.meta[_pool.COMMITTED] = to
            return
        self.roll_back(to)

    def roll_back(self, to):
        """Brings this rank's state to the start of step `to` + 1: where it began a later step
        (or committed one), the undo copies go back."""
        committed, begun = int(self.meta[_pool.COMMITTED]), int(self.meta[_pool.BEGUN])
        if begun > committed or committed > to:
            if committed - to > 1 or begun - to > 1:
                raise RuntimeError(
                    f"ragshard recovery: this rank committed step {committed} (began {begun}), "
                    f"more than one past step {to} that every rank completed; its undo copy "
                    "holds only the start of the last step")
            tensors = self._tensors()  # the shards (the optimizers' state is not asked for yet)
            for name, numel, dtype in self.recorded_names():
                t = tensors.get(name)
                if t is None:
                    t, _ = self.pool.tensor(name, numel, getattr(torch, dtype))
                t.copy_(self._undo_of(name, t))
            self.meta[_pool.BASE] = self.meta[_pool.BASE_BEFORE]
        self.meta[_pool.COMMITTED] = to
        self.meta[_pool.BEGUN] = to


def _write_names(raw, tensors, last):
    """[name, elements, dtype] of each of `tensors` into the state buffer `raw` (its length,
    then JSON), unless they are `last`; returns them."""
    names = [[n, t.numel(), str(t.dtype).removeprefix("torch.")]
             for n, t in sorted(tensors.items())]
    if names == last:
        return last
    data = json.dumps(names).encode()
    if len(data) + 8 > _MANIFEST_BYTES:
        raise ValueError(f"StepJournal: {len(names)} state tensors do not fit the journal's "
                         f"manifest of {_MANIFEST_BYTES} bytes")
    raw[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    raw[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
    return names


def _read_names(raw):
    n = int(np.frombuffer(raw[:8].tobytes(), dtype=np.int64)[0])
    return json.loads(raw[8:8 + n].tobytes()) if n > 0 else []


def agree_on_committed(control, committed, have=True):
    """The last step every rank committed: the least `committed` over the ranks, which differ by
    at most one (StepJournal). The least and the greatest over every rank (HSDP's replicas
    included) are exact integer reductions (ControlUnits.extremes: any world up to 2^24 ranks,
    any step count below 2^63), so the check that they differ by at most one is exact too. A
    rank without state (`have` False: a replacement node's, rebuilt afterwards) takes part in
    the reduction but gives no step."""
    [(ranks, low, high)] = control.extremes([committed if have else None])
    if ranks == 0:
        raise RuntimeError("ragshard recovery: no rank kept its state (every node was replaced)")
    if high - low > 1:
        mine = f"this rank {committed}, " if have else ""
        raise RuntimeError(f"ragshard recovery: the ranks' committed steps differ by more than "
                           f"one ({mine}the least {low} and the greatest {high} over {ranks} "
                           "ranks)")
    return low


def redundancy_step(client, control, journal, low, have=True, node_lost=False):
    """The step the ranks resume at where the job keeps redundancy across nodes, and whether
    they protect it again first (docs/recovery.md, "One consistent step"); `low` is the last
    step every rank committed. Each step's state is protected once the step commits, in the
    background of the next step, and whole on every node before the next step begins (a
    barrier ends each protect; a node then drops the parity of the step before). So:
    - `low` + 1 where every node holds its parity and every rank with state began it: a load,
      whose state is protected before it commits (the ranks roll forward);
    - else `low` where every node holds its parity (a rank that began `low` + 1 rolls back);
    - else, where no node was lost, `low`, protected again (the ranks' state is whole);
    - else `low` - 1: no rank began `low` + 1 (its protect of `low` would have finished), so
      every rank rolls back from `low` with its undo copy, and every node still holds the
      parity of `low` - 1 (none passed `low`'s barrier).
    A rank without state (`have` False: a lost node's replacement) counts for nothing but its
    loss; `node_lost`: a node was lost, whatever the ranks say (a shrink's re-cut). The counts
    are exact (ControlUnits.sum_ints)."""
    lost = 0 if have and not node_lost else 1
    forward = now = 0
    if have:
        steps = client.stats().get("parity_steps", [])
        forward = 0 if int(journal.meta[_pool.BEGUN]) > low and low + 1 in steps else 1
        now = 0 if low in steps else 1
    lost, forward, now = control.sum_ints([lost, forward, now], bits=1)
    if forward == 0:
        return low + 1, False
    if now == 0:
        return low, False
    if lost == 0 or low == 0:
        # (At step 0 with a node lost the rebuild names the parity that no node holds.)
        return low, lost == 0
    return low - 1, False


def rebuild_state(client, replacement, journal, step):
    """Every rank of a job with redundancy, once every rank is at `step` (OP_REBUILD): where a
    node was replaced (docs/recovery.md, "A lost node"), the other nodes send what its ranks
    need, and their state buffers and parameter shards hold their state at `step` again (their
    journal then says so); and every node keeps only `step`'s parity (another step's, from a
    protect that did not finish everywhere, covers state the ranks no longer hold)."""
    client.rebuild().wait()
    if replacement:
        journal.meta[_pool.COMMITTED] = step
        journal.meta[_pool.BEGUN] = step


def shard_tensors(client, units):
    """{name: tensor} of this rank's parameter shards (the daemon's buffers)."""
    return {_pool.shard(ui): as_tensor(client.param_shard(ui)) for ui in units}
