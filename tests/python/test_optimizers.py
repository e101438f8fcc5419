"""Every ragshard optimizer is a torch.optim.Optimizer with param groups and LR schedulers.

tests/python/optimizer_ranks.py runs each case (torch's AdamW, Adam, SGD with Nesterov momentum,
RMSprop, Adagrad, Adamax, NAdam, RAdam, ASGD and Rprop through ShardedOptimizer, and
ShardedMuon, ShardedShampoo and ShardedAdam8bit) at 2 daemons x 2 ranks, each with two param
groups of different lr (and weight_decay, where the optimizer has one) and a scheduler
(LambdaLR, CosineAnnealingLR, OneCycleLR with cycle_momentum, LinearLR and SequentialLR, each
at least twice), against the same optimizer in one process on the same micro-batch as every
rank's (so that the averaged gradient is bit for bit the one-process one, and the comparison is
of the optimizers: optimizer_ranks.data): every step's loss within 1e-5 (relative, above a loss of 1) and each final parameter
within 1e-5 in norm (|delta| / |p|, as tests/python/test_training.py checks), and every group's
lr equal to torch's at every step. The other tests check the groups, the options and the state dicts in
one process (a job of one rank)."""
import json
import os
import subprocess
import sys

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optimizer_ranks  # noqa: E402
import ragshard  # noqa: E402
import ragshard.torch as rt  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402
from test_training import LAUNCH, env  # noqa: E402

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optimizer_ranks.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        yield c


