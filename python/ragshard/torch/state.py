"""fully_shard's whole-model operations: gradient clipping by the global norm, and PyTorch's
state_dict / load_state_dict with unsharded tensors."""
import math

import torch

from .pieces import set_param_values, tensor_pieces


class ModuleState:
    """A ShardedModule's clipping and state dicts: collectives, which every rank calls.

    `module`: the wrapped module (its state_dict names the parameters and holds the
    buffers); `units`: the ModuleUnits; `layout`: the ShardLayout; `shards`: the RankShards
    (the optimizer ranges, and the pieces a load writes); `gathers`: the UnitGathers (a unit's
    exact values, unsharded); `control`: the ControlUnits (the sum of the norm over ranks)."""

    def __init__(self, module, units, layout, shards, gathers, control):
        self._module, self._units, self._layout = module, units, layout
        self._shards, self._gathers, self._control = shards, gathers, control

    def clip_grad_norm_(self, max_norm):
        """Clips the gradient shards by the global norm over all shards; returns that norm.
        Each rank sums the squares of its optimizer range; every os position is held by
        W / |os| ranks (HSDP's replicas, AMSP's os groups), so the sum over the ranks counts
        each element that many times."""
        local = 0.0
        for ui in self._shards.units():
            _, g = self._shards.shard(ui)
            local += float(g.double().pow(2).sum())
        _, g_size, os_size = self._layout.group_sizes
        holders = self._layout.replicas * g_size // os_size  # W / |os|
        total = math.sqrt(self._control.all_reduce_scalar(local) / holders)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0 and self._layout.steps:  # else a local rank stepping the same memory
            for ui in self._shards.units():
                self._shards.shard(ui)[1].mul_(coef)  # the range: each stepped by one rank
        return total

    def full_state(self, rank0_only=False):
        """ShardedModule.full_state: {name: fp32 tensor} of every parameter, unsharded (one
        all-gather per unit, one unit at a time); the other ranks get {} with `rank0_only`."""
        keep = not rank0_only or self._layout.rank == 0
        out = {}
        for ui, (_, _, params) in enumerate(self._units.groups):
            was = self._gathers.is_unsharded(ui)
            self._gathers.gather_exact(ui)  # not a quantized unit's last dequantized values
            for n, p in params if keep else ():
                out[n] = p.detach().float().cpu().clone()
            if not was:
                self._gathers.reshard(ui)
        return out

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
