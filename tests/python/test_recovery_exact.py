"""The control reductions recovery agrees with are exact at any scale (docs/recovery.md, "Exact
at any scale"): up to 65,536 ranks and step counts of 2^40 and more, with no cluster.

The ranks' fp32 sums are simulated as the data plane's reduce-scatter makes them: every rank's
row added in fp32, one after another in rank order (a ring) or pairwise (a tree), the ranks
vectorised as a leading dimension of the rows. Small worlds run each rank as a thread with its
own control object, through the recovery functions themselves, and once through ControlUnits
over a fake data plane whose reduce-scatter sums the ranks' gradient buffers in fp32."""
import os
import sys
import threading
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

from ragshard import Error, _pool  # noqa: E402
from ragshard.torch.fsdp.control import ControlUnits  # noqa: E402
from ragshard.torch.fsdp.exact import FP32_EXACT, ExactReductions, digit_bits  # noqa: E402
from ragshard.torch.recovery import recut  # noqa: E402
from ragshard.torch.recovery.journal import agree_on_committed, redundancy_step  # noqa: E402

BIG = 65536
STEPS = 1 << 40


def fp32_ring(rows):
    """Every rank's row added into an fp32 accumulator in rank order, as a ring does."""
    acc = torch.zeros(rows.shape[1:], dtype=torch.float32)
    for row in rows:
        acc += row
    return acc


def fp32_tree(rows):
    """Pairs of ranks' rows added in fp32, then pairs of those, as a tree does."""
    x = rows.to(torch.float32)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, torch.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


class Simulated(ExactReductions):
    """`world` ranks at once: each method's values carry the ranks as their first dimension
    (rank r's row r), and each round's rows are summed over them in fp32 by `add`."""

    def __init__(self, world, add=fp32_tree, block=64, gather=None):
        super().__init__(world, torch.arange(world), block)
        self.add, self.rounds, self._gather = add, 0, gather

    def _sum_rows(self, rows):
        assert rows.dtype == torch.float32 and rows.shape[0] == self._ex_world
        self.rounds += 1
        return self.add(rows)

    def _gather_is_cheaper(self, n, bits):
        return super()._gather_is_cheaper(n, bits) if self._gather is None else self._gather


def ranks(*runs):
    """The values of ranks 1, 2, ... for one call of OneOfMany: runs of (value, how many
    ranks), value None for ranks that give none, or a tuple where the call has several."""
    def row(v):
        return list(v) if isinstance(v, tuple) else [v]
    ints = torch.cat([torch.tensor([[x or 0 for x in row(v)]] * k, dtype=torch.int64)
                      for v, k in runs])
    present = torch.cat([torch.tensor([[x is not None for x in row(v)]] * k) for v, k in runs])
    return ints, present


class OneOfMany:
    """Rank 0's control in a simulated world whose other ranks give `others` (one `ranks(...)`
    per call), so that the recovery functions run as rank 0 of 65,536."""

    def __init__(self, sim, *others):
        self.sim, self.others = sim, list(others)

    def _batch(self, values):
        ints, present = self.others.pop(0)
        assert ints.shape == (self.sim._ex_world - 1, len(values))
        return (torch.cat([torch.tensor([[x or 0 for x in values]]), ints]),
                torch.cat([torch.tensor([[x is not None for x in values]]), present]))

    def extremes(self, values, bits=63):
        ints, present = self._batch(values)
        return self.sim.extremes(ints, bits, present=present)

    def sum_ints(self, values, bits=63):
        return self.sim.sum_ints(self._batch(values)[0], bits)


def test_the_digits_keep_every_sum_below_2_24():
    assert digit_bits(BIG) == 8 and 255 * BIG < FP32_EXACT
    for world in (1, 2, 3, 7, 255, 256, 4097, BIG - 1, BIG, BIG + 1, 1 << 20, FP32_EXACT):
        d = digit_bits(world)
        assert world * ((1 << d) - 1) <= FP32_EXACT, world
        assert d == 24 or world * ((1 << (d + 1)) - 1) > FP32_EXACT, world
    with pytest.raises(ValueError, match="2\\^24 ranks"):
        digit_bits(FP32_EXACT + 1)


@pytest.mark.parametrize("add", [fp32_tree, fp32_ring])
def test_sums_of_2_40_over_65536_ranks_are_exact(add):
    g = torch.Generator().manual_seed(1)
    values = torch.randint(STEPS - (1 << 20), STEPS + 1, (BIG, 2), generator=g)
    values[:5, 0] = STEPS  # (the largest step count asked for)
    exact = [sum(int(x) for x in values[:, j]) for j in range(2)]
    sim = Simulated(BIG, add)
    assert sim.sum_ints(values, bits=41) == exact
    assert sim.rounds == 1  # 2 values x 6 digits of 8 bits: one round
    # What the old agreement did, one fp32 per rank summed in fp32: wrong here.
    naive = add(values.to(torch.float32))
    assert [int(x) for x in naive.double()] != exact
    assert float(torch.tensor(STEPS + 1, dtype=torch.float32)) == STEPS  # (a rank's own value)


