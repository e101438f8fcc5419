"""fully_shard's whole-model operations: gradient clipping by the global norm, and PyTorch's
state_dict / load_state_dict with unsharded tensors."""
import math

import torch

from .pieces import set_param_values, tensor_pieces
from .views import as_tensor


class StateMixin:
    """ShardedModule's clipping and state dicts."""

    def all_reduce_scalar(self, value):
        """The sum over ranks of one float per rank (through the scalar unit's reduce-scatter:
        every element of this rank's gradient holds `value`, so every element of the reduced
        shard holds the sum)."""
        u = self._scalar_unit
        self.client.allocate_grad(u).wait()
        as_tensor(self.client.grad(u)).fill_(float(value))
        self.client.reduce_scatter(u, "sum").wait()
        if self.replicas > 1:
            self.client.all_reduce(u, "sum").wait()
        return float(as_tensor(self.client.grad_shard(u))[0])

    def clip_grad_norm_(self, max_norm):
        """Clips the gradient shards by the global norm over all shards; returns that norm.
        Each rank sums the squares of its optimizer range; every os position is held by
        W / |os| ranks (HSDP's replicas, AMSP's os groups), so the sum over the ranks counts
        each element that many times."""
        local = 0.0
        for ui in self.units():
            _, g = self.shard(ui)
            local += float(g.double().pow(2).sum())
        _, g_size, os_size = self.group_sizes
        holders = self.replicas * g_size // os_size  # W / |os|
        total = math.sqrt(self.all_reduce_scalar(local) / holders)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0 and self.steps:  # else a local rank stepping the same memory scales it
            for ui in self.units():
                self.shard(ui)[1].mul_(coef)  # the optimizer range: each stepped by one rank
        return total

    def state_dict(self, *args, **kwargs):
        """The full state dict for export (save_pretrained, torch.save), as FSDP2's
        get_model_state_dict with full_state_dict=True and cpu_offload=True gives it: a
        collective (every rank calls it; one unit unsharded at a time), after which rank 0 holds
        every parameter as an fp32 CPU tensor under each of its names in the module's own
        state_dict (tied aliases too) and the persistent buffers, and the other ranks hold
        nothing ({}), not a copy of the whole model."""
        rank0 = self.rank == 0
        params = self.full_state(rank0_only=True)
        out = {}
        if rank0:
            for name, t in self.module.state_dict(keep_vars=True).items():
                idx = self._index.get(id(t))
                out[name] = params[self._names[idx]] if idx is not None else \
                    t.detach().cpu().clone()
        return out

    def wait_for_checkpoint_write(self):
        """Waits until an asynchronous checkpoint save has written this rank's part: the
        shards, masters and optimizer state must not change before (the optimizers' step calls
        it). Raises the save's error if it failed."""
        handle = self.checkpoint_writing
        if handle is not None:
            self.checkpoint_writing = None
            handle.wait_written()

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads a plain (unsharded) state_dict, as `state_dict()` returns or torch.save of the
        plain model holds: each rank copies its pieces of every parameter into its optimizer
        range (and fp32 masters), and the buffers whole; with separate factors the update
        gather then fills the rest of each parameter shard. Every rank calls it. Returns
        (missing_keys, unexpected_keys), as torch's."""
        if assign:
            raise ValueError("load_state_dict: assign=True is not supported (the parameters "
                             "live in the daemon's buffers)")
        self.wait_for_checkpoint_write()
        names = {pc.name for pc in tensor_pieces(self)} | \
            {n for ui in self.units() for n, _ in self.unit_params(ui)}
        own = self.module.state_dict(keep_vars=True)  # persistent buffers; tied aliases
        buffers = {n: b for n, b in own.items() if id(b) not in self._index}
        aliases = {n: self._names[self._index[id(t)]] for n, t in own.items()
                   if id(t) in self._index and n not in names}
        for alias, name in aliases.items():  # a tied weight given under another of its names
            if alias in state_dict and name not in state_dict:
                state_dict = dict(state_dict, **{name: state_dict[alias]})
        missing = sorted((names | set(buffers)) - set(state_dict))
        unexpected = sorted(set(state_dict) - names - set(buffers) - set(aliases))
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing[:8]}, unexpected keys "
                               f"{unexpected[:8]}")
        for ui in self.units():
            for n, p in self.unit_params(ui):
                if n in state_dict and tuple(state_dict[n].shape) != tuple(p.shape):
                    raise RuntimeError(f"load_state_dict: '{n}' has shape "
                                       f"{list(state_dict[n].shape)}, the model's is "
                                       f"{list(p.shape)}")
        for pc in tensor_pieces(self):
            if pc.name in state_dict:
                flat = state_dict[pc.name].detach().reshape(-1)
                set_param_values(self, pc, flat[pc.start:pc.start + pc.hi - pc.lo].cpu())
        self.gather_updates()
        for n, b in buffers.items():
            if n in state_dict and b is not None:
                b.data.copy_(state_dict[n])
        if not names & set(missing):
            self._needs_load = False  # every parameter has its values (init="empty")
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def full_state(self, rank0_only=False):
        """{name: fp32 tensor} of every parameter, unsharded (one all-gather per unit, one unit
        at a time; every rank calls it). The values are those the forward computes with: with
        param_dtype bf16, the bf16 rounding of the fp32 masters. `rank0_only`: the other ranks
        keep nothing and get {}."""
        keep = not rank0_only or self.rank == 0
        out = {}
        for ui, (_, _, params) in enumerate(self._units):
            if ui in self._q:  # the exact fp32 values, not the last dequantized ones
                as_tensor(self.client.param_shard(ui)).copy_(self.masters[ui])
            was = ui in self._full
            self.client.unshard(ui).wait()
            self._bind(ui)
            for n, p in params if keep else ():
                out[n] = p.detach().float().cpu().clone()
            if not was:
                self._reshard(ui)
        return out
