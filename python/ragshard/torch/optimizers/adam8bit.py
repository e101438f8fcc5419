"""8-bit AdamW on the shards of a ShardedModule: both moments stored block-quantized.

Blocks are in tensor coordinates, one fp32 scale each: 128 x 128 tiles of a matrix (a tensor
of two or more dimensions, seen as numel / shape[-1] rows of shape[-1] columns; the last tiles
of a row or column may be partial) and runs of 256 elements of a vector. A block never
straddles two ranks: the optimizer checks that every piece of this rank's shards starts on a
block boundary and ends on one (or at the tensor's end), which the granule rows:128 (or a
multiple) gives matrices and "whole" (or rows:K, which is whole for a vector) gives vectors,
and refuses a plan that cuts a block, naming the parameter.

Each step, for a parameter with a gradient (the same rule as ShardedAdamW), in fp32:

    m = deq(Qm) * b1 + (1 - b1) * g          v = deq(Qv) * b2 + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    Qm = round(m / s * 127) (int8, s = max |m| of the block)
    Qv = round(sqrt(v) / s * 255) (uint8, s = max sqrt(v) of the block)

with deq(Qm) = Qm * s / 127 and deq(Qv) = (Qv * s / 255)^2 (a block of zeros has s = 0 and
stores zeros). The update uses the moments before they are quantized, as bitsandbytes' 8-bit
Adam does; storing sqrt(v) rather than v keeps small second moments from rounding to zero
where the block also holds large ones.
"""
import math

import torch

from .groups import ModuleOptimizer
from .sharded import copy_masters, master_copies
from ..fsdp.pieces import tensor_pieces

__all__ = ["ShardedAdam8bit", "MATRIX_BLOCK", "VECTOR_BLOCK"]

MATRIX_BLOCK = 128  # a matrix's blocks are MATRIX_BLOCK x MATRIX_BLOCK
VECTOR_BLOCK = 256  # a vector's blocks are VECTOR_BLOCK elements


