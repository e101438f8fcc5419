"""Checkpoints that reshard: save at one world size and plan, load at another.

    from ragshard import checkpoint
    checkpoint.save(model, optimizer, "/shared/ckpt", step)            # every rank calls it
    handle = checkpoint.save(model, optimizer, "/shared/ckpt", step, async_save=True)
    ...                                                                 # training goes on
    handle.result()
    step = checkpoint.load(model, optimizer, "/shared/ckpt")           # the newest complete one

`model` is a ShardedModule, `optimizer` its ShardedAdamW, ShardedMuon, ShardedShampoo or
ShardedAdam8bit (or None: parameters only). Each rank of the first replica writes only what it
holds: its pieces of every parameter (the fp32 masters where the module keeps them), of the
optimizer's moments (8-bit Adam's codes and block scales) and of Muon's or Shampoo's momentum,
and the preconditioners of the matrices Shampoo has it own;
rank 0 adds the module's buffers and, once every rank's index is on disk, the
metadata, which describes every tensor in tensor coordinates. A load under any plan (another
world size, granule, unit grouping, HSDP mesh or strategy) reads, on each rank, the ranges that
its own pieces need, and checks the CRC-32 of every chunk it reads.

The checkpoint root must be a directory that every node sees (a shared filesystem, as
torch.distributed.checkpoint assumes): every rank writes its own file there and rank 0 reads
them all to commit. See docs/checkpoint.md.
"""
import json
import os
import shutil
import threading
import time

import torch

from . import _format, _shared, _state
from ._format import CheckpointError
from .dcp import load_dcp, save_dcp  # noqa: F401

__all__ = ["save", "load", "SaveHandle", "CheckpointError", "export_state_dict", "save_dcp",
           "load_dcp"]


def _barrier(model):
    """Every rank (both replicas under HSDP) reaches this point; a collective through the
    daemons, so a rank that died makes the others fail instead of wait."""
    model.all_reduce_scalar(0.0)


def _writer(model):
    """Whether this rank writes: the ranks of the first os group, which hold every optimizer
    range once (the first replica under HSDP; the others hold the same)."""
    return model.os_group == 0


def _buffers(model):
    return [(n, b) for n, b in model.module.named_buffers() if b is not None]


def _snapshot(model, optimizer):
    """This rank's records as (name, kind, start, count, dtype, tensor): views of the shards,
    the masters and the optimizer's state in host memory (an asynchronous save writes them while
    the next forward and backward run: the optimizer's step, which changes them, waits for the
    write), or copies of them in host memory where they are on a GPU."""
    kind, records, steps, shapes = _state.collect(model, optimizer)
    if model.rank == 0:
        records += [(n, "buffer", 0, b.detach().reshape(-1).cpu()) for n, b in _buffers(model)]
    out = []
    for name, rec_kind, start, t in records:
        t = t.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()  # a CUDA backend's buffers: the copy is the snapshot
        out.append((name, rec_kind, start, t.numel(), _state.dtype_name(t.dtype), t))
    shapes.update({pc.name: list(pc.shape) for pc in _state.tensor_pieces(model)})
    if model.rank == 0:
        shapes.update({n: list(b.shape) for n, b in _buffers(model)})
    return kind, out, steps, shapes


def _write_rank(model, partial, step, snapshot, after_first=None):
    """Writes this rank's data file, then its index (the sign that its part is on disk).
    `after_first`: the tests' hook of an asynchronous save (_format.hold_write)."""
    kind, records, steps, shapes = snapshot
    pos = model.ospos  # the writers' os positions are 0 to |os| - 1
    entries = _format.write_pieces(
        os.path.join(partial, _format.data_file(pos)),
        [(f"{name}\0{rec_kind}", start, count, dtype,
          memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b""))
         for name, rec_kind, start, count, dtype, t in records],
        kill_after=_format.kill_point(pos, step), after_first=after_first)
    for e in entries:
        e["name"], e["kind"] = e["name"].split("\0")
        e["file"] = _format.data_file(pos)
    _format.write_json_atomic(os.path.join(partial, _format.index_file(pos)), {
        "pos": pos, "optimizer": kind, "steps": steps, "shapes": shapes, "pieces": entries})


