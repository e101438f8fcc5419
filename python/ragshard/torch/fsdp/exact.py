"""Exact reductions of integers over the ranks, made of fp32 sums (docs/recovery.md, "Exact at
any scale").

The control units (control.py) sum fp32 values over every rank with a reduce-scatter (and an
all-reduce over HSDP's replicas), in whatever order the data plane adds them. Such a sum is
exact where every partial sum is an integer of at most 2^24: fp32 holds every integer up to
2^24, and no partial sum of non-negative terms exceeds the total. So each integer is cut into
digits small enough that a digit's sum over every rank stays within 2^24 (8 bits at 65,536
ranks: 255 x 65,536 < 2^24), the digits are summed, and the carries are done afterwards in
Python's integers. Counts (how many ranks hold a digit) are exact the same way, up to 2^24
ranks, and the least and greatest values come from them by a radix search over the values'
bits, or, where that takes more rounds, from a gather of every rank's value in 24-bit limbs
(each element then has one writer).

`ExactReductions` holds the arithmetic; what sums the fp32 rows is given by a subclass
(`_sum_rows`): ControlUnits over the data plane, the tests a simulation of many ranks at once,
whose rows then carry a leading dimension over the ranks (every method here works row by row).
"""
import torch

FP32_EXACT = 1 << 24  # every integer of magnitude up to 2^24 is an fp32 value
MAX_BITS = 63  # the values are int64 tensors' non-negative values
_LIMB = 24  # a gathered element has one writer: any digit below 2^24