def test_counts_of_every_rank_are_exact():
    sim = Simulated(BIG, fp32_ring)
    assert sim.sum_ints(torch.ones(BIG, 3, dtype=torch.int64), bits=1) == [BIG] * 3


def test_extremes_of_2_40_over_65536_ranks_are_exact():
    values = torch.full((BIG, 2), STEPS, dtype=torch.int64)
    values[1234, 0] = STEPS - 1
    values[BIG - 2, 1] = STEPS + 1
    present = torch.ones(BIG, 2, dtype=torch.bool)
    present[::3, 1] = False
    got = Simulated(BIG).extremes(values, present=present)
    assert got == [(BIG, STEPS - 1, STEPS), (BIG - len(range(0, BIG, 3)), STEPS, STEPS + 1)]
    # An fp32 key cannot tell these steps apart (the float extremes of grads.py).
    assert torch.tensor([STEPS - 1, STEPS, STEPS + 1], dtype=torch.float32).unique().numel() == 1


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("gather", [True, False])
def test_both_ways_to_the_extremes_agree_with_python(world, gather):
    g = torch.Generator().manual_seed(world)
    values = torch.randint(0, 1 << 62, (world, 4), generator=g)
    values[:, 1] = values[0, 1]  # every rank the same
    values[:, 2] = (1 << 63) - 1  # the largest an int64 holds
    present = torch.rand(world, 4, generator=g) > 0.3
    present[:, 3] = False  # nobody
    present[0, :3] = True
    sim = Simulated(world, gather=gather, block=7)
    want = []
    for j in range(4):
        got = [int(x) for x in values[present[:, j], j]]
        want.append((len(got), min(got), max(got)) if got else (0, None, None))
    assert sim.extremes(values, present=present) == want
    assert sim.sum_ints(values[:, :2], bits=62) == \
        [sum(int(x) for x in values[:, j]) for j in range(2)]


def test_agreement_at_65536_ranks_and_2_40_steps():
    """agree_on_committed as rank 0 of 65,536 with the others' steps scripted: the old fp32
    sums refused here (committed x world >= 2^24)."""
    control = OneOfMany(Simulated(BIG), ranks((STEPS + 1, BIG - 2), (STEPS, 1)))
    assert agree_on_committed(control, STEPS + 1) == STEPS
    # A replacement node's ranks give no step.
    control = OneOfMany(Simulated(BIG), ranks((None, 100), (STEPS + 1, BIG - 101)))
    assert agree_on_committed(control, 0, have=False) == STEPS + 1
    # Two apart: named with the exact least and greatest.
    control = OneOfMany(Simulated(BIG), ranks((STEPS, BIG - 2), (STEPS + 2, 1)))
    with pytest.raises(RuntimeError, match=f"the least {STEPS} and the greatest {STEPS + 2} "
                                           f"over {BIG} ranks"):
        agree_on_committed(control, STEPS)
    control = OneOfMany(Simulated(BIG), ranks((None, BIG - 1)))
    with pytest.raises(RuntimeError, match="no rank kept its state"):
        agree_on_committed(control, 0, have=False)


def test_the_roll_forward_is_counted_exactly_at_65536_ranks():
    journal = types.SimpleNamespace(meta=torch.zeros(_pool.JOURNAL_META_FIELDS,
                                                     dtype=torch.int64))
    journal.meta[_pool.COMMITTED], journal.meta[_pool.BEGUN] = STEPS, STEPS + 1
    client = types.SimpleNamespace(stats=lambda: {"parity_steps": [STEPS, STEPS + 1]})
    # Each rank's (a node lost, cannot roll forward, lacks the parity of STEPS).
    control = OneOfMany(Simulated(BIG), ranks(((0, 0, 0), BIG - 1)))
    assert redundancy_step(client, control, journal, STEPS) == (STEPS + 1, False)
    control = OneOfMany(Simulated(BIG), ranks(((0, 0, 0), BIG - 2), ((0, 1, 0), 1)))
    assert redundancy_step(client, control, journal, STEPS) == (STEPS, False)
    # One rank's node holds neither parity: back one step more where a node was lost (the
    # replacement's rank says so), else the state is whole and protected again.
    control = OneOfMany(Simulated(BIG), ranks(((0, 0, 0), BIG - 3), ((0, 1, 1), 1),
                                              ((1, 0, 0), 1)))
    assert redundancy_step(client, control, journal, STEPS) == (STEPS - 1, False)
    control = OneOfMany(Simulated(BIG), ranks(((0, 0, 0), BIG - 2), ((0, 1, 1), 1)))
    assert redundancy_step(client, control, journal, STEPS) == (STEPS, True)


