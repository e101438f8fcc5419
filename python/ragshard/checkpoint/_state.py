"""What a rank of a ShardedModule holds, in tensor coordinates (ragshard.torch.fsdp.pieces), and
where loaded values go. The layout on disk is that of the tensors, not of the plan: a load under
any other plan reads the ranges its own pieces need.
"""
import torch

from ..torch.fsdp.pieces import param_values, set_param_values, tensor_pieces  # noqa: F401
from ._format import CheckpointError

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int64": torch.int64, "uint8": torch.uint8, "int8": torch.int8}
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


def adamw_of(optimizer):
    """The optimizer's kind and the ShardedAdamW inside it (itself, or ShardedMuon's or
    ShardedShampoo's for the parameters that are not their matrices; none for
    ShardedAdam8bit)."""
    from ..torch.optimizers.muon import ShardedMuon
    from ..torch.optimizers.adam8bit import ShardedAdam8bit
    from ..torch.optimizers.shampoo import ShardedShampoo
    from ..torch.optimizers.sharded import ShardedOptimizer
    if optimizer is None:
        return None, None
    if isinstance(optimizer, ShardedAdam8bit):
        return "adam8bit", None
    if isinstance(optimizer, ShardedMuon):
        return "muon", optimizer.adamw
    if isinstance(optimizer, ShardedShampoo):
        return "shampoo", optimizer.adamw
    if isinstance(optimizer, ShardedOptimizer) and optimizer.cls is torch.optim.AdamW:
        return "adamw", optimizer
    name = type(optimizer).__name__
    if isinstance(optimizer, ShardedOptimizer):
        name = f"ShardedOptimizer of torch.optim.{optimizer.cls.__name__}"
    raise CheckpointError(f"optimizer: {name} is not ShardedAdamW (or ShardedOptimizer of "
                          "AdamW), ShardedMuon, ShardedShampoo or ShardedAdam8bit; any other "
                          "torch optimizer's state is checkpointed by save_dcp / load_dcp")


# Shampoo's preconditioner state of matrix NAME is the checkpoint tensor NAME + SHAMPOO_STATE
# (kind "shampoo"): a vector of every block's L, R, root of L and root of R, row-major, block
# after block; its owner writes it whole, and the owner under the loading plan reads it whole.
# Its step count is the optimizer step count of the same name.
SHAMPOO_STATE = "#shampoo"

# 8-bit Adam's moments are stored as they are held: the codes as records `adam8bit_m` (int8)
# and `adam8bit_v` (uint8) of the parameter, element for element, and the fp32 block scales as
# records `m_scale` and `v_scale` of the tensor NAME + ADAM8BIT_SCALES, one element per block
# (a matrix's 128 x 128 tiles row-major, a vector's 256-element runs). A piece never cuts a
# block, so each rank's blocks are one range of them: a resume is exact.
ADAM8BIT_SCALES = "#adam8bit_scales"