def digit_bits(world):
    """The widest digit d whose sum over `world` ranks is exact in fp32, in any order:
    world x (2^d - 1) <= 2^24 (8 at 65,536 ranks, 24 at one). ValueError past 2^24 ranks."""
    if not 1 <= int(world) <= FP32_EXACT:
        raise ValueError(f"exact sums over {world} ranks: 1 to 2^24 ranks are summed exactly")
    return min((FP32_EXACT // int(world) + 1).bit_length() - 1, _LIMB)


def _ints(values, bits):
    """`values` (a list of ints, or an int64 tensor whose last dimension is the list) as an
    int64 tensor, each checked to be in [0, 2^bits)."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits: {bits} is not in [1, {MAX_BITS}]")
    v = values if torch.is_tensor(values) else torch.tensor(list(values), dtype=torch.int64)
    v = v.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >> bits):
        raise ValueError(f"exact reductions take integers in [0, 2^{bits}); got "
                         f"[{int(v.min())}, {int(v.max())}]")
    return v


def _whole(sums, most, what):
    """`sums` (fp32) as Python ints, each checked to be a whole number in [0, `most`]: anything
    else is a transport that did not sum every rank's rows exactly once."""
    out = sums.double().tolist()
    for x in out:
        if not (0.0 <= x <= most and x == int(x)):
            raise RuntimeError(f"ragshard: an exact reduction ({what}) got the sum {x!r}, "
                               f"not a whole number in [0, {most}]")
    return [int(x) for x in out]


class ExactReductions:
    """Exact sums and extremes of non-negative integers over `world` ranks; this rank is `rank`
    (an int, or in a simulation a LongTensor of the ranks its rows stand for). `block`: the
    elements one round of `_sum_rows` carries (more are more rounds), which decides how the
    extremes are found. Every rank calls each method in the same order with as many values
    and the same `bits` (they are collectives)."""

    def __init__(self, world, rank, block):
        self._ex_world, self._ex_rank, self._ex_block = int(world), rank, max(int(block), 1)

    def _sum_rows(self, rows):
        """The sum over every rank of its fp32 `rows` (last dimension: the elements; a
        simulation gives every rank's at once, the ranks first): an fp32 tensor of the
        elements. A collective."""
        raise NotImplementedError

    def _rounds(self, elements):
        return -(-max(elements, 1) // self._ex_block)

    def sum_ints(self, values, bits=MAX_BITS):
        """The exact sum over every rank of each of `values` (integers in [0, 2^bits)), as
        Python ints: each value cut into digits of digit_bits(world) bits, the digits summed in
        fp32 (exact), the carries done here."""
        v = _ints(values, bits)
        n = v.shape[-1]
        d = digit_bits(self._ex_world)
        k = -(-bits // d)
        shifts = torch.arange(k, dtype=torch.int64) * d
        digits = (v.unsqueeze(-1) >> shifts) & ((1 << d) - 1)
        sums = self._sum_rows(digits.reshape(*v.shape[:-1], n * k).to(torch.float32))
        got = _whole(sums[:n * k], self._ex_world * ((1 << d) - 1), "digit sums")
        return [sum(got[j * k + i] << (d * i) for i in range(k)) for j in range(n)]

    def extremes(self, values, bits=MAX_BITS, present=None):
        """For each of `values` (integers in [0, 2^bits), or None where this rank has none to
        give), over the ranks that gave one: (how many did, the least, the greatest), exactly;
        (0, None, None) where none did. A tensor of values takes its `present` flags (bool, the
        same shape; default all). A gather where that takes fewer rounds, else a radix search
        over the bits (both ends at once)."""
        if not torch.is_tensor(values):
            values = list(values)
            present = torch.tensor([x is not None for x in values], dtype=torch.bool)
            values = [0 if x is None else int(x) for x in values]
        v = _ints(values, bits)
        present = torch.ones_like(v, dtype=torch.bool) if present is None else \
            present.to(torch.bool).expand_as(v)
        v = torch.where(present, v, torch.zeros_like(v))
        n = v.shape[-1]
        if self._gather_is_cheaper(n, bits):
            return self._gather_extremes(v, present, bits)
        return self._search_extremes(v, present, bits)

    def _search_bits(self, n, bits):
        """(rounds of _sum_rows, the bits per search round) of the cheapest radix search."""
        best = None
        for d in range(1, 9):
            per = 2 * n * ((1 << d) - 1)
            rounds = -(-bits // d)
            cost = self._rounds(n + per) + (rounds - 1) * self._rounds(per)
            if best is None or cost < best[0]:
                best = (cost, d)
        return best

    def _gather_is_cheaper(self, n, bits):
        gather = self._rounds(self._ex_world * n * (1 + -(-bits // _LIMB)))
        return gather <= self._search_bits(n, bits)[0]

    def _gather_extremes(self, v, present, bits):
        """Every rank writes its presence and its values' 24-bit limbs at its own slot (zeros
        elsewhere): each element's sum is its one writer's value."""
        w, n, limbs = self._ex_world, v.shape[-1], -(-bits // _LIMB)
        shifts = torch.arange(limbs, dtype=torch.int64) * _LIMB
        mine = torch.cat([present.unsqueeze(-1).to(torch.int64),
                          (v.unsqueeze(-1) >> shifts) & ((1 << _LIMB) - 1)], -1)
        mine = mine.reshape(*v.shape[:-1], 1, n * (1 + limbs))
        slot = torch.nn.functional.one_hot(torch.as_tensor(self._ex_rank), w)
        rows = (slot.unsqueeze(-1) * mine).reshape(*v.shape[:-1], w * n * (1 + limbs))
        got = _whole(self._sum_rows(rows.to(torch.float32))[:w * n * (1 + limbs)],
                     (1 << _LIMB) - 1, "gathered values")
        out = []
        for j in range(n):
            seen = []
            for r in range(w):
                at = (r * n + j) * (1 + limbs)
                if got[at] > 1:
                    raise RuntimeError(f"ragshard: an exact reduction's slot of rank {r} was "
                                       f"written {got[at]} times")
                if got[at]:
                    seen.append(sum(got[at + 1 + i] << (_LIMB * i) for i in range(limbs)))
            out.append((len(seen), min(seen), max(seen)) if seen else (0, None, None))
        return out

    def _search_extremes(self, v, present, bits):
        """A radix search for each value's greatest (keys v) and least (keys 2^bits - 1 - v),
        `d` bits per round: where its key's known high bits are the greatest so far, a rank
        counts its next digit (one of 2^d - 1 elements; digit 0 needs none), and the greatest
        digit counted extends the prefix. Counts are at most the world: exact. The first round
        also counts the ranks that gave a value."""
        n = v.shape[-1]
        _, d = self._search_bits(n, bits)
        top = (1 << bits) - 1
        keys = torch.cat([v, top - v], -1)
        live = torch.cat([present, present], -1)
        prefix = torch.zeros(2 * n, dtype=torch.int64)
        count, known = None, 0
        while known < bits:
            step = min(d, bits - known)
            shift = bits - known - step
            match = live & ((keys >> (shift + step)) == prefix)
            digit = (keys >> shift) & ((1 << step) - 1)
            which = torch.arange(1, 1 << step, dtype=torch.int64)
            hot = (digit.unsqueeze(-1) == which) & match.unsqueeze(-1)
            rows = hot.reshape(*keys.shape[:-1], 2 * n * ((1 << step) - 1)).to(torch.float32)
            if count is None:
                rows = torch.cat([present.to(torch.float32), rows], -1)
            sums = self._sum_rows(rows)[:rows.shape[-1]]
            if count is None:
                count, sums = _whole(sums[:n], self._ex_world, "counts"), sums[n:]
            seen = torch.tensor(_whole(sums, self._ex_world, "digit counts"))
            seen = seen.view(2 * n, (1 << step) - 1) > 0
            best = torch.where(seen, which, torch.zeros_like(which)).amax(-1)
            prefix = (prefix << step) | best
            known += step
        p = prefix.tolist()
        return [(count[j], top - p[n + j], p[j]) if count[j] else (0, None, None)
                for j in range(n)]
