"""torch.distributed.checkpoint (DCP) checkpoints of a ShardedModule and its optimizer, in the
layout FSDP2 saves and loads, both ways.

    ragshard.checkpoint.save_dcp(model, opt, "/shared/ckpt/step-4", extra={"sched": sched})
    ragshard.checkpoint.load_dcp(model, opt, "/shared/ckpt/step-4", extra={"sched": sched})

The state dict is {"model": {FQN: tensor}, "optim": {"state": {FQN: {key: tensor}},
"param_groups": [{option: value, "params": [FQN, ...]}]}, **extra}: "model" has the keys of
`get_model_state_dict` under FSDP2 (the module's state_dict keys, tied aliases included),
"optim" the layout of `get_optimizer_state_dict` (each parameter under its first name), and an
extra entry is a Stateful (state_dict / load_state_dict) or a plain value, passed through.

Each rank writes only its own pieces, as chunks of the global tensors: a piece of a parameter
(a range of its flat elements) is cut into the few boxes of whole rows and row parts it covers,
each a chunk of DCP's metadata; the optimizer's elementwise state likewise. Ranks that hold the
same pieces (HSDP replicas) write them once (DCP's deduplication). DCP's planners and its
FileSystemWriter and FileSystemReader do the work; ragshard has no torch.distributed process
group, so the plans and write results a process group would gather and scatter travel through
the job's keys on the planner (_exchange.py), with the job's own collectives as barriers: the
checkpoint's directory is the one thing the ranks' hosts must share (as for FSDP2), and a save
to a path some rank's host does not see fails on every rank, named, before anything is written.
A failure on any rank is raised on every rank. The commit is atomic: everything is written into
PATH.partial, rank 0 writes DCP's .metadata there last and renames the directory to PATH. A
crash leaves no PATH, so nothing that looks complete.

A load reads, on each rank, only the chunk ranges its own pieces need (DCP's resharding), at any
world size, granule, HSDP mesh or strategy, whoever wrote the checkpoint; it checks every key,
shape and dtype before it reads anything.
"""
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from . import _exchange, _shared, _state
from ._format import CheckpointError

__all__ = ["save_dcp", "load_dcp", "boxes"]


def boxes(shape, a, b):
    """The boxes of a tensor of `shape` (row-major) that cover its flat elements [a, b): a list
    of (offsets, sizes, flat start), each box contiguous in the flat order."""
    if a >= b:
        return []
    if not shape:
        return [((), (), a)]
    inner = 1
    for d in shape[1:]:
        inner *= d
    rest = tuple(shape[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    zeros = (0,) * len(rest)

    def within(row, lo, hi):
        return [((row,) + off, (1,) + size, row * inner + st)
                for off, size, st in boxes(rest, lo, hi)]
    if r0 == r1:
        return within(r0, o0, o1)
    out = []
    if o0:
        out += within(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + zeros, (r1 - r0,) + rest, r0 * inner))
    if o1:
        out += within(r1, 0, o1)
    return out


class _Ragged:
    """A global tensor of `shape` and `dtype` of which this rank holds `pieces`: (flat start,
    flat tensor) each, cut into boxes as DCP's chunks. DCP calls __create_write_items__ and
    __create_chunk_list__; the planners below find a chunk's tensor with `box`."""

    def __init__(self, shape, dtype, pieces):
        self.shape, self.dtype = torch.Size(shape), dtype
        self._boxes = {}  # offsets -> (sizes, view)
        for start, t in pieces:
            flat = t.reshape(-1)
            for off, size, st in boxes(tuple(shape), start, start + flat.numel()):
                n = 1
                for d in size:
                    n *= d
                self._boxes[off] = (size, flat[st - start:st - start + n].view(size))

    def size(self):
        return self.shape

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.shape))
                for off, (size, view) in self._boxes.items()]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size))
                for off, (size, _) in self._boxes.items()]

    def box(self, offsets):
        return self._boxes[tuple(offsets)][1]