def test_every_optimizer_matches_one_process(cluster, tmp_path):
    cases = optimizer_ranks.CASES
    for i in range(1, len(cases)):
        ragshard.create_job(cluster.planner, f"optim-{i}", 4)
    out, ref = str(tmp_path / "sharded"), str(tmp_path / "reference")
    r = preloaded.run(LAUNCH + ["--planner", cluster.planner, "--job", "optim-0", "--nproc", "4",
                                 "--sockets", ",".join(cluster.sockets), "--create-job", RANKS,
                                 "--jobs", "optim", "--out", out],
                       env=env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    r = preloaded.run([sys.executable, RANKS, "--reference", "--out", ref],
                       env=env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = (json.load(open(os.path.join(d, "results.json"))) for d in (out, ref))
    params = [torch.load(os.path.join(d, "params.pt")) for d in (out, ref)]
    used, worst = {}, {}
    for case, sched, _, _ in cases:
        used[sched] = used.get(sched, 0) + 1
        a, b = got[case], want[case]
        assert a["lrs"] == b["lrs"], f"{case}: group lrs {a['lrs']} vs torch's {b['lrs']}"
        for step, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            assert abs(x - y) <= TOL * max(1.0, abs(y)), \
                f"{case} ({sched}) step {step + 1}: loss {x} vs one process {y}"
        assert a["losses"][-1] < a["losses"][0], f"{case}: does not learn {a['losses']}"
        for name, p in params[1][case].items():
            # As tests/python/test_training.py: |delta| / |p| of each tensor (Frobenius).
            rel = float((params[0][case][name] - p).norm() / p.norm().clamp_min(1e-12))
            assert rel <= TOL, f"{case}: parameter {name}: |delta|/|p| = {rel:.3g}"
            worst[case] = max(worst.get(case, 0.0), rel)
    print("largest |delta|/|p| of a parameter:", json.dumps(worst))
    assert set(used) == {"lambda", "cosine", "onecycle", "linear", "sequential"}
    assert min(used.values()) >= 2, used


# -- in one process: a job of one rank ------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def one_rank(cluster):
    made = []

    def make(name):
        ragshard.create_job(cluster.planner, name, 1)
        client = ragshard.Client(cluster.planner, cluster.sockets[0], name, 0, cluster.nodes[0],
                                 30000)
        fsdp = rt.fully_shard(Net(), client, units=lambda m: list(m.layers), world=1)
        made.append(fsdp)
        return fsdp
    yield make


def step(fsdp, opt, n=1):
    for _ in range(n):
        fsdp(torch.ones(2, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def test_groups_are_checked_by_name(one_rank):
    fsdp = one_rank("groups-bad")
    named = dict(fsdp.named_parameters())
    assert "layers.0.0.weight" in named  # the module's own names, no wrapper prefix
    with pytest.raises(ValueError, match="not the sharded module's"):
        rt.ShardedAdamW(fsdp, [torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="'layers.0.0.weight' is in param group 0 and again in "
                                         "param group 1"):
        rt.ShardedAdamW(fsdp, [{"params": [named["layers.0.0.weight"]]},
                               {"params": [named["layers.0.0.weight"]]}])
    with pytest.raises(ValueError, match="unknown option 'momentum'"):
        rt.ShardedAdamW(fsdp, [{"params": list(named.values()), "momentum": 0.9}])
    with pytest.raises(ValueError, match="torch.optim.AdamW has no option 'momentum'"):
        rt.ShardedOptimizer(fsdp, torch.optim.AdamW, momentum=0.9)
    with pytest.raises(ValueError, match="LBFGS is not an elementwise optimizer"):
        rt.ShardedOptimizer(fsdp, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="Adafactor is not an elementwise optimizer"):
        rt.ShardedOptimizer(fsdp, torch.optim.Adafactor)
    with pytest.raises(ValueError, match="RMSprop has no option 'fused'"):
        rt.ShardedOptimizer(fsdp, torch.optim.RMSprop, fused=True)
    opt = rt.ShardedOptimizer(fsdp, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="step\\(closure\\) is not supported"):
        opt.step(lambda: 0.0)


def test_options_and_state_round_trip(one_rank):
    """A group option changed by hand takes effect at the next step; the state lives in the
    module's tensors; state_dict/load_state_dict round-trip in torch's layout, with a
    scheduler's."""
    fsdp = one_rank("groups-state")
    decay = [p for p in fsdp.parameters() if p.ndim >= 2]
    rest = [p for p in fsdp.parameters() if p.ndim < 2]

    def make():
        opt = rt.ShardedOptimizer(fsdp, torch.optim.AdamW, [
            {"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-2, fused=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))
    opt, sched = make()
    assert isinstance(opt, torch.optim.Optimizer)
    step(fsdp, opt)
    sched.step()
    # The moments are views of the module's state tensors.
    homes = {t.untyped_storage().data_ptr() for t in fsdp.optimizer_state_tensors()}
    st = opt.state_dict()
    assert set(st) == {"state", "param_groups"}
    assert [g["params"] for g in st["param_groups"]] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert st["param_groups"][0]["weight_decay"] == 0.1 and st["param_groups"][0]["lr"] == 5e-3
    assert set(st["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["state"][0]["exp_avg"].numel() == 64 and float(st["state"][0]["step"]) == 1.0
    for piece in opt.opt.state.values():
        assert piece["exp_avg"].untyped_storage().data_ptr() in homes
    saved = {"opt": opt.state_dict(), "sched": sched.state_dict(), "params": fsdp.state_dict()}
    # Two more steps, with lr set by hand on one group: it applies at once.
    opt.param_groups[1]["lr"] = 0.0
    before = {n: p.clone() for n, p in fsdp.state_dict().items()}
    step(fsdp, opt)
    after = fsdp.state_dict()
    assert torch.equal(before["layers.0.1.weight"], after["layers.0.1.weight"])  # lr 0
    assert not torch.equal(before["layers.0.0.weight"], after["layers.0.0.weight"])
    step(fsdp, opt)
    sched.step()
    expect = fsdp.state_dict()
    # Back to the saved point in a new optimizer and scheduler: the same two steps again.
    fsdp.load_state_dict(saved["params"])
    opt, sched = make()
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    assert opt.param_groups[0]["lr"] == 5e-3
    opt.param_groups[1]["lr"] = 0.0
    step(fsdp, opt, 2)
    for n, p in fsdp.state_dict().items():
        assert torch.equal(p, expect[n]), n
    bad = opt.state_dict()
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'exp_avg' of parameter 'layers.0.0.weight' has 3 "
                                         "elements, this rank holds 64"):
        opt.load_state_dict(bad)


def test_torchs_clip_grad_norm_clips_a_sharded_module(one_rank):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c), an FSDP2 script's line, is torch's
    own function (ragshard replaces nothing): the parameters' .grad are ShardGrads, on which it
    computes the global norm of the shards and scales them; a subset is clipped by its own norm,
    and plain parameters beside them count whole, as in torch."""
    import ragshard.torch.fsdp.grads as grads
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"
    fsdp = one_rank("clip")
    fsdp(torch.ones(2, 8)).pow(2).sum().backward()
    assert all(isinstance(p.grad, grads.ShardGrad) for p in fsdp.parameters())
    # A subset: its own norm, and only its gradient scaled.
    first, *others = fsdp.parameters()
    own = float(first.grad.local.norm())
    kept = [p.grad.local.clone() for p in others]
    assert float(torch.nn.utils.clip_grad_norm_([first], own / 2)) == pytest.approx(own, 1e-5)
    assert float(first.grad.local.norm()) == pytest.approx(own * (own / 2) / (own + 1e-6), 1e-5)
    assert all(torch.equal(p.grad.local, k) for p, k in zip(others, kept))
    before = torch.cat([fsdp.shard(u)[1].clone() for u in fsdp.units()])
    norm = torch.nn.utils.clip_grad_norm_(fsdp.parameters(), 1e-3)
    assert torch.is_tensor(norm) and abs(float(norm) - float(before.norm())) <= 1e-5 * float(norm)
    after = torch.cat([fsdp.shard(u)[1] for u in fsdp.units()])
    assert abs(float(after.norm()) - 1e-3) <= 1e-6
    # Plain parameters beside them count whole.
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 4.0)
    total = float(torch.nn.utils.get_total_norm(
        [p.grad for p in [*fsdp.parameters(), plain]]))
    shards = float(torch.cat([fsdp.shard(u)[1] for u in fsdp.units()]).norm())
    assert total == pytest.approx((shards ** 2 + 48) ** 0.5, 1e-5)
    assert float(torch.nn.utils.clip_grad_norm_([plain], 1.0)) == pytest.approx(48 ** 0.5)
    # What ragshard does not define on a sharded gradient is refused by name, never computed
    # on this rank's piece alone.
    with pytest.raises(RuntimeError, match="sum on the gradient of 'layers.0.0.weight'"):
        first.grad.sum()
    # torch's own warnings stay.
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in ()), 1.0)
    fsdp.zero_grad()
    assert all(p.grad is None for p in fsdp.parameters())
