"""What a rank of a ShardedModule holds, in tensor coordinates (ragshard.torch.pieces), and
where loaded values go. The layout on disk is that of the tensors, not of the plan: a load under
any other plan reads the ranges its own pieces need.
"""
import torch

from ..torch.pieces import tensor_pieces
from ._format import CheckpointError

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int64": torch.int64, "uint8": torch.uint8}
_NAMES = {v: k for k, v in _TORCH.items()}


def dtype_name(dtype):
    if dtype not in _NAMES:
        raise CheckpointError(f"a tensor of {dtype} cannot be stored (supported: "
                              f"{', '.join(_TORCH)})")
    return _NAMES[dtype]


def from_bytes(data, dtype):
    """A tensor over `data` (bytes-like) of stored dtype `dtype`."""
    if len(data) == 0:
        return torch.empty(0, dtype=_TORCH[dtype])
    return torch.frombuffer(data, dtype=_TORCH[dtype])


def param_values(model, pc):
    """The exact values of piece `pc`: the fp32 master where the module keeps one (bf16
    parameters, quantized gathers), else the parameter shard."""
    shard, _ = model.shard(pc.unit)
    src = model.masters.get(pc.unit, shard)
    return src[pc.lo:pc.hi]


def set_param_values(model, pc, values):
    """Writes `values` (any float dtype) into piece `pc`: the fp32 master and the shard."""
    shard, _ = model.shard(pc.unit)
    master = model.masters.get(pc.unit)
    if master is not None:
        master[pc.lo:pc.hi].copy_(values.to(master.dtype))
    shard[pc.lo:pc.hi].copy_(values.to(shard.dtype))


def adamw_of(optimizer):
    """The ShardedAdamW inside `optimizer` (itself, or ShardedMuon's for non-matrices)."""
    from ..torch.optim import ShardedAdamW, ShardedMuon
    if optimizer is None:
        return None, None
    if isinstance(optimizer, ShardedMuon):
        return "muon", optimizer.adamw
    if isinstance(optimizer, ShardedAdamW):
        return "adamw", optimizer
    raise CheckpointError(f"optimizer: {type(optimizer).__name__} is not ShardedAdamW or "
                          "ShardedMuon")


def adamw_slots(adamw):
    """{(unit, lo): torch parameter} of a ShardedAdamW: its tensors by their shard piece."""
    return {(ui, lo): p for (_, p, _), (ui, lo, _) in zip(adamw.pieces, adamw.where)}


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def collect(model, optimizer):
    """This rank's records: a list of (tensor, kind, start, tensor to store) and the optimizer's
    per-parameter step counts {name: step}."""
    kind, adamw = adamw_of(optimizer)
    slots = adamw_slots(adamw) if adamw is not None else {}
    records, steps = [], {}
    for pc in tensor_pieces(model):
        records.append((pc.name, "param", pc.start, param_values(model, pc)))
        p = slots.get((pc.unit, pc.lo))
        state = adamw.opt.state.get(p) if p is not None else None
        if state:
            for key in ADAM_KEYS:
                records.append((pc.name, key, pc.start, state[key].reshape(-1)))
            steps[pc.name] = float(state["step"])
        if kind == "muon" and pc.matrix and pc.unit in optimizer.buf:
            records.append((pc.name, "muon_momentum", pc.start,
                            optimizer.buf[pc.unit][pc.lo:pc.hi]))
    return kind, records, steps


def place(model, optimizer, reader, meta):
    """Loads this rank's pieces (parameters and optimizer state) from `reader`."""
    kind, adamw = adamw_of(optimizer)
    stored_kind = meta.get("optimizer", {}).get("kind")
    if optimizer is not None and stored_kind != kind:
        raise CheckpointError(f"{reader.path}: holds {stored_kind or 'no'} optimizer state; the "
                              f"optimizer given is {kind} (pass optimizer=None to load only the "
                              "parameters)")
    steps = meta.get("optimizer", {}).get("steps", {})
    slots = adamw_slots(adamw) if adamw is not None else {}
    shapes = {n: tuple(t["shape"]) for n, t in meta["tensors"].items()}
    for pc in tensor_pieces(model):
        if pc.name not in shapes:
            raise CheckpointError(f"{reader.path}: no tensor '{pc.name}' (the checkpoint holds "
                                  f"{len(shapes)} tensors of another model?)")
        if shapes[pc.name] != pc.shape:
            raise CheckpointError(f"{reader.path}: tensor '{pc.name}' has shape "
                                  f"{list(shapes[pc.name])} there, {list(pc.shape)} here")
        lo, hi = pc.start, pc.start + pc.hi - pc.lo

        def read(kind_):
            data, dt = reader.read(pc.name, kind_, lo, hi)
            return from_bytes(data, dt)
        set_param_values(model, pc, read("param"))
        p = slots.get((pc.unit, pc.lo))
        if p is not None:
            adamw.opt.state.pop(p, None)
            if pc.name in steps:
                adamw.opt.state[p] = {
                    "step": torch.tensor(steps[pc.name], dtype=torch.float32),
                    # The buffers just read are private to this load: no copy is needed.
                    **{key: read(key).to(device=p.device, dtype=p.dtype)
                       for key in ADAM_KEYS}}
        if kind == "muon" and pc.matrix and pc.unit in optimizer.buf:
            optimizer.buf[pc.unit][pc.lo:pc.hi] = read("muon_momentum").to(
                optimizer.buf[pc.unit].device)