def _plan_summary(model):
    units = []
    for ui in model.units():
        up = model.plan["units"][ui]
        units.append({"unit": up["unit"], "shard_elems": int(model.shard_elems[ui]),
                      "members": list(up.get("members") or [up["unit"]]),
                      "tensors": [{"name": t["name"], "offset": int(t["offset"]),
                                   "numel": int(t["numel"]),
                                   "granule_elems": int(t.get("granule_elems", 0))}
                                  for t in up["tensors"]]})
    return {"world": model.world, "replicas": model.replicas,
            "param_dtype": model.param_dtype,
            "strategy": model.plan.get("strategy", {}).get("executed", ""),
            "policy": model.plan.get("policy", ""), "units": units}


# Rank 0's commits, one at a time (an asynchronous save commits from its own thread, so the
# commits of two saves may run at once), and the commit threads still running by their partial
# directory.
_COMMIT_LOCK = threading.Lock()
_COMMITTING = {}


def _check_coverage(partial, name, kind, pieces, numel):
    """The pieces of one record of a tensor, sorted by start, cover its elements [0, numel)
    one after another: no gap, no overlap, nothing beyond."""
    at = 0
    for p in pieces:
        if p["start"] != at:
            what = "a gap" if p["start"] > at else "an overlap"
            raise CheckpointError(
                f"{partial}: tensor '{name}' ({kind}): {what} at element {min(at, p['start'])}: "
                f"a piece starts at {p['start']} where the pieces before it end at {at}; not "
                "committed")
        at += p["count"]
    if at != numel:
        raise CheckpointError(f"{partial}: tensor '{name}' ({kind}) has elements [0, {at}) of "
                              f"its {numel} stored; not committed")