def _lookup(state_dict, index, default):
    obj = state_dict.get(index.fqn)
    if isinstance(obj, _Ragged):
        return obj.box(index.offset)
    return default(index)


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index):
        return _lookup(self.state_dict, index, super().lookup_object)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # DefaultLoadPlanner's, less its walk that materializes meta tensors (none here), which
        # would turn the _Ragged leaves into None.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index, super().lookup_tensor)


# -- what a rank holds -----------------------------------------------------------------------


def _aliases(model):
    """{parameter index: every name of it in the module's state dict} (tied weights have more
    than one), and the module's persistent buffers {name: tensor}."""
    names, buffers = {}, {}
    params = {id(p) for p in model.module.parameters()}
    for name, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in params:
            names.setdefault(model.param_index(t), []).append(name)
        else:
            buffers[name] = t
    return names, buffers


def _param_pieces(model):
    """{parameter index: (shape, [(flat start, piece of the parameter's values)])} on this
    rank (the fp32 masters where the module keeps them)."""
    out = {}
    for pc in _state.tensor_pieces(model):
        out.setdefault(pc.index, (pc.shape, []))[1].append(
            (pc.start, _state.param_values(model, pc)))
    return out


def _optimizer_kind(optimizer):
    from ..torch.optimizers.groups import ModuleOptimizer
    from ..torch.optimizers.shampoo import ShardedShampoo
    if not isinstance(optimizer, ModuleOptimizer) or not hasattr(optimizer, "dcp_state") or \
            isinstance(optimizer, ShardedShampoo):
        raise CheckpointError(
            f"save_dcp/load_dcp: {type(optimizer).__name__} has no DCP layout (supported: "
            "ShardedOptimizer of any elementwise torch optimizer, ShardedAdamW, ShardedMuon; "
            "ShardedShampoo's and ShardedAdam8bit's state is in ragshard.checkpoint.save)")


def _optim_state(model, optimizer):
    """The optimizer's entry: torch's layout under FQNs, this rank's state as _Ragged views of
    the optimizer's own tensors (a load writes into them), and the param groups."""
    _optimizer_kind(optimizer)
    state, groups = {}, []
    for g in optimizer.param_groups:
        fqns = []
        for p in g["params"]:
            index = model.param_index(p)
            fqn = model.unit_param_name(index)
            fqns.append(fqn)
            elementwise, scalars = optimizer.dcp_state(index)
            entry = dict(scalars)
            for key, pieces in elementwise.items():
                entry[key] = _Ragged(p.shape, pieces[0][1].dtype, pieces)
            if entry:
                state[fqn] = entry
        groups.append(dict({k: v for k, v in g.items() if k not in ("params", "param_names")},
                           params=fqns))
    return {"state": state, "param_groups": groups}


def _extra_state(extra):
    return {k: v.state_dict() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")
            else v for k, v in (extra or {}).items()}


# -- save ------------------------------------------------------------------------------------


