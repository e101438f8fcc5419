"""A shrink that re-cuts the shards (docs/recovery.md, "Shrinking in place").

A job of one shard group (plain FSDP, `--replicate 1`) whose redundancy holds each node's state
whole on another node (`replica`, or `parity:1`'s pairs) may lose a node for good: its survivors
go on as a successor job of fewer ranks, whose plan cuts every unit differently. Each survivor
then holds its own old shards, and the node that held the lost node's copy holds that node's
ranks' shards too (its daemon exposes them to a salvage attachment: "copy/<step>/...",
JobRuntime::ExposeCopy). Every tensor element lies in exactly one old rank's shard, so each
successor rank writes the elements it holds into its unit's unsharded gradient buffer at the new
plan's offsets, zeros elsewhere, and a reduce-scatter (sum) over the successor's data plane
leaves each rank its new shard: x + 0 is exact. The parameter shards and every elementwise
optimizer state kept in shard coordinates (ShardedOptimizer's under `state_in_place`, Muon's
momentum) move this way; the optimizers' step counts, one per optimizer, are agreed on.
"""
import json

import numpy as np
import torch

from ..._core import Error
from ..fsdp.layout import tensor_places
from .journal import PoolState, StepJournal, agree_on_committed, redundancy_step, shard_tensors
from ..fsdp.views import as_tensor
from ... import _pool

__all__ = ["in_place", "recut", "recut_step"]

# ShardedOptimizer's step counts, one per piece: its state "step" of unit -1 ("<tag>/step/-1").
_STEPS = _pool.optimizer_state("", "step", -1)[len(_pool.optimizer_prefix("")):]


def recut(old, new, plan_old, plan_new, control, units, survivors):
    """The successor's rank `new` re-cuts the state of rank `old` (its salvage attachment to
    the shrunk job) with the other survivors (every rank calls it; `control`: the successor's
    ControlUnits; `survivors`: the old job's survivor_ranks). Every rank agrees on the step to
    go on from, brings its old state to it, and the new shards and optimizer state are written
    into the successor's buffers. Returns (the step, the bytes this rank moved, {optimizer
    state prefix: its step count})."""
    _check_plans(old, new, plan_old, plan_new, units)
    pool = PoolState(old)
    held = StepJournal(pool, lambda: shard_tensors(old, units))
    low = agree_on_committed(control, held.committed)
    step, _ = redundancy_step(old, control, held, low, node_lost=True)
    held.roll_to(step)
    problem, names, copy = None, {}, None
    try:
        names = _state_names(old, held, units)
        copy = _copy_held(old, step, survivors, units)
    except Exception as e:  # noqa: BLE001 (every rank hears of it before any goes on)
        problem = _as_error(e, old)
    _all_ok(control, old, problem)
    _check_copies(control, old, copy, survivors)
    # What every rank moves: each optimizer state's family ("opt/<owner>/<key>") over every
    # unit, where any rank holds it (a rank holds none of an optimizer without pieces there).
    mine = {n.rsplit("/", 1)[0] for n in names if not n.endswith(_STEPS)}
    steps = {n for n in names if n.endswith(_STEPS)}
    if copy is not None:
        mine |= {n.rsplit("/", 1)[0] for n in copy[1]
                 if n.startswith(_pool.OPTIMIZER) and not n.endswith(_STEPS)}
        steps |= {n for n in copy[1] if n.endswith(_STEPS)}
    families = _union(new, control, units, mine | steps)
    steps = {n for n in families if n.endswith(_STEPS)}
    families -= steps
    sources = [(old.rank, lambda name, ui: _own(old, pool, names, name, ui))]
    if copy is not None:
        sources.append((copy[0], lambda name, ui: _copied(old, step, copy[1], name, ui)))
    moved = 0
    to = PoolState(new)
    places_old, places_new = tensor_places(plan_old), tensor_places(plan_new)
    for ui in units:
        s_old, s_new = old.shard_elems(ui), new.shard_elems(ui)
        spans = [(p_old.offset, p_new.offset, p_old.numel)
                 for name, p_old in places_old.items() if p_old.unit == ui
                 for p_new in (places_new[name],)]
        for name in [None] + [f"{f}/{ui}" for f in sorted(families)]:
            # A rank's own failure is kept until the end, every rank running every collective
            # (the others would otherwise wait for it in the next one).
            new.allocate_grad(ui).wait()  # (from here to the reduce-scatter's end)
            try:
                if problem is None:
                    moved += _write(as_tensor(new.grad(ui)), sources, name, ui, s_old, spans)
            except Exception as e:  # noqa: BLE001
                problem = _as_error(e, old)
            new.reduce_scatter(ui, "sum").wait()
            try:
                got = as_tensor(new.grad_shard(ui))[:s_new]
                if problem is not None:
                    pass
                elif name is None:
                    as_tensor(new.param_shard(ui)).copy_(got)
                elif bool(got.any()):  # (else the optimizer makes it, zeros, where it has pieces)
                    to.tensor(name, s_new)[0].copy_(got)
            except Exception as e:  # noqa: BLE001
                problem = _as_error(e, old)
        as_tensor(new.grad_shard(ui)).zero_()
    _all_ok(control, old, problem)
    counts = _step_counts(control, old, pool, names, copy, step, steps)
    for prefix, n in counts.items():
        to.tensor(_pool.shrink_steps(prefix), 1, torch.float64)[0][0] = n
    to.tensor(_pool.SHRINK_IN_PLACE, 1, torch.int64)[0][0] = 1
    return step, moved, counts