def _latest_step(root):
    """The step of the checkpoint `latest` names, or None where it names none that loads."""
    try:
        with open(os.path.join(root, _format.LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return None
    key = _format.parse_dir_name(name)
    if key is None or not os.path.isfile(os.path.join(root, name, _format.METADATA)):
        return None
    return key[0]


def _commit(root, partial, step, world, plan, deadline, name):
    """Rank 0: waits (up to `deadline`) for every rank's index, merges them into the metadata,
    and renames the partial directory to `name` under `root`; `latest` then names it, unless it
    names a later step (an asynchronous save of a later step committed first). Older copies of
    the same step are removed last, so that `latest` names a complete checkpoint at every
    instant."""
    indexes = []
    for pos in range(world):
        path = os.path.join(partial, _format.index_file(pos))
        while not os.path.isfile(path):
            if time.monotonic() > deadline:
                raise CheckpointError(f"{partial}: rank {pos} did not finish writing its part "
                                      "before the deadline; the checkpoint is not committed")
            time.sleep(0.02)
        with open(path) as f:
            indexes.append(json.load(f))
    tensors, steps, kinds = {}, {}, set()
    for idx in indexes:
        kinds.add(idx["optimizer"])
        steps.update(idx["steps"])
        for tname, shape in idx["shapes"].items():
            tensors.setdefault(tname, {"shape": shape})
        for e in idx["pieces"]:
            rec = tensors[e["name"]].setdefault(e["kind"], {"dtype": e["dtype"], "pieces": []})
            rec["pieces"].append({k: e[k] for k in ("file", "offset", "start", "count",
                                                    "crc32")})
    for tname, t in tensors.items():
        numel = 1
        for d in t["shape"]:
            numel *= d
        for kind, rec in t.items():
            if kind == "shape":
                continue
            rec["pieces"].sort(key=lambda p: p["start"])
            _check_coverage(partial, tname, kind, rec["pieces"], numel)
    if len(kinds) != 1:
        raise CheckpointError(f"{partial}: the ranks saved different optimizers: {sorted(kinds)}")
    meta = {"format": _format.FORMAT, "step": int(step), "saved_unix_s": time.time(),
            "chunk_bytes": _format.CHUNK_BYTES,
            "optimizer": {"kind": kinds.pop(), "steps": steps}, "plan": plan,
            "files": [_format.data_file(p) for p in range(world)], "tensors": tensors}
    _format.write_json_atomic(os.path.join(partial, _format.METADATA), meta)
    final = os.path.join(root, name)
    with _COMMIT_LOCK:
        if os.path.exists(final):
            raise CheckpointError(f"{final}: exists already; the save of step {step} is not "
                                  "committed")
        os.rename(partial, final)
        _format.fsync_dir(root)
        named = _latest_step(root)
        if named is None or named <= int(step):
            tmp = os.path.join(root, _format.LATEST + ".tmp")
            with open(tmp, "w") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(root, _format.LATEST))
            _format.fsync_dir(root)
        # Only now the older copies of this step go: `latest` names none of them.
        for old in _format.step_copies(root, int(step)):
            if old != name:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


class SaveHandle:
    """An asynchronous save in progress: `result(timeout)` waits for it (on rank 0, for the
    commit of every rank's part) and returns the checkpoint's directory, or raises its
    error. `written` is set once this rank's part is on disk (or the save failed): until then
    the module's state must not change (`ShardedModule.wait_for_checkpoint_write`)."""

    def __init__(self, write, commit, waited=None):
        self._result, self._error, self._write_error = None, None, None
        self.written = threading.Event()
        # Set once the training thread waits for the write (wait_written, result): the tests'
        # hook _format.hold_write holds the write until then.
        self.waited = waited if waited is not None else threading.Event()

        def run():
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - re-raised by result() and wait_written()
                self._error = self._write_error = e
                return
            finally:
                self.written.set()
            try:
                self._result = commit()
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self._error = e
        self._thread = threading.Thread(target=run, name="ragshard-checkpoint", daemon=True)
        self._thread.start()

    def done(self):
        return not self._thread.is_alive()

    def wait_written(self):
        """Waits until this rank's part is written; raises the save's error if it failed."""
        self.waited.set()
        self.written.wait()
        if self._write_error is not None:
            raise self._write_error

    def result(self, timeout=None):
        self.waited.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("ragshard checkpoint: the save is still running")
        if self._error is not None:
            raise self._error
        return self._result


def save(model, optimizer, root, step, async_save=False, timeout=600.0):
    """Saves `model` (a ShardedModule) and `optimizer` under `root` as step `step`; every rank
    calls it at the same point. Synchronous by default: it returns the checkpoint's directory
    once every rank's part is fsynced and the checkpoint committed. With `async_save`, it
    returns a SaveHandle at once: a thread writes this rank's part (and, on rank 0, commits)
    while the next forward and backward run; the optimizer's next step (and anything else that
    changes the shards: a load, load_state_dict, another save) waits until this rank's part is
    written. On a GPU backend the state is first copied to host memory. `timeout`: seconds that rank 0
    waits for the other ranks' parts before giving up on the commit."""
    model.wait_for_checkpoint_write()  # a previous asynchronous save's part is on disk
    root = os.path.abspath(root)
    partial = os.path.join(root, _format.partial_dir_name(step))
    t0 = time.perf_counter()
    if model.rank == 0:
        # An asynchronous save of the same step, still committing from this directory, ends
        # first (every rank's part of it is on disk: each rank waited for its write above).
        running = _COMMITTING.pop(partial, None)
        if running is not None:
            running.join()
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a crashed save of this step left
        os.makedirs(partial)
        # The directory this save commits to (a new one where the step is on disk already),
        # for the other ranks, with the save's token (_shared.py).
        name = _format.new_dir_name(root, step)
        _format.write_json_atomic(os.path.join(partial, _format.TARGET),
                                  {"name": name, "token": _shared.post_token(model, partial)})
    _barrier(model)  # the partial directory exists, and is empty, for every rank

    def target():  # rank 0's directory, seen by this rank (else its part would be lost)
        try:
            with open(os.path.join(partial, _format.TARGET)) as f:
                seen = json.load(f)
        except (OSError, ValueError):
            seen = {}
        _shared.expect_token(model, "save", partial, seen.get("token"), partial)
        return seen["name"]
    name = _shared.phase(model, "save", target,
                         lambda: shutil.rmtree(partial, ignore_errors=True))
    t1 = time.perf_counter()
    writer = _writer(model)
    snapshot = _snapshot(model, optimizer) if writer else None
    plan = _plan_summary(model)
    # Where the save's time went on this rank (seconds): the barrier that starts it, and the
    # collection of the state.
    model.checkpoint_save_phases = {"start_barrier": t1 - t0,
                                    "snapshot": time.perf_counter() - t1}

    def commit():
        if model.rank == 0:
            return _commit(root, partial, step, model.group_sizes[2], plan,
                           time.monotonic() + timeout, name)
        return os.path.join(root, name)

    if async_save:
        waited = threading.Event()  # the training thread waits for the write
        phases = model.checkpoint_save_phases
        held = _format.hold_write()

        def hold():  # the tests' hook (_format.hold_write): the write spans the next step
            waited.wait()
            phases["write_held"] = True

        def write():
            if writer:
                t = time.perf_counter()
                _write_rank(model, partial, step, snapshot,
                            after_first=hold if held else None)
                # Filled in by the thread once this rank's part is written (after save
                # returned the dict).
                phases["write"] = time.perf_counter() - t

        handle = SaveHandle(write, commit, waited)
        if model.rank == 0:
            for done in [k for k, t in _COMMITTING.items() if not t.is_alive()]:
                del _COMMITTING[done]
            _COMMITTING[partial] = handle._thread
        model.checkpoint_writing = handle  # the optimizer's step waits for the write
        return handle
    if writer:
        _write_rank(model, partial, step, snapshot)
    _barrier(model)  # every part is on disk
    path = commit()
    _barrier(model)  # committed: every rank may load it now
    return path


def load(model, optimizer, root, step=None):
    """Loads the checkpoint under `root` (the newest complete one, the step `step`, or `root`
    itself when it is a checkpoint's directory) into `model` and `optimizer`, whatever plan it
    was saved under. Every rank calls it; each reads only the ranges of its own pieces. Returns
    the checkpoint's step. Where the job recovers lost ranks in place, the load is one
    transaction of the step journal and sets its base: a recovery after it resumes at the
    checkpoint's step plus the steps since (docs/recovery.md, "Checkpoints")."""
    path = _format.resolve(root, step)
    meta = _format.read_metadata(path)
    model.wait_for_checkpoint_write()
    # One transaction where the job recovers in place: the state is at the checkpoint's step.
    with model.recovery.load(int(meta["step"])), _format.Reader(path, meta) as reader:
        _state.place(model, optimizer, reader, meta)
        model.gather_updates()  # separate factors: the rest of each parameter shard
        for name, b in _buffers(model):
            rec = meta["tensors"].get(name)
            if rec is None or "buffer" not in rec:
                raise CheckpointError(f"{path}: no buffer '{name}'")
            data, dt = reader.read(name, "buffer", 0, b.numel())
            b.data.copy_(_state.from_bytes(data, dt).view(b.shape))
        model.checkpoint_bytes_read = reader.bytes_read
    model.mark_loaded()  # every piece was read (fully_shard(init="empty"))
    return int(meta["step"])


def export_state_dict(root, step=None):
    """The checkpoint's parameters and buffers as a plain state_dict {name: tensor} of the
    unsharded model (parameters as stored: fp32 masters where the module kept them)."""
    path = _format.resolve(root, step)
    meta = _format.read_metadata(path)
    out = {}
    with _format.Reader(path, meta) as reader:
        for name, t in meta["tensors"].items():
            if "param" not in t and "buffer" not in t:
                continue  # optimizer state of its own (Shampoo's preconditioners)
            kind = "param" if "param" in t else "buffer"
            numel = 1
            for d in t["shape"]:
                numel *= d
            data, dt = reader.read(name, kind, 0, numel)
            out[name] = _state.from_bytes(data, dt).view(t["shape"]).clone()
    return out
