"""This rank's shards of a ShardedModule and what its optimizers and checkpoints work on: the
parameters' pieces in the rank's optimizer range, the whole-matrix tensors, the fp32 masters the
module keeps apart from the shards, and the optimizers' state tensors."""
import torch

from .meta import release_freed_memory, values
from .params import Matrix, Piece
from .views import as_tensor, tensor_of
from ... import _pool


class RankShards:
    """This rank's parameter and gradient shards of every unit.

    Its interface is the one ShardedModule offers its optimizers and checkpoints (the module
    delegates the same names here, and ragshard.torch.fsdp.pieces takes either): `units()`,
    `unit_params`, `unit_views`, `param_index`, `pieces`, `piece_start`, `shard`, `master_of`,
    `ospos`, `os_elems`, `gather_updates` and `optimizer_state`, with the attributes `masters`
    ({unit: fp32 master}) and `matrices` (a Matrix per whole-matrix tensor).

    `client`: the attached ragshard.Client; `param_dtype`: "fp32" or "bf16"; `layout`: the
    ShardLayout; `units`: the ModuleUnits. Each unit's values come in through `fill`."""

    def __init__(self, client, param_dtype, layout, units):
        self._client, self._dtype = client, param_dtype
        self._layout, self._units = layout, units
        self._pieces = {}  # unit -> [Piece]: the parameters' pieces in this rank's range
        # fp32 masters kept apart from the shard: of the optimizer range (bf16 parameters), or
        # of the whole parameter shard (`_whole`: quantized gathers, whose unsharded buffer
        # holds dequantized values). The optimizers step them.
        self.masters = {}
        self._whole = set()
        self.matrices = []  # Matrix of each whole-matrix tensor (Muon's and Shampoo's)
        self._optimizer_state = {}  # (optimizer, key, unit) -> tensor (optimizer_state)
        # Where the optimizers' state lives: a PoolState (recovery.py) in a job that recovers
        # lost ranks in place, else tensors of this process.
        self.pool = None
        self._pooled_masters = {}  # name -> a master in the pool (named_state's)

    @property
    def ospos(self):
        return self._layout.ospos

    @property
    def os_elems(self):
        return self._layout.os_elems

    def fill(self, ui, meta, init, write=True):
        """Writes unit `ui`'s initial values into this rank's parameter shard, and notes the
        unit's pieces, its whole-matrix tensors and, with a parameter dtype below fp32, the
        exact fp32 master of its optimizer range. A parameter whose id is in `meta` (built on
        the meta device) takes its values from `init` (a function; "empty": zeros, a load
        follows), built whole only while its pieces are copied. `write` False: the shard keeps
        what it holds (a recovered rank's adopted values)."""
        lay = self._layout
        shard = tensor_of(self._client.param_shard(ui), self._dtype)
        s = lay.shard_elems[ui]
        lo, hi = lay.pos * s, (lay.pos + 1) * s
        # The optimizer range (the whole shard unless the factors differ).
        olo = lay.ospos * lay.os_elems[ui]
        ohi = olo + lay.os_elems[ui]
        # With a parameter dtype below fp32, the optimizer's fp32 master of its range starts
        # from the exact initial values (as FSDP2's sharded parameters), not their rounding.
        exact = torch.zeros(ohi - olo) if self._dtype != "fp32" else None
        pieces = self._pieces[ui] = []
        for n, p in self._units.params(ui):
            place = lay.places[n]
            off, numel = place.offset, place.numel
            index = self._units.index_of(p)
            matrix = place.kind is not None
            a, b = max(off, lo), min(off + numel, hi)
            if a < b and not write:
                oa, ob = max(a, olo), min(b, ohi)
                if oa < ob:
                    pieces.append(Piece(index, oa - olo, ob - olo, matrix))
            elif a < b:
                if id(p) not in meta:
                    mine = p.detach().reshape(-1)[a - off:b - off]
                elif callable(init):  # the whole tensor, only while its pieces are copied
                    mine = values(init, n, p).reshape(-1)[a - off:b - off]
                else:
                    mine = torch.zeros(b - a)  # init="empty": a load follows
                shard[a - lo:b - lo].copy_(mine.to(shard.dtype))
                oa, ob = max(a, olo), min(b, ohi)
                if oa < ob:
                    if exact is not None:
                        exact[oa - olo:ob - olo] = mine[oa - a:ob - a].float()
                    pieces.append(Piece(index, oa - olo, ob - olo, matrix))
                if id(p) in meta:
                    del mine
                    release_freed_memory()  # the whole tensor's pages, back to the system
            if matrix:
                self.matrices.append(Matrix(ui, off, numel, tuple(p.shape), place.owner,
                                            place.packed, index, n, place.kind, place.block))
        if exact is not None:
            self.masters[ui] = self._master(ui, exact, write)

    def keep_whole_master(self, ui):
        """Keeps an exact fp32 master of unit `ui`'s whole parameter shard (quantized gathers:
        the unsharded buffer's slots hold dequantized values once a quantized gather has run),
        from the shard's values now (in a job that recovers in place, unless the pool holds the
        rank's master already: an adopted rank's shard may hold dequantized values). Returns
        it."""
        self._whole.add(ui)
        shard = as_tensor(self._client.param_shard(ui))
        self.masters[ui] = self._master(ui, shard if self.pool is not None else shard.clone())
        return self.masters[ui]

    def _master(self, ui, values, write=True):
        """Unit `ui`'s fp32 master holding `values`: `values` itself (a tensor of this process),
        or in a job that recovers lost ranks in place, a state buffer of the pool that the step
        journal covers (a restarted process adopts what it holds: `write` False, or a master the
        pool holds already, keeps it)."""
        if self.pool is None:
            return values
        name = state_name(_MASTER + (ui,))
        t, existed = self.pool.tensor(name, values.numel())
        if write and not existed:
            t.copy_(values)
        self._pooled_masters[name] = t
        return t

    # -- the optimizers' and checkpoints' interface -------------------------------------------

    def units(self):
        return range(len(self._units))

    def unit_params(self, ui):
        """[(name, parameter)] of unit `ui`, in plan order."""
        return self._units.params(ui)

    def unit_views(self, ui):
        """[(parameter, offset, numel)] of unit `ui`: where each lies in the unit."""
        return self._units.views[ui]

    def param_index(self, p):
        """The index of parameter `p` in unit order (that of `has_grad` and of the pieces);
        KeyError where `p` is not the module's."""
        index = self._units.index_of(p)
        if index is None:
            raise KeyError(id(p))
        return index

    def pieces(self, ui):
        """The parameters' pieces in this rank's optimizer range of unit `ui` (Piece: parameter
        index, elements [lo, hi) of the range, whether a matrix)."""
        return self._pieces[ui]

    def piece_start(self, ui, lo, index):
        """The flat element of parameter `index` at element `lo` of this rank's optimizer range
        of unit `ui`."""
        return self._layout.ospos * self._layout.os_elems[ui] + lo - self._units.offsets[index]

    def shard(self, ui):
        """This rank's optimizer range of unit `ui`: its parameters (fp32 or bf16, in the
        parameter shard) and its fp32 gradients (in the gradient shard). With p = g = os that is
        the whole of both shards."""
        (at_p, at_g), n = self._layout.os_at[ui], self._layout.os_elems[ui]
        return (tensor_of(self._client.param_shard(ui), self._dtype)[at_p:at_p + n],
                as_tensor(self._client.grad_shard(ui))[at_g:at_g + n])

    def master_of(self, ui):
        """The fp32 master of this rank's optimizer range of unit `ui` where the module keeps
        one apart from the shard (bf16 parameters, quantized gathers), else None."""
        m, n = self.masters.get(ui), self._layout.os_elems[ui]
        if m is None or m.numel() == n:
            return m
        at_p = self._layout.os_at[ui][0]  # a master of the whole parameter shard
        return m[at_p:at_p + n]

    def gather_updates(self):
        """AMSP's update gather after an optimizer step (or a load) with separate factors: each
        rank's optimizer range reaches every parameter shard that holds it. Every rank calls
        it; nothing runs when p = g = os."""
        if not self._layout.factored:
            return
        handles = [self._client.update_gather(ui) for ui in self.units()]
        for h in handles:
            h.wait()
        for ui in sorted(self._whole):
            # A master of the whole shard takes its exact values, before any dequantized
            # gather writes into the unsharded buffer that may map it.
            self.masters[ui].copy_(as_tensor(self._client.param_shard(ui)))

    def optimizer_state(self, owner, key, ui, numel, dtype=torch.float32):
        """The tensor of `numel` elements that holds state `key` of optimizer `owner` for unit
        `ui` (zeros when new). The optimizers keep their state of this rank's pieces here rather
        than in tensors of their own, so that where it lives is the module's choice."""
        k = (owner, key, ui)
        t = self._optimizer_state.get(k)
        if t is None or t.numel() != numel or t.dtype != dtype:
            if self.pool is None:  # on the device of the unit's shards (CUDA ones: cuda)
                device = as_tensor(self._client.param_shard(ui)).device if ui >= 0 else None
                t = torch.zeros(numel, dtype=dtype, device=device)
            else:  # the daemon's: a restarted process of this rank gets it back
                t, _ = self.pool.tensor(state_name(k), numel, dtype)
            self._optimizer_state[k] = t
        return t

    def named_state(self):
        """{name: tensor} of what optimizer_state has made, and of the masters in the pool
        (StepJournal's names)."""
        out = {state_name(k): t for k, t in self._optimizer_state.items()}
        out.update(self._pooled_masters)
        return out

    def optimizer_state_tensors(self):
        """Every tensor optimizer_state has made, in the order made."""
        return list(self._optimizer_state.values())


# The fp32 masters' state buffers: (owner, key) of optimizer_state's names, one per unit (the
# optimizers step them; a re-cut moves an fp32 one of the whole shard like their state).
_MASTER = ("ShardedModule", "master")


def state_name(key):
    """The state buffer of optimizer state (owner, key, unit)."""
    owner, name, ui = key
    return _pool.optimizer_state(owner, name, ui)