def _write(full, sources, name, ui, s_old, spans):
    """Unit `ui`'s unsharded buffer `full` (the successor's layout): zeros, and each source's
    elements of state `name` (None: the parameter shard) at their new offsets (`spans`: each
    tensor's (old offset, new offset, elements)). Returns the bytes written."""
    full.zero_()
    moved = 0
    for rank, read in sources:
        src = read(name, ui)
        if src is None:
            continue  # (no pieces of the unit there)
        lo, hi = rank * s_old, (rank + 1) * s_old
        for o_old, o_new, n in spans:
            a, b = max(o_old, lo), min(o_old + n, hi)
            if a < b:
                full[o_new + a - o_old:o_new + b - o_old] = src[a - lo:b - lo]
                moved += (b - a) * 4
    return moved


def _as_error(e, old):
    return e if isinstance(e, Error) else \
        Error(f"INTERNAL: rank {old.rank} of job '{old.job}' could not re-cut its state: "
              f"{type(e).__name__}: {e}")


def in_place(pool, may_recut):
    """Whether the rank's optimizers keep their elementwise state in shard coordinates
    (ShardedModule.state_in_place): decided once per job, when first asked (`may_recut`), kept
    in the pool ("shrink/in_place"), and set by a shrink's take-over in its successor."""
    t, existed = pool.tensor(_pool.SHRINK_IN_PLACE, 1, torch.int64)
    if not existed:
        t[0] = int(bool(may_recut))
    return bool(int(t[0]))


def recut_step(pool, prefix):
    """The step count a re-cut agreed on for optimizer state `prefix` ("opt/<tag>"), or None."""
    t, existed = pool.tensor(_pool.shrink_steps(prefix), 1, torch.float64)
    return float(t[0]) if existed else None


def _check_plans(old, new, plan_old, plan_new, units):
    """The same units of the same tensors in both plans, fp32, one shard group and no separate
    optimizer range in each; else Error naming what differs."""
    if len(plan_old["units"]) != len(plan_new["units"]):
        raise Error(f"FAILED_PRECONDITION: the shrink's successor job '{new.job}' has "
                    f"{len(plan_new['units'])} units, job '{old.job}' "
                    f"{len(plan_old['units'])}: a re-cut keeps the units")
    for ui in units:
        # (in any order: a plan places a unit's tensors for its shard size)
        a = sorted((t["name"], int(t["numel"])) for t in plan_old["units"][ui]["tensors"])
        b = sorted((t["name"], int(t["numel"])) for t in plan_new["units"][ui]["tensors"])
        if a != b:
            raise Error(f"FAILED_PRECONDITION: unit {ui} holds tensors {a[:4]}... in job "
                        f"'{old.job}' and {b[:4]}... in its successor '{new.job}': a re-cut "
                        "keeps each unit's tensors")
        for c, what in ((old, "the shrunk job"), (new, "its successor")):
            lay = c.layout(ui)
            if lay["os_elems"] != c.shard_elems(ui) or lay["grad_elems"] != c.shard_elems(ui):
                raise Error(f"FAILED_PRECONDITION: {what} '{c.job}' shards unit {ui}'s gradients "
                            "or optimizer state apart from its parameters (AMSP factors): a "
                            "re-cut moves one shard group's shards")
        if as_tensor(new.param_shard(ui)).dtype != torch.float32 or \
                as_tensor(old.param_shard(ui)).dtype != torch.float32:
            raise Error(f"FAILED_PRECONDITION: unit {ui} of job '{old.job}' is not fp32: a "
                        "re-cut moves fp32 parameter shards")


