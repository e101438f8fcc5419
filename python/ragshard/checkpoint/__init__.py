"""Checkpoints that reshard: save at one world size and plan, load at another.

    from ragshard import checkpoint
    checkpoint.save(model, optimizer, "/shared/ckpt", step)            # every rank calls it
    handle = checkpoint.save(model, optimizer, "/shared/ckpt", step, async_save=True)
    ...                                                                 # training goes on
    handle.result()
    step = checkpoint.load(model, optimizer, "/shared/ckpt")           # the newest complete one

`model` is a ShardedModule, `optimizer` its ShardedAdamW or ShardedMuon (or None: parameters
only). Each rank of the first replica writes only what it holds: its pieces of every parameter
(the fp32 masters where the module keeps them), of the optimizer's moments and of Muon's
momentum; rank 0 adds the module's buffers and, once every rank's index is on disk, the
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

from . import _format, _state
from ._format import CheckpointError

__all__ = ["save", "load", "SaveHandle", "CheckpointError", "export_state_dict"]


def _barrier(model):
    """Every rank (both replicas under HSDP) reaches this point; a collective through the
    daemons, so a rank that died makes the others fail instead of wait."""
    model.all_reduce_scalar(0.0)


def _writer(model):
    """Whether this rank writes: the ranks of the first replica (the others hold the same)."""
    return model.rank < model.world


def _buffers(model):
    return [(n, b) for n, b in model.module.named_buffers() if b is not None]


def _snapshot(model, optimizer):
    """This rank's records as (name, kind, start, count, dtype, tensor): views of the shards,
    the masters and the optimizer's state in host memory (an asynchronous save writes them while
    the next forward and backward run: the optimizer's step, which changes them, waits for the
    write), or copies of them in host memory where they are on a GPU."""
    kind, records, steps = _state.collect(model, optimizer)
    if model.rank == 0:
        records += [(n, "buffer", 0, b.detach().reshape(-1).cpu()) for n, b in _buffers(model)]
    out = []
    for name, rec_kind, start, t in records:
        t = t.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()  # a CUDA backend's buffers: the copy is the snapshot
        out.append((name, rec_kind, start, t.numel(), _state.dtype_name(t.dtype), t))
    shapes = {pc.name: list(pc.shape) for pc in _state.pieces(model)}
    if model.rank == 0:
        shapes.update({n: list(b.shape) for n, b in _buffers(model)})
    return kind, out, steps, shapes


def _write_rank(model, partial, step, snapshot):
    """Writes this rank's data file, then its index (the sign that its part is on disk)."""
    kind, records, steps, shapes = snapshot
    pos = model.pos
    entries = _format.write_pieces(
        os.path.join(partial, _format.data_file(pos)),
        [(f"{name}\0{rec_kind}", start, count, dtype,
          memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b""))
         for name, rec_kind, start, count, dtype, t in records],
        kill_after=_format.kill_point(pos, step))
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


def _commit(root, partial, step, world, plan, deadline):
    """Rank 0: waits (up to `deadline`) for every rank's index, merges them into the metadata,
    and renames the partial directory into place; `latest` then names it."""
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
        for name, shape in idx["shapes"].items():
            tensors.setdefault(name, {"shape": shape})
        for e in idx["pieces"]:
            rec = tensors[e["name"]].setdefault(e["kind"], {"dtype": e["dtype"], "pieces": []})
            rec["pieces"].append({k: e[k] for k in ("file", "offset", "start", "count",
                                                    "crc32")})
    for name, t in tensors.items():
        numel = 1
        for d in t["shape"]:
            numel *= d
        for kind, rec in t.items():
            if kind == "shape":
                continue
            rec["pieces"].sort(key=lambda p: p["start"])
            have = sum(p["count"] for p in rec["pieces"])
            if kind in ("param", "buffer") and have != numel:
                raise CheckpointError(f"{partial}: tensor '{name}' ({kind}) has {have} of its "
                                      f"{numel} elements stored; not committed")
    if len(kinds) != 1:
        raise CheckpointError(f"{partial}: the ranks saved different optimizers: {sorted(kinds)}")
    meta = {"format": _format.FORMAT, "step": int(step), "saved_unix_s": time.time(),
            "chunk_bytes": _format.CHUNK_BYTES,
            "optimizer": {"kind": kinds.pop(), "steps": steps}, "plan": plan,
            "files": [_format.data_file(p) for p in range(world)], "tensors": tensors}
    _format.write_json_atomic(os.path.join(partial, _format.METADATA), meta)
    final = os.path.join(root, _format.step_dir_name(step))
    if os.path.exists(final):  # a second save of the same step replaces the first
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _format.fsync_dir(root)
    tmp = os.path.join(root, _format.LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(_format.step_dir_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, _format.LATEST))
    _format.fsync_dir(root)
    return final