def save_dcp(model, optimizer, path, extra=None):
    """Writes model (a ShardedModule), optimizer (or None) and `extra` as a DCP checkpoint at
    `path`, which must not exist and must be on a filesystem every rank's host sees (as for
    FSDP2's dcp.save). Every rank calls it; a failure on any rank is raised on every rank."""
    model.wait_for_checkpoint_write()
    path = os.path.abspath(path)
    staging = path + ".partial"
    marker = os.path.join(staging, ".ragshard-save")
    state = {"model": {}}
    names, buffers = _aliases(model)
    for index, (shape, pieces) in _param_pieces(model).items():
        for fqn in names[index]:
            state["model"][fqn] = _Ragged(shape, torch.float32, pieces)
    for index, fqns in names.items():  # parameters of which this rank holds nothing
        for fqn in fqns:
            state["model"].setdefault(fqn, _Ragged(model.module.get_parameter(fqn).shape,
                                                   torch.float32, []))
    for fqn, b in buffers.items():
        state["model"][fqn] = b.detach()
    if optimizer is not None:
        state["optim"] = _optim_state(model, optimizer)
    state.update(_extra_state(extra))
    client, rank, world = model.client, model.rank, model.world

    def start():
        if os.path.exists(path):
            raise CheckpointError(f"save_dcp: '{path}' exists; a checkpoint is never "
                                  "overwritten (remove it, or save to a new path)")
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftovers
            os.makedirs(staging)
            token = _shared.post_token(model, path)
            with open(marker, "w") as f:
                f.write(token)
    cleanup = lambda: shutil.rmtree(staging, ignore_errors=True)  # noqa: E731
    _shared.phase(model, "save_dcp", start, cleanup)

    def shared():
        # Rank 0's staging directory, seen by this rank: else the pieces this rank wrote would
        # land where rank 0 cannot commit them.
        try:
            with open(marker) as f:
                seen = f.read()
        except OSError:
            seen = None
        _shared.expect_token(model, "save_dcp", staging, seen, path)
    _shared.phase(model, "save_dcp", shared, cleanup)
    writer = dcp.FileSystemWriter(staging)
    planner = _SavePlanner()

    # What a process group would do: every rank's plan to rank 0, which makes the central
    # plans and the metadata; each rank's central plan back to it; its write results to rank 0.
    def local():
        planner.set_up_planner(state, writer.storage_meta(), rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        _exchange.post(client, "plan", rank, writer.prepare_local_plan(
            planner.create_local_plan()), path)
    _shared.phase(model, "save_dcp", local, cleanup)

    def central():
        if rank != 0:
            return None
        plans = [_exchange.fetch(client, "plan", r, path) for r in range(world)]
        global_plans, metadata = planner.create_global_plan(plans)
        for r, plan in enumerate(writer.prepare_global_plan(global_plans)):
            _exchange.post(client, "central", r, plan, path)
        return metadata
    metadata = _shared.phase(model, "save_dcp", central, cleanup)

    def write():
        plan = planner.finish_plan(_exchange.fetch(client, "central", rank, path))
        written = writer.write_data(plan, planner)
        written.wait()
        _exchange.post(client, "written", rank, written.value(), path)
    _shared.phase(model, "save_dcp", write, cleanup)

    def commit():
        if rank == 0:
            results = [_exchange.fetch(client, "written", r, path) for r in range(world)]
            os.remove(marker)
            writer.finish(metadata, results)
            os.rename(staging, path)
            fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _shared.phase(model, "save_dcp", commit, cleanup)


# -- load ------------------------------------------------------------------------------------


def _flat(state):
    """DCP's flat keys of a nested state dict, as its planners make them."""
    return flatten_state_dict(state)[0]


def _check(path, target, metadata):
    """Every key of `target` in the checkpoint, with its shape and dtype: else CheckpointError
    naming the first misfits, before anything is read."""
    have = metadata.state_dict_metadata
    missing, wrong = [], []
    for key, obj in _flat(target).items():
        md = have.get(key)
        if md is None:
            missing.append(key)
            continue
        if isinstance(obj, (torch.Tensor, _Ragged)):
            if not isinstance(md, TensorStorageMetadata):
                wrong.append(f"'{key}' is not a tensor there")
                continue
            if tuple(md.size) != tuple(obj.size()):
                wrong.append(f"'{key}' has shape {list(md.size)} there, {list(obj.size())} here")
            elif md.properties.dtype != obj.dtype:
                wrong.append(f"'{key}' is {md.properties.dtype} there, {obj.dtype} here")
        elif not isinstance(md, BytesStorageMetadata):
            wrong.append(f"'{key}' is a tensor there, a {type(obj).__name__} here")
    if missing:
        optim = [k for k in missing if k.startswith("optim.")]
        what = ("the optimizer state the optimizer needs" if optim and len(optim) == len(missing)
                else "keys of this model")
        raise CheckpointError(
            f"load_dcp: {path} lacks {what}: {', '.join(missing[:6])}"
            f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''} (it holds "
            f"{len(have)} entries: {', '.join(sorted(have)[:4])}, ...)")
    if wrong:
        raise CheckpointError(f"load_dcp: {path} does not fit this model: {'; '.join(wrong[:6])}")


def load_dcp(model, optimizer, path, extra=None, step=None):
    """Loads a DCP checkpoint at `path` (written by save_dcp, or by FSDP2's dcp.save of
    {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt), ...}) into
    model, optimizer (or None: parameters only) and the Stateful entries of `extra`. Every rank
    calls it; a failure to read on any rank is raised on every rank, before anything is changed.
    Where the job recovers lost ranks in place the load is one transaction of the step journal, and `step` (the training step the loaded
    state is at: an int, or a function called once the load is done, e.g. reading a Stateful
    of `extra`; None: the step the state was at) its base (docs/recovery.md, "Checkpoints")."""
    model.wait_for_checkpoint_write()
    with model.recovery.load(step):
        _load_dcp(model, optimizer, path, extra)


def _load_dcp(model, optimizer, path, extra):
    pieces, target, stateful = _shared.phase(model, "load_dcp",
                                      lambda: _read(model, optimizer, path, extra))
    for pc, t in pieces.items():
        _state.set_param_values(model, pc, t)
    model.gather_updates()
    if optimizer is not None:
        _apply_optim(model, optimizer, target["optim"])
    for k, v in stateful.items():
        v.load_state_dict(target[k])
    model.mark_loaded()


def _read(model, optimizer, path, extra):
    """What this rank's pieces, optimizer state and `extra` load from the checkpoint at `path`
    (nothing of the model changed yet): (pieces, the loaded state dict, the Stateful entries)."""
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"load_dcp: no DCP checkpoint at '{path}' (no .metadata: missing, "
                              "or a save that did not commit)") from None
    names, buffers = _aliases(model)
    pieces = {pc: torch.empty(pc.hi - pc.lo) for pc in _state.tensor_pieces(model)}
    by_index = {}
    for pc, t in pieces.items():
        by_index.setdefault(pc.index, (pc.shape, []))[1].append((pc.start, t))
    target = {"model": {}}
    for index, fqns in names.items():
        shape, mine = by_index.get(index, (tuple(model.module.get_parameter(fqns[0]).shape), []))
        target["model"][model.unit_param_name(index)] = _Ragged(shape, torch.float32, mine)
    for fqn, b in buffers.items():
        target["model"][fqn] = b.detach()
    if optimizer is not None:
        _optimizer_kind(optimizer)
        if hasattr(optimizer, "init_state"):
            optimizer.init_state()
        target["optim"] = _optim_state(model, optimizer)
        # The group options this checkpoint holds (a scheduler's initial_lr may be absent).
        for gi, g in enumerate(target["optim"]["param_groups"]):
            for k in [k for k in g if k != "params"]:
                if f"optim.param_groups.{gi}.{k}" not in metadata.state_dict_metadata:
                    del g[k]
    stateful = {k: v for k, v in (extra or {}).items()
                if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}
    target.update(_extra_state(extra))
    _check(path, target, metadata)
    dcp.load(target, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
    return pieces, target, stateful


def _apply_optim(model, optimizer, loaded):
    """After a load: the scalars of each parameter's state onto its pieces, and the group
    options onto the groups (whose parameters must be the same)."""
    for fqn, entry in loaded["state"].items():
        index = model.param_index(model.module.get_parameter(fqn))
        scalars = {k: v for k, v in entry.items() if not isinstance(v, _Ragged)}
        optimizer.dcp_set_scalars(index, scalars)
    if len(loaded["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"load_dcp: the checkpoint has {len(loaded['param_groups'])} "
                              f"param groups, the optimizer {len(optimizer.param_groups)}")
    for gi, (saved, g) in enumerate(zip(loaded["param_groups"], optimizer.param_groups)):
        mine = [model.unit_param_name(model.param_index(p)) for p in g["params"]]
        if list(saved["params"]) != mine:
            raise CheckpointError(f"load_dcp: param group {gi} holds {len(saved['params'])} "
                                  f"parameters there ({', '.join(saved['params'][:3])}, ...), "
                                  f"{len(mine)} here ({', '.join(mine[:3])}, ...)")
        for k, v in saved.items():
            if k != "params":
                g[k] = v