class _Exchange:
    """The threads' data plane: each round, every rank's row; `sum` adds them all in fp32 in
    rank order."""

    def __init__(self, world):
        self.rows, self.barrier = [None] * world, threading.Barrier(world, timeout=30)

    def all_rows(self, rank, rows):
        self.rows[rank] = rows.to(torch.float32).clone()
        self.barrier.wait()
        shapes = {r.shape for r in self.rows}
        out = torch.stack(self.rows) if len(shapes) == 1 else None
        self.barrier.wait()
        if out is None:
            raise AssertionError(f"the ranks summed rows of different shapes: {shapes}")
        return out

    def sum(self, rank, rows):
        return fp32_ring(self.all_rows(rank, rows))


class RankControl(ExactReductions):
    def __init__(self, exchange, world, rank, block):
        super().__init__(world, rank, block)
        self._exchange = exchange

    def _sum_rows(self, rows):
        return self._exchange.sum(self._ex_rank, rows)


def each_rank(world, body, block=5, exchange=None):
    """body(rank, control) on `world` threads, over `exchange` (default a new one); [its result
    or its exception] by rank."""
    exchange, out = exchange or _Exchange(world), [None] * world

    def run(r):  # (a rank that leaves a collective early breaks the others' barrier: 30 s)
        try:
            out[r] = body(r, RankControl(exchange, world, r, block))
        except BaseException as e:  # noqa: BLE001 - compared by the test
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_ranks_as_threads_agree_on_the_committed_step():
    steps = [STEPS + 1, STEPS, STEPS + 1, STEPS + 1, STEPS]
    assert each_rank(5, lambda r, c: agree_on_committed(c, steps[r])) == [STEPS] * 5
    steps[3] = STEPS + 2
    got = each_rank(5, lambda r, c: agree_on_committed(c, steps[r]))
    assert all(isinstance(e, RuntimeError) and "differ by more than one" in str(e) for e in got)
    have = [False, True, False]
    assert each_rank(3, lambda r, c: agree_on_committed(c, 7 if have[r] else 0, have[r])) == \
        [7] * 3


def _old(lost, survivors):
    return types.SimpleNamespace(world_size=len(lost) + len(survivors), job="j", rank=0)


def test_copies_are_counted_per_lost_rank():
    """Each lost rank's copy on exactly one survivor. The old check compared the count and the
    sums of r and r^2 with the lost ranks': copies of ranks 1, 5, 6 twice each pass it in place
    of 1, 2, 3, 5, 6, 7 (1+5+6 = 2+3+7 and 1+25+36 = 4+9+49); the counts per rank do not."""
    survivors = [0, 4, 8, 9, 10, 11]
    lost = [1, 2, 3, 5, 6, 7]
    old = _old(lost, survivors)

    def check(held):
        return each_rank(6, lambda r, c: recut._check_copies(
            c, old, None if held[r] is None else (held[r], {}), survivors))
    assert check(lost) == [None] * 6
    bad = [1, 5, 6, 1, 5, 6]
    assert (len(bad), sum(bad), sum(x * x for x in bad)) == \
        (len(lost), sum(lost), sum(x * x for x in lost))
    got = check(bad)
    assert all(isinstance(e, Error) and "hold whole copies of 3 of them (ranks [1, 5, 6] more "
               "than once)" in str(e) for e in got), got
    got = check([1, 2, 3, 5, 6, None])
    assert all(isinstance(e, Error) and "copies of 5 of them" in str(e) for e in got), got


def test_a_failure_is_counted_on_every_rank():
    problems = [None, Error("INTERNAL: mine"), None, Error("INTERNAL: mine too")]
    old = types.SimpleNamespace(job="j")
    got = each_rank(4, lambda r, c: recut._all_ok(c, old, problems[r]))
    assert str(got[1]) == "INTERNAL: mine" and str(got[3]) == "INTERNAL: mine too"
    assert "2 survivor(s) of job 'j' could not re-cut" in str(got[0]) and \
        "2 survivor(s)" in str(got[2])
    assert each_rank(4, lambda r, c: recut._all_ok(c, old, None)) == [None] * 4


class _Pool:
    def __init__(self, held):
        self.held = held

    def tensor(self, name, numel, dtype):
        return torch.tensor(self.held[name], dtype=dtype), True