class SaveHandle:
    """An asynchronous save in progress: `result(timeout)` waits for it (on rank 0, for the
    commit of every rank's part) and returns the checkpoint's directory, or raises its
    error. `written` is set once this rank's part is on disk (or the save failed): until then
    the module's state must not change (`ShardedModule.wait_for_checkpoint_write`)."""

    def __init__(self, write, commit):
        self._result, self._error, self._write_error = None, None, None
        self.written = threading.Event()

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
        self.written.wait()
        if self._write_error is not None:
            raise self._write_error

    def result(self, timeout=None):
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
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a crashed save of this step left
        os.makedirs(partial)
    _barrier(model)  # the partial directory exists, and is empty, for every rank
    t1 = time.perf_counter()
    writer = _writer(model)
    snapshot = _snapshot(model, optimizer) if writer else None
    plan = _plan_summary(model)
    # Where the save's time went on this rank (seconds): the barrier that starts it, and the
    # collection of the state.
    model.checkpoint_save_phases = {"start_barrier": t1 - t0,
                                    "snapshot": time.perf_counter() - t1}

    def write():
        if writer:
            _write_rank(model, partial, step, snapshot)

    def commit():
        if model.rank == 0:
            return _commit(root, partial, step, model.world, plan,
                           time.monotonic() + timeout)
        return os.path.join(root, _format.step_dir_name(step))

    if async_save:
        handle = SaveHandle(write, commit)
        model.checkpoint_writing = handle  # the optimizer's step waits for the write
        return handle
    if writer:
        _write_rank(model, partial, step, snapshot)
    _barrier(model)  # every part is on disk
    path = os.path.join(root, _format.step_dir_name(step))
    if model.rank == 0:
        path = _commit(root, partial, step, model.world, plan, time.monotonic() + timeout)
    _barrier(model)  # committed: every rank may load it now
    return path


def load(model, optimizer, root, step=None):
    """Loads the checkpoint under `root` (the newest complete one, the step `step`, or `root`
    itself when it is a checkpoint's directory) into `model` and `optimizer`, whatever plan it
    was saved under. Every rank calls it; each reads only the ranges of its own pieces. Returns
    the checkpoint's step."""
    path = _format.resolve(root, step)
    meta = _format.read_metadata(path)
    model.wait_for_checkpoint_write()
    with _format.Reader(path, meta) as reader:
        _state.place(model, optimizer, reader, meta)
        for name, b in _buffers(model):
            rec = meta["tensors"].get(name)
            if rec is None or "buffer" not in rec:
                raise CheckpointError(f"{path}: no buffer '{name}'")
            data, dt = reader.read(name, "buffer", 0, b.numel())
            b.data.copy_(_state.from_bytes(data, dt).view(b.shape))
        model.checkpoint_bytes_read = reader.bytes_read
    return int(meta["step"])


def export_state_dict(root, step=None):
    """The checkpoint's parameters and buffers as a plain state_dict {name: tensor} of the
    unsharded model (parameters as stored: fp32 masters where the module kept them)."""
    path = _format.resolve(root, step)
    meta = _format.read_metadata(path)
    out = {}
    with _format.Reader(path, meta) as reader:
        for name, t in meta["tensors"].items():
            kind = "param" if "param" in t else "buffer"
            numel = 1
            for d in t["shape"]:
                numel *= d
            data, dt = reader.read(name, kind, 0, numel)
            out[name] = _state.from_bytes(data, dt).view(t["shape"]).clone()
    return out
