"""The two small units fully_shard registers after the module's own, and what runs through
them: sums of one float per rank, sums of short vectors and the largest (or smallest) value over
the ranks (the gradient norms of grads.py), the used-parameter flags that decide which
parameters have a gradient, and exact sums and extremes of integers (exact.py: the counts
recovery agrees on)."""
import math

import torch

from .exact import ExactReductions
from .grads import float_key, key_float

from .views import as_tensor

SCALARS = "__ragshard_scalars__"
USED = "__ragshard_used__"


def control_inventory(world, nparams):
    """The inventory entries of the two units: W fp32 elements for scalar all-reductions, and
    W x P for the used-parameter flags of P parameters (each rank's shard of the sum is the
    count of ranks that used each parameter). `world`: W, or None where unknown (1)."""
    world = world or 1
    return [{"name": SCALARS, "tensors": [
                {"name": f"{SCALARS}.norm", "shape": [world], "dtype": "fp32"}]},
            {"name": USED, "tensors": [
                {"name": f"{USED}.flags", "shape": [world * max(nparams, 1)],
                 "dtype": "fp32"}]}]


class ControlUnits(ExactReductions):
    """Sums over ranks through the two units, which the plan puts right after the module's
    units (`first`: the scalar unit's index). `client`: the attached ragshard.Client;
    `layout`: the ShardLayout; `nparams`: the module's parameters. Every rank calls each method
    in the same order (they are collectives). Raises ValueError where the flags unit is too
    small (registered without the world size). The exact integer reductions (`sum_ints`,
    `extremes`: exact.py) run through the flags unit, its per-rank length per round."""

    def __init__(self, client, layout, first, nparams):
        self._client, self._replicas = client, layout.replicas
        # Every rank of the job takes part in the sums: the gradients' group |g| times its
        # replicas (HSDP's; AMSP's W / |g|), not the plan's world (|p|).
        self._rank, self._world = layout.rank, layout.group_sizes[1] * layout.replicas
        self._scalar, self._flags, self._nparams = first, first + 1, nparams
        self._flag_elems = layout.grad_elems[self._flags]
        if self._flag_elems < nparams:
            raise ValueError("fully_shard: the world size is needed before registering (pass "
                             "world=, or set RAGSHARD_WORLD_SIZE)")
        super().__init__(self._world, self._rank, self._flag_elems)

    def _sum(self, unit, write):
        """The reduced gradient shard of `unit` after `write`(this rank's gradient buffer):
        its sum over every rank (replicas included)."""
        self._client.allocate_grad(unit).wait()
        write(as_tensor(self._client.grad(unit)))
        self._client.reduce_scatter(unit, "sum").wait()
        if self._replicas > 1:
            self._client.all_reduce(unit, "sum").wait()
        return as_tensor(self._client.grad_shard(unit))

    def all_reduce_scalar(self, value):
        """The sum over ranks of one float per rank (every element of this rank's gradient
        holds `value`, so every element of the reduced shard holds the sum)."""
        return float(self._sum(self._scalar, lambda g: g.fill_(float(value)))[0])

    def all_reduce_sum(self, values):
        """The sum over ranks of each of `values` (floats; every rank passes as many), in fp32:
        through the flags unit, whose reduced shard is a vector of its per-rank length (several
        rounds for a longer list)."""
        return self._sum_rows(torch.tensor(list(values), dtype=torch.float32)).tolist()

    def _sum_rows(self, rows):
        """The fp32 sum over ranks of each element of `rows` (a 1-D tensor; every rank passes
        as many): one round of the flags unit per `_flag_elems` elements (one for none)."""
        out = []
        for at in range(0, max(rows.numel(), 1), self._flag_elems):
            chunk = rows[at:at + self._flag_elems]

            def write(g, chunk=chunk):
                g.view(-1, self._flag_elems)[:, :len(chunk)] = chunk
            out.append(self._sum(self._flags, write)[:len(chunk)].clone())
        return torch.cat(out)

    def all_reduce_extreme(self, value, high=True):
        """The largest (`high`) or smallest of one float per rank over every rank, exactly:
        `value` ≥ 0 (or +inf, or NaN), None where this rank has none to give. None where no
        rank gave one; NaN where any gave NaN. Where twice the world fits in the flags unit's
        per-rank length, one round (a gather done as a sum); else a radix search over the
        values' bits, a few bits per round (at most 32 rounds, 4 with 255 or more elements)."""
        w = self._world
        if 2 * w <= self._flag_elems:
            # One round: rank r writes its value at slot r and 1 at slot w + r (zeros elsewhere,
            # so each slot's sum is that rank's).
            mine = [0.0] * (2 * w)
            if value is not None:
                mine[self._rank], mine[w + self._rank] = value, 1.0
            sums = self.all_reduce_sum(mine)
            got = [v for v, present in zip(sums[:w], sums[w:]) if present > 0]
            if not got:
                return None
            if any(math.isnan(v) for v in got):
                return math.nan
            return max(got) if high else min(got)
        flags = self.all_reduce_sum([1.0 if value is not None else 0.0,
                                     1.0 if value is not None and math.isnan(value) else 0.0])
        if flags[0] == 0:
            return None
        if flags[1] > 0:
            return math.nan
        key = float_key(value, high) if value is not None else None
        bits = min(8, int(math.log2(self._flag_elems + 1)))
        prefix, known = 0, 0
        while known < 32:
            step = min(bits, 32 - known)
            shift = 32 - known - step
            digits = [0.0] * ((1 << step) - 1)
            if key is not None and key >> (shift + step) == prefix:
                d = (key >> shift) & ((1 << step) - 1)
                if d:
                    digits[d - 1] = 1.0
            counts = self.all_reduce_sum(digits)
            found = [i + 1 for i, c in enumerate(counts) if c > 0]
            prefix = (prefix << step) | (max(found) if found else 0)
            known += step
        return key_float(prefix, high)

    def ranks_using(self, used):
        """For each parameter, the number of ranks whose set `used` holds its index: each rank
        writes 1.0 for its used parameters into every rank's slot of the flags unit."""
        def write(g):
            slots = g.view(-1, self._flag_elems)
            if used:
                slots[:, list(used)] = 1.0
        return self._sum(self._flags, write)[:self._nparams]


class GradUse:
    """Which parameters have a gradient, PyTorch's `.grad is not None`, the same on every rank
    (DDP's rule for unused parameters): a parameter has one once any rank's backward reached
    it, until zero_grad(set_to_none=True).

    Attributes: `has_grad`, by parameter index (unit order), which the optimizers read; `used`,
    the indices this rank's backward reached since the last reduction."""

    def __init__(self, control, nparams):
        self._control, self._nparams = control, nparams
        self.forget()

    def forget(self):
        self.has_grad = [False] * self._nparams
        self.used = set()

    def mark(self, index):
        self.used.add(index)

    def reduce(self):
        """Every rank learns which parameters any rank's backward reached since the last
        reduction (a collective)."""
        counts = self._control.ranks_using(self.used)
        for i in torch.nonzero(counts > 0).flatten().tolist():
            self.has_grad[i] = True
        self.used = set()