def test_step_counts_of_2_40_are_agreed_exactly():
    name = "opt/adamw" + recut._STEPS
    other = "opt/muon" + recut._STEPS

    def counts(per_rank):
        def body(r, c):
            held = per_rank[r]
            return recut._step_counts(c, types.SimpleNamespace(job="j", rank=r),
                                      _Pool(held), {n: len(v) for n, v in held.items()},
                                      None, 0, {name, other})
        return each_rank(len(per_rank), body)
    same = [{name: [float(STEPS + 1)] * 2, other: [3.0]}, {name: [float(STEPS + 1)]},
            {name: [0.0], other: [3.0]}]  # rank 2: its piece never stepped; no vote
    assert counts(same) == [{"opt/adamw": float(STEPS + 1), "opt/muon": 3.0}] * 3
    # One step apart at 2^40: fp32 would see one number; the counts differ.
    assert float(torch.tensor(STEPS, dtype=torch.float32)) == \
        float(torch.tensor(STEPS + 1, dtype=torch.float32))
    apart = [{name: [float(STEPS + 1)]}, {name: [float(STEPS)]}, {name: [float(STEPS + 1)]}]
    got = counts(apart)
    assert all(isinstance(e, Error) and f"from {STEPS} to {STEPS + 1}" in str(e)
               for e in got), got
    mixed = [{name: [float(STEPS), 5.0]}, {name: [5.0]}, {}]  # rank 0's own pieces differ
    assert all(isinstance(e, Error) and "stepped different numbers" in str(e)
               for e in counts(mixed))


class _DataPlane:
    """A fake client for ControlUnits over `world` threads in groups of `group` ranks (HSDP's
    shard groups, `world` / `group` replicas of each): each rank's gradient buffer of the flags
    unit (`group` x `per` fp32) is reduce-scattered over its group, the ranks' buffers summed in
    fp32, and the shards all-reduced over the replicas, as the daemons do."""

    def __init__(self, world, group, per):
        self.world, self.group, self.per = world, group, per
        self.exchange = _Exchange(world)
        self.grads = [torch.zeros(group * per).numpy() for _ in range(world)]
        self.shards = [torch.zeros(per).numpy() for _ in range(world)]

    def client(self, rank):
        plane, done = self, types.SimpleNamespace(wait=lambda *a: None)
        group, pos = rank // plane.group, rank % plane.group
        members = [q for q in range(plane.world) if q // plane.group == group]
        replicas = [q for q in range(plane.world) if q % plane.group == pos]

        def reduce_scatter(unit, op):
            assert op == "sum"
            rows = plane.exchange.all_rows(rank, torch.from_numpy(plane.grads[rank]))
            total = fp32_ring(rows[members])
            plane.shards[rank][:] = total[pos * plane.per:(pos + 1) * plane.per].numpy()
            return done

        def all_reduce(unit, op):
            assert op == "sum"
            rows = plane.exchange.all_rows(rank, torch.from_numpy(plane.shards[rank]))
            plane.shards[rank][:] = fp32_ring(rows[replicas]).numpy()
            return done
        return types.SimpleNamespace(allocate_grad=lambda u: done,
                                     grad=lambda u: plane.grads[rank],
                                     grad_shard=lambda u: plane.shards[rank],
                                     reduce_scatter=reduce_scatter, all_reduce=all_reduce)


@pytest.mark.parametrize("world,group", [(3, 3), (4, 2)])
def test_control_units_reduce_exactly_over_their_flags_unit(world, group):
    """ControlUnits' own rounds: 2 elements per rank and round (the flags unit's shard), so
    each reduction takes many rounds; plain FSDP over 3 ranks, and HSDP's 2 replicas of 2 (the
    plan's world is the shard group's 2: the sums cover all 4 ranks)."""
    per = 2
    plane = _DataPlane(world, group, per)
    steps = [STEPS + 1, STEPS, STEPS + 1, STEPS][:world]

    def body(r, _):
        layout = types.SimpleNamespace(replicas=world // group, rank=r, world=group,
                                       group_sizes=(group, group, group),
                                       grad_elems={0: 1, 1: per})
        control = ControlUnits(plane.client(r), layout, 0, 2)
        return (agree_on_committed(control, steps[r]),
                control.sum_ints([steps[r], 1, r], bits=41),
                control.extremes([None if r == 1 else STEPS * r + r], bits=63),
                control.all_reduce_extreme(float(r), high=True))
    got = each_rank(world, body, exchange=plane.exchange)
    want = (STEPS, [sum(steps), world, sum(range(world))],
            [(world - 1, 0, STEPS * (world - 1) + world - 1)], float(world - 1))
    assert got == [want] * world, got