def _kind(old, units, name, numel, dtype):
    """What a re-cut does with a state buffer: "skip" (the parameter shards, moved apart; the
    journal's and the shrink's own), "move" (elementwise optimizer state in shard coordinates,
    "opt/<owner>/<key>/<unit>", fp32, a shard's elements; ShardedOptimizer's step counts,
    float64), else "refuse"."""
    if name.startswith((_pool.SHARD, _pool.JOURNAL, _pool.SHRINK, _pool.COPY)):
        return "skip"
    parts = name.split("/")
    if name.endswith(_STEPS) and dtype == "float64":
        return "move"
    if len(parts) == 4 and parts[0] == "opt" and parts[3].isdigit() and \
            int(parts[3]) in units and dtype == "float32" and \
            numel == old.shard_elems(int(parts[3])):
        return "move"
    return "refuse"


def _state_names(old, held, units):
    """{name: elements} of the state rank `old` held at its last commit that a re-cut moves;
    Error naming any it cannot move."""
    out = {}
    for name, numel, dtype in held.held_names():
        kind = _kind(old, units, name, numel, dtype)
        if kind == "move":
            out[name] = numel
        elif kind == "refuse":
            raise Error(f"FAILED_PRECONDITION: rank {old.rank} of job '{old.job}' holds state "
                        f"'{name}' ({numel} x {dtype}), which a re-cut cannot move: it moves "
                        "parameter shards and elementwise optimizer state in shard coordinates "
                        "(ShardedAdamW, ShardedOptimizer, Muon's momentum); block-wise or "
                        "whole-matrix state (8-bit Adam, Shampoo) needs whole replica groups "
                        "(--replicate 2)")
    return out


def _copy_held(old, step, survivors, units):
    """(the rank, {segment: bytes}) of the lost rank whose state this rank's node holds whole
    at `step` (JobRuntime::ExposeCopy; only the segments a re-cut moves, each checked for its
    size), or None (none, or a survivor's)."""
    raw, _ = old.state_buffer(_pool.copy(step, _pool.COPY_DIRECTORY_BYTES), 8)
    size = int(np.frombuffer(raw.tobytes(), dtype=np.int64)[0])
    if size <= 0:
        return None
    text, _ = old.state_buffer(_pool.copy(step, _pool.COPY_DIRECTORY), size)
    lines = text.tobytes().decode().splitlines()
    head = lines[0].split()
    rank = int(head[3])
    if rank in survivors:
        return None
    segments = {}
    for line in lines[1:]:
        n, name = line.split(" ", 1)
        n = int(n)
        if name.startswith(_pool.SHARD):
            if int(name[6:]) not in units:
                continue  # (the module's control units: nothing to keep)
            ok = n == 4 * old.shard_elems(int(name[6:]))
        else:
            float64 = name.endswith(_STEPS)
            kind = _kind(old, units, name, n // (8 if float64 else 4),
                         "float64" if float64 else "float32")
            ok = kind != "refuse" and n % (8 if float64 else 4) == 0
            if kind == "skip":
                continue
        if not ok:
            raise Error(f"FAILED_PRECONDITION: the copy of rank {rank} of job '{old.job}' held "
                        f"with rank {old.rank} has state '{name}' of {n} bytes, which a re-cut "
                        "cannot move")
        segments[name] = n
    missing = [ui for ui in units if _pool.shard(ui) not in segments]
    if missing:
        raise Error(f"DATA_LOSS: the copy of rank {rank} of job '{old.job}' held with rank "
                    f"{old.rank} has no parameter shard of units {missing[:8]}")
    return rank, segments


def _all_ok(control, old, problem):
    """Raises `problem` on its rank, and on every other rank an Error saying that one could
    not re-cut, once all of them know (none goes on into a collective the others skip)."""
    [failed] = control.sum_ints([0 if problem is None else 1], bits=1)
    if problem is not None:
        raise problem
    if failed:
        raise Error(f"FAILED_PRECONDITION: {failed} survivor(s) of job '{old.job}' could not "
                    "re-cut their state (their errors name why)")


def _check_copies(control, old, copy, survivors):
    """Every lost rank's copy found on exactly one survivor, else Error on every rank: an exact
    count per lost rank of the survivors holding its copy (ControlUnits.sum_ints), and one of
    copies of ranks that were not lost."""
    kept = set(survivors)
    lost = [r for r in range(old.world_size) if r not in kept]
    holds = [0] * (len(lost) + 1)
    if copy is not None:
        holds[lost.index(copy[0]) if copy[0] in lost else len(lost)] = 1
    counts = control.sum_ints(holds, bits=1)
    if counts != [1] * len(lost) + [0]:
        found = sum(1 for c in counts[:-1] if c)
        twice = [r for r, c in zip(lost, counts) if c > 1]
        raise Error(f"FAILED_PRECONDITION: job '{old.job}' lost ranks {lost}, and the nodes left "
                    f"hold whole copies of {found} of them"
                    + (f" (ranks {twice} more than once)" if twice else "")
                    + (f" and of {counts[-1]} rank(s) not lost" if counts[-1] else "")
                    + ": a re-cut needs each lost node's copy on a node left (replica: the node "
                    "after it on the ring, which was lost too?)")


