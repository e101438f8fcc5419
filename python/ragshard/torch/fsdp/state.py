"""fully_shard's whole-model operations: PyTorch's state_dict / load_state_dict with unsharded
tensors."""
import torch

from .pieces import set_param_values, tensor_pieces
from .views import tensor_of


class ModuleState:
    """A ShardedModule's state dicts: collectives, which every rank calls.

    `module`: the wrapped module (its state_dict names the parameters and holds the
    buffers); `units`: the ModuleUnits; `layout`: the ShardLayout; `shards`: the RankShards
    (the optimizer ranges, the fp32 masters, and the pieces a load writes); `gathers`: the
    UnitGathers (a unit's exact values, unsharded); `client`: the attached ragshard.Client."""

    def __init__(self, module, units, layout, shards, gathers, client):
        self._module, self._units, self._layout = module, units, layout
        self._shards, self._gathers, self._client = shards, gathers, client

    def full_state(self, rank0_only=False):
        """ShardedModule.full_state: {name: fp32 tensor} of every parameter, unsharded (one
        all-gather per unit, one unit at a time; with bf16 parameters the fp32 masters, as
        FSDP2's sharded parameters are: `_gather_masters`), and the plain parameters fully_shard
        left out (ignored_params) as they are; the other ranks get {} with `rank0_only`."""
        keep = not rank0_only or self._layout.rank == 0
        out = {}
        for ui, (_, _, params) in enumerate(self._units.groups):
            if self._shards.master_of(ui) is not None and \
                    self._shards.shard(ui)[0].dtype == torch.bfloat16:
                full = self._gather_masters(ui)
                for n, p in params if keep else ():
                    _, off, numel = next(v for v in self._units.views[ui] if v[0] is p)
                    out[n] = full[off:off + numel].view(p.shape).clone()
                continue
            was = self._gathers.is_unsharded(ui)
            self._gathers.gather_exact(ui)  # not a quantized unit's last dequantized values
            for n, p in params if keep else ():
                out[n] = p.detach().float().cpu().clone()
            if not was:
                self._gathers.reshard(ui)
        for n, p in self._module.named_parameters() if keep else ():
            if self._units.index_of(p) is None:
                out[n] = p.detach().float().cpu().clone()
        return out

    def _gather_masters(self, ui):
        """Unit `ui`'s fp32 masters, whole (a collective): the masters' upper and lower 16 bits
        travel in turn through the bf16 parameter shards (each rank's optimizer range, spread by
        the update gather where the factors differ) and the unit's all-gather, bit for bit; the
        shards then get their bf16 values back."""
        was = self._gathers.is_unsharded(ui)
        self._gathers.reshard(ui)
        shard, master = self._shards.shard(ui)[0], self._shards.master_of(ui)
        bits = master.view(torch.int32)
        halves = []
        for part in ((bits >> 16).to(torch.int16), (bits & 0xFFFF).to(torch.int16)):
            if self._layout.steps:
                shard.view(torch.int16).copy_(part)
            self._shards.gather_updates()
            self._client.unshard(ui).wait()
            unit = tensor_of(self._client.unsharded(ui), "bf16")
            halves.append(unit.view(torch.int16).to(torch.int32).cpu())
            self._client.reshard(ui).wait()
        if self._layout.steps:
            shard.copy_(master.to(shard.dtype))
        self._shards.gather_updates()
        if was:
            self._gathers.unshard(ui)
        return ((halves[0] << 16) | (halves[1] & 0xFFFF)).view(torch.float32)

    def state_dict(self):
        """ShardedModule.state_dict: on rank 0 every parameter as an fp32 CPU tensor under each
        of its names in the module's own state_dict (tied aliases too) and the persistent
        buffers; {} on the other ranks."""
        params = self.full_state(rank0_only=True)
        out = {}
        if self._layout.rank == 0:
            for name, t in self._module.state_dict(keep_vars=True).items():
                idx = self._units.index_of(t)
                out[name] = params[self._units.names[idx]] if idx is not None else \
                    t.detach().cpu().clone()
        return out

    def load_state_dict(self, state_dict, strict=True):
        """ShardedModule.load_state_dict (after any checkpoint write): returns torch's
        (missing_keys, unexpected_keys) and whether every parameter got its values."""
        units = self._units
        names = {pc.name for pc in tensor_pieces(self._shards)} | \
            {n for ui in self._shards.units() for n, _ in units.params(ui)}
        own = self._module.state_dict(keep_vars=True)  # persistent buffers; tied aliases
        buffers = {n: b for n, b in own.items() if units.index_of(b) is None}
        aliases = {n: units.names[units.index_of(t)] for n, t in own.items()
                   if units.index_of(t) is not None and n not in names}
        for alias, name in aliases.items():  # a tied weight given under another of its names
            if alias in state_dict and name not in state_dict:
                state_dict = dict(state_dict, **{name: state_dict[alias]})
        missing = sorted((names | set(buffers)) - set(state_dict))
        unexpected = sorted(set(state_dict) - names - set(buffers) - set(aliases))
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]}")
        for ui in self._shards.units():
            for n, p in units.params(ui):
                if n in state_dict and tuple(state_dict[n].shape) != tuple(p.shape):
                    raise RuntimeError(f"load_state_dict: '{n}' has shape "
                                       f"{list(state_dict[n].shape)}, the model's is "
                                       f"{list(p.shape)}")
        for pc in tensor_pieces(self._shards):
            if pc.name in state_dict:
                flat = state_dict[pc.name].detach().reshape(-1)
                set_param_values(self._shards, pc, flat[pc.start:pc.start + pc.hi - pc.lo].cpu())
        self._shards.gather_updates()
        for n, b in buffers.items():
            if n in state_dict and b is not None:
                b.data.copy_(state_dict[n])
        keys = torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
        return keys, not names & set(missing)