def _adam8bit_blocks(pc, blocks):
    """The tensor-wide block range [first, first + count) of piece `pc` (tensor coordinates),
    and the tensor's block count."""
    from ..torch.optimizers.adam8bit import MATRIX_BLOCK, VECTOR_BLOCK
    numel = 1
    for d in pc.shape:
        numel *= d
    if blocks.rows == 0:
        return pc.start // VECTOR_BLOCK, -(-blocks.cols // VECTOR_BLOCK), \
            -(-numel // VECTOR_BLOCK)
    cols = pc.shape[-1]
    per_row = -(-cols // MATRIX_BLOCK)
    return (pc.start // cols // MATRIX_BLOCK * per_row,
            -(-blocks.rows // MATRIX_BLOCK) * per_row,
            -(-(numel // cols) // MATRIX_BLOCK) * per_row)


def _collect_adam8bit(optimizer, records, steps, shapes):
    for pc, blocks, st in optimizer.pieces:
        if int(st["step"]) == 0:
            continue  # no step yet: nothing but zeros
        first, _, total = _adam8bit_blocks(pc, blocks)
        records += [(pc.name, "adam8bit_m", pc.start, st["m"]),
                    (pc.name, "adam8bit_v", pc.start, st["v"]),
                    (pc.name + ADAM8BIT_SCALES, "m_scale", first, st["m_scale"].reshape(-1)),
                    (pc.name + ADAM8BIT_SCALES, "v_scale", first, st["v_scale"].reshape(-1))]
        shapes[pc.name + ADAM8BIT_SCALES] = [total]
        steps[pc.name] = float(st["step"])


def _place_adam8bit(optimizer, reader, steps):
    for pc, blocks, st in optimizer.pieces:
        n = pc.hi - pc.lo
        st["step"].fill_(int(steps.get(pc.name, 0)))
        if int(st["step"]) == 0:
            st["m"].zero_(), st["v"].zero_(), st["m_scale"].zero_(), st["v_scale"].zero_()
            continue
        first, count, _ = _adam8bit_blocks(pc, blocks)

        def read(name, kind, lo, hi):
            data, dt = reader.read(name, kind, lo, hi)
            return from_bytes(data, dt)
        st["m"].copy_(read(pc.name, "adam8bit_m", pc.start, pc.start + n))
        st["v"].copy_(read(pc.name, "adam8bit_v", pc.start, pc.start + n))
        for kind in ("m_scale", "v_scale"):
            st[kind].copy_(read(pc.name + ADAM8BIT_SCALES, kind, first, first + count).view(
                st[kind].shape))


def adamw_slots(adamw):
    """{(unit, lo): torch parameter} of a ShardedAdamW: its tensors by their shard piece."""
    return {(ui, lo): p for (_, p, _), (ui, lo, _) in zip(adamw.pieces, adamw.where)}


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def collect(model, optimizer):
    """This rank's records: a list of (tensor, kind, start, tensor to store), the optimizer's
    per-parameter step counts {name: step}, and the shapes of the optimizer's own tensors
    (Shampoo's state) {name: shape}."""
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
        if kind in ("muon", "shampoo") and pc.matrix and pc.unit in optimizer.buf:
            records.append((pc.name, optimizer.momentum_kind, pc.start,
                            optimizer.buf[pc.unit][pc.lo:pc.hi]))
    shapes = {}
    if kind == "adam8bit":
        _collect_adam8bit(optimizer, records, steps, shapes)
    if kind == "shampoo":
        for name, st in optimizer.state.items():
            flat = torch.cat([t.reshape(-1) for t in st.tensors()])
            records.append((name + SHAMPOO_STATE, "shampoo", 0, flat))
            shapes[name + SHAMPOO_STATE] = [flat.numel()]
            steps[name + SHAMPOO_STATE] = float(st.step)
    return kind, records, steps, shapes


def _place_shampoo(optimizer, reader, meta, steps):
    """Shampoo's preconditioners of the matrices this rank owns under the loading plan."""
    optimizer.clear_state()
    for name in optimizer.owned:
        key = name + SHAMPOO_STATE
        rec = meta["tensors"].get(key)
        if rec is None:
            continue  # the matrix had no step yet
        st = optimizer.preconditioner(name)
        parts = st.tensors()
        numel = sum(t.numel() for t in parts)
        if rec["shape"] != [numel]:
            raise CheckpointError(
                f"{reader.path}: Shampoo's state of '{name}' has {rec['shape'][0]} elements "
                f"there, {numel} here (saved with another block side? this plan's is "
                f"{optimizer.owned[name].block or 'none'})")
        data, dt = reader.read(key, "shampoo", 0, numel)
        flat = from_bytes(data, dt)
        at = 0
        for t in parts:
            t.copy_(flat[at:at + t.numel()].view(t.shape))
            at += t.numel()
        st.step = int(steps[key])


def place(model, optimizer, reader, meta):
    """Loads this rank's pieces (parameters and optimizer state) from `reader`. A rank whose
    optimizer range another local rank steps in the same memory (model.steps False) reads
    nothing: that rank loads the range."""
    kind, adamw = adamw_of(optimizer)
    stored_kind = meta.get("optimizer", {}).get("kind")
    if optimizer is not None and stored_kind != kind:
        raise CheckpointError(f"{reader.path}: holds {stored_kind or 'no'} optimizer state; the "
                              f"optimizer given is {kind} (pass optimizer=None to load only the "
                              "parameters)")
    steps = meta.get("optimizer", {}).get("steps", {})
    slots = adamw_slots(adamw) if adamw is not None else {}
    shapes = {n: tuple(t["shape"]) for n, t in meta["tensors"].items()}
    for pc in tensor_pieces(model) if model.steps else ():
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
        if kind in ("muon", "shampoo") and pc.matrix and pc.unit in optimizer.buf:
            optimizer.buf[pc.unit][pc.lo:pc.hi] = read(optimizer.momentum_kind).to(
                optimizer.buf[pc.unit].device)
    if kind == "shampoo":
        _place_shampoo(optimizer, reader, meta, steps)
    if kind == "adam8bit":
        _place_adam8bit(optimizer, reader, steps)
    if adamw is not None:
        adamw._home()  # the moments just read go into the module's state tensors