def _union(new, control, units, strings):
    """The union over the successor's ranks of each rank's set of `strings`: an all-gather
    through a reduce-scatter (sum) of the largest unit's gradient buffer, each rank writing its
    strings (JSON, one byte per element, after their length) into its own block of every
    rank's slot. Error on every rank where one's do not fit its block."""
    ui = max(units, key=new.shard_elems)
    s, w = new.shard_elems(ui), new.world_size
    block = s // w
    data = json.dumps(sorted(strings)).encode()
    fits = len(data) + 1 <= block
    new.allocate_grad(ui).wait()
    g = as_tensor(new.grad(ui))
    g.zero_()
    slots = g[:w * s].view(w, s)
    slots[:, new.rank * block] = float(len(data)) if fits else -1.0
    if fits:
        slots[:, new.rank * block + 1:new.rank * block + 1 + len(data)] = \
            torch.tensor(list(data), dtype=torch.float32)
    new.reduce_scatter(ui, "sum").wait()
    got = as_tensor(new.grad_shard(ui))[:s].clone()
    as_tensor(new.grad_shard(ui)).zero_()
    out = set()
    for r in range(w):
        n = int(got[r * block])
        if n < 0:
            raise Error(f"FAILED_PRECONDITION: the names of rank {r}'s optimizer state do not "
                        f"fit the {block} elements a re-cut exchanges them in (unit {ui})")
        raw = bytes(int(x) for x in got[r * block + 1:r * block + 1 + n].tolist())
        out |= set(json.loads(raw.decode()))
    return out


def _own(old, pool, names, name, ui):
    if name is None:
        return as_tensor(old.param_shard(ui))
    return pool.tensor(name, names[name])[0] if name in names else None


def _copied(old, step, segments, name, ui):
    key = _pool.shard(ui) if name is None else name
    nbytes = segments.get(key)
    if nbytes is None:
        return None  # (the copied rank has no pieces of the unit there; its shards are checked)
    raw, _ = old.state_buffer(_pool.copy(step, key), max(nbytes, 1))
    return torch.from_numpy(raw[:nbytes]).view(torch.float32)


def _step_counts(control, old, pool, names, copy, step, steps):
    """{optimizer state prefix "opt/<tag>": its step count} for each of `steps` (the step
    counts' names over every rank), the same on every rank: each optimizer's pieces must all
    have stepped as often (ShardedOptimizer's counts, kept per piece), else Error naming it. A
    rank without pieces (one count, 0, or none) does not vote. The counts' least and greatest
    over the voters, and the ranks whose own pieces disagree, are exact integer reductions
    (ControlUnits.extremes and sum_ints), for every optimizer at once."""
    order = sorted(steps)
    if not order:
        return {}
    mine, bad, held = [], [], []
    for name in order:
        counts = [pool.tensor(name, names[name], torch.float64)[0].tolist()] \
            if name in names else []
        if copy is not None and name in copy[1]:
            raw, _ = old.state_buffer(_pool.copy(step, name), copy[1][name])
            counts.append(torch.from_numpy(raw.copy()).view(torch.float64).tolist())
        values = set()
        for c in counts:
            if c != [0.0]:
                values |= set(c)
        one = next(iter(values)) if len(values) == 1 else None
        whole = one is not None and float(one).is_integer() and 0 <= one < 2.0 ** 63
        mine.append(int(one) if whole else None)
        bad.append(int(len(values) > 1 or (one is not None and not whole)))
        held.append(sorted(values))
    ranges = control.extremes(mine)
    disagree = control.sum_ints(bad, bits=1)
    out = {}
    for name, (_, low, high), b, values in zip(order, ranges, disagree, held):
        if b or low != high:
            raise Error(f"FAILED_PRECONDITION: the pieces of optimizer state '{name[:-8]}' of job "
                        f"'{old.job}' have stepped different numbers of times (rank {old.rank}: "
                        f"{values}; over the ranks from {low} to {high}): a re-cut keeps one "
                        "step count per optimizer")
        out[name[:-len(_STEPS)]] = float(low) if low is not None else 0.0
    return out