class _Blocks:
    """The blocks of one piece: `rows` x `cols` elements of a matrix (whole rows from a row
    that is a multiple of MATRIX_BLOCK), or `cols` elements of a vector (rows = 0) from a
    multiple of VECTOR_BLOCK."""

    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols

    def scales(self, x):
        """Each block's max |x| (fp32)."""
        if self.rows == 0:
            n = -(-self.cols // VECTOR_BLOCK) * VECTOR_BLOCK
            return torch.nn.functional.pad(x.abs(), (0, n - self.cols)).view(
                -1, VECTOR_BLOCK).amax(1)
        b = MATRIX_BLOCK
        r, c = -(-self.rows // b) * b, -(-self.cols // b) * b
        tiles = torch.nn.functional.pad(x.abs().view(self.rows, self.cols),
                                        (0, c - self.cols, 0, r - self.rows))
        return tiles.view(r // b, b, c // b, b).amax(dim=(1, 3))

    def expand(self, s):
        """A block's scale on each of its elements (flat)."""
        if self.rows == 0:
            return s.repeat_interleave(VECTOR_BLOCK)[:self.cols]
        b = MATRIX_BLOCK
        full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)
        return full[:self.rows, :self.cols].reshape(-1)


def _blocks_of(pc):
    """The blocks of piece `pc` (ragshard.torch.fsdp.pieces.Piece); ValueError where the plan cuts
    a block."""
    numel, count = math.prod(pc.shape), pc.hi - pc.lo
    ends = pc.start + count == numel
    if len(pc.shape) >= 2:
        cols = pc.shape[-1]
        band = MATRIX_BLOCK * cols
        if pc.start % band or (count % band and not ends):
            raise ValueError(
                f"ShardedAdam8bit: parameter '{pc.name}' {list(pc.shape)} is cut at rows "
                f"{pc.start // cols}..{(pc.start + count) // cols} on this rank, inside its "
                f"{MATRIX_BLOCK}x{MATRIX_BLOCK} blocks; give matrices the granule "
                f"rows:{MATRIX_BLOCK} (or a multiple)")
        return _Blocks(count // cols, cols)
    if pc.start % VECTOR_BLOCK or (count % VECTOR_BLOCK and not ends):
        raise ValueError(
            f"ShardedAdam8bit: parameter '{pc.name}' {list(pc.shape)} is cut at elements "
            f"{pc.start}..{pc.start + count} on this rank, inside its {VECTOR_BLOCK}-element "
            "blocks; give vectors the granule 'whole' (fully_shard's granule= applies to them "
            "too)")
    return _Blocks(0, count)


def _quantize(x, blocks, levels, dtype):
    """(codes, scales) of x >= -max (levels 127, int8) or x >= 0 (levels 255, uint8)."""
    s = blocks.scales(x)
    se = blocks.expand(s)
    q = torch.where(se > 0, torch.round(x / torch.where(se > 0, se, 1.0) * levels), 0.0)
    return q.to(dtype), s


def _dequantize(q, s, blocks, levels):
    return q.float() * blocks.expand(s) / levels


class ShardedAdam8bit(ModuleOptimizer):
    """AdamW with block-quantized moments on this rank's shards (see the module docstring):
    one state per piece of a parameter in the shard, stepped only while its parameter has a
    gradient and a param group, with that parameter's step count and its group's lr, betas,
    eps and weight_decay. Works on the fp32 masters where the module keeps them (bf16
    parameters, quantized gathers) and copies them into the shard.

    The codes, scales and step counts live in the module's state tensors
    (`ShardedModule.optimizer_state`): per unit, its pieces' codes back to back and their
    scales back to back, and one step count per piece; in a job that recovers lost ranks in
    place they are the pool's."""

    recovers = True

    def __init__(self, model, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01):
        super().__init__(model, params, dict(lr=lr, betas=betas, eps=eps,
                                             weight_decay=weight_decay))
        self.copies = master_copies(model)
        found = []  # (Piece, _Blocks, its scales' shape, its codes' and scales' offsets)
        sizes = {}  # (unit, "codes" or "scales") -> the unit's elements so far
        for pc in tensor_pieces(model) if model.steps else ():
            blocks = _blocks_of(pc)
            shape = blocks.scales(torch.zeros(pc.hi - pc.lo)).shape
            at = {}
            for kind, n in (("codes", pc.hi - pc.lo), ("scales", shape.numel())):
                at[kind] = sizes.get((pc.unit, kind), 0)
                sizes[pc.unit, kind] = at[kind] + n
            found.append((pc, blocks, shape, at))
        tag = type(self).__name__
        self._steps = model.optimizer_state(tag, "step", -1, max(len(found), 1), torch.float64)
        # (Piece, _Blocks, {state key: its view}): "step" is a one-element float64 view.
        self.pieces = []
        for i, (pc, blocks, shape, at) in enumerate(found):
            st = {"step": self._steps[i:i + 1]}
            for key, dtype in _STATE.items():
                kind = "scales" if key.endswith("_scale") else "codes"
                whole = model.optimizer_state(tag, key, pc.unit, sizes[pc.unit, kind], dtype)
                n = shape.numel() if kind == "scales" else pc.hi - pc.lo
                view = whole[at[kind]:at[kind] + n]
                st[key] = view.view(shape) if kind == "scales" else view
            self.pieces.append((pc, blocks, st))

    def _step_all(self, m_, **options):
        has = m_.has_grad
        for pc, blocks, st in self.pieces:
            group = self.group_of(pc.index)
            if not has[pc.index] or group is None:
                continue
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            shard, grad = m_.shard(pc.unit)
            master = m_.master_of(pc.unit)
            p = (shard if master is None else master)[pc.lo:pc.hi]
            g = grad[pc.lo:pc.hi]
            st["step"] += 1
            t = int(st["step"])
            m = _dequantize(st["m"], st["m_scale"], blocks, 127) * b1 + (1 - b1) * g
            u = _dequantize(st["v"], st["v_scale"], blocks, 255)
            v = u * u * b2 + (1 - b2) * g * g
            p.mul_(1 - lr * wd)
            denom = v.sqrt() / math.sqrt(1 - b2 ** t) + group["eps"]
            p.sub_(lr / (1 - b1 ** t) * m / denom)
            for key, x, levels in (("m", m, 127), ("v", v.sqrt(), 255)):
                q, scale = _quantize(x, blocks, levels, _STATE[key])
                st[key].copy_(q)
                st[key + "_scale"].copy_(scale)
        copy_masters(self.copies)
        m_.gather_updates()

    def param_state(self, index):
        mine = [st for pc, _, st in self.pieces if pc.index == index]
        if not mine or int(mine[0]["step"]) == 0:
            return {}
        out = {k: torch.cat([st[k].reshape(-1) for st in mine]) for k in _STATE}
        out["step"] = int(mine[0]["step"])
        return out

    def set_param_state(self, index, state):
        at = dict.fromkeys(_STATE, 0)
        for pc, _, st in self.pieces:
            if pc.index != index:
                continue
            for k in at:
                n = st[k].numel()
                src = state[k].reshape(-1)[at[k]:at[k] + n]
                if src.numel() != n:
                    raise ValueError(f"ShardedAdam8bit.load_state_dict: state '{k}' of "
                                     f"'{pc.name}' is shorter than this rank's pieces (load "
                                     "under the same plan)")
                st[k].copy_(src.view(st[k].shape))
                at[k] += n
            st["step"].fill_(int(state["step"]))


# Each piece's state: its codes and its blocks' scales.
_STATE = {"m": torch.int8, "m_scale": torch.float32, "v": torch.uint8,
          "v_scale": torch.float32}

