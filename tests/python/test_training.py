"""Training through ragshard against single-process PyTorch, on a local planner and 2 daemons
(loopback and Unix sockets in a temporary directory), on both host data planes (unsharded
buffers shared by a node's ranks, and the device shape: private per-rank buffers): AdamW in
fp32, Muon, gradient accumulation and clipping, HSDP, the reshard and prefetch knobs, bf16 and
quantized gathers; and the binding's zero-copy views, transient buffers and errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# ragshard.launch with the ranks forked from one torch import (seconds of CPU saved per rank).
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch"]
PROFILE = os.path.join(os.path.dirname(__file__), "..", "..", "profiles",
                       "host-2x2-loopback.json")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet"]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE) as c:
        yield c


@pytest.fixture(scope="module")
def device_cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE,
                      backend="device-shaped") as c:
        yield c


@pytest.fixture(params=["host", "device-shaped"])
def backend_cluster(request):
    """The training tests run on both host data planes."""
    return request.getfixturevalue("cluster" if request.param == "host" else "device_cluster")


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_sharded(cluster, tmp_path, job, extra, world=4, launch=()):
    out = str(tmp_path / job)
    cmd = LAUNCH + ["--planner", cluster.planner, "--job", job,
                    "--nproc", str(world), "--sockets", ",".join(cluster.sockets),
                    "--create-job", *launch, EXAMPLE, "--out", out] + SMALL + extra
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


_REFERENCES = {}  # (world, arguments) -> the reference run's output, once per pytest session


def run_reference(tmp_path, name, extra, world=4):
    """The one-process reference of `extra` at `world` (deterministic: run once per session,
    whichever test asks first; the others read its files)."""
    key = (world, tuple(extra))
    if key in _REFERENCES and os.path.exists(_REFERENCES[key] + ".json"):
        return _REFERENCES[key]
    out = str(tmp_path / (name + "-ref"))
    cmd = [sys.executable, EXAMPLE, "--reference", "--world", str(world), "--out", out] + \
        SMALL + extra
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    _REFERENCES[key] = out
    return out


def compare(sharded, reference, rtol=1e-5, param_rtol=None):
    """Every step's loss within a relative `rtol` of the reference's, and each final parameter
    within a relative `param_rtol` (default `rtol`) in norm."""
    param_rtol = rtol if param_rtol is None else param_rtol
    a = json.load(open(sharded + ".json"))["losses"]
    b = json.load(open(reference + ".json"))["losses"]
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y), f"step {step + 1}: loss {x} vs reference {y}"
    pa, pb = torch.load(sharded + ".pt"), torch.load(reference + ".pt")
    assert pa.keys() == pb.keys()
    for name in pa:
        rel = float((pa[name] - pb[name]).norm() / pb[name].norm().clamp_min(1e-12))
        assert rel <= param_rtol, f"{name}: |delta|/|p| = {rel:.3g}"
    return a


@pytest.mark.parametrize("name,extra", [
    ("adamw", ["--steps", "20"]),
    ("muon", ["--steps", "20", "--optimizer", "muon"]),
    ("accum-clip", ["--steps", "20", "--accum", "2", "--clip", "0.5"]),
    # FSDP2's knobs: units stay unsharded from forward to backward; no prefetch.
    ("no-reshard", ["--steps", "10", "--no-reshard-after-forward"]),
    ("no-prefetch", ["--steps", "10", "--prefetch", "0"]),
    # Resharded to the 2 ranks of each daemon after forward: the backward unshards in the node.
    ("reshard-node", ["--steps", "10", "--reshard-after-forward", "2"]),
])
def test_training_matches_single_process(backend_cluster, tmp_path, name, extra):
    job = f"train-{name}-{backend_cluster.backend}"
    losses = compare(run_sharded(backend_cluster, tmp_path, job, extra),
                     run_reference(tmp_path, name, extra))
    assert losses[-1] < losses[0]  # it learns


def test_hsdp_matches_single_process(backend_cluster, tmp_path):
    # Mesh 2 x 2: each daemon's two ranks are a shard group; gradients are averaged over the
    # replicas across the daemons.
    extra = ["--steps", "20"]
    job = "hsdp-" + backend_cluster.backend
    compare(run_sharded(backend_cluster, tmp_path, job, extra, launch=["--replicate", "2"]),
            run_reference(tmp_path, "hsdp", extra))


def plan_show(cluster, job):
    ctl = os.path.join(BUILD, "ctl", "ragshardctl")
    r = subprocess.run([ctl, "plan", "show", job, "--planner", cluster.planner, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name,strategy,units", [
    # Both layers in one plan unit, each daemon's two ranks a shard group, 2 replicas.
    ("auto-k2", "k=2,shard=2x1", ["layers.0-1", "root", "__ragshard_scalars__",
      "__ragshard_used__"]),
    # One shard group over both daemons, gathers on demand (fully_shard follows prefetch=0).
    ("auto-noprefetch", "k=1,shard=2x2,prefetch=0",
     ["layers.0", "layers.1", "root", "__ragshard_scalars__",
      "__ragshard_used__"]),
    # Whatever the planner's search picks for this machine's profile.
    ("auto", "", None),
])
def test_policy_auto_plans_run_and_match_single_process(cluster, tmp_path, name, strategy, units):
    extra = ["--steps", "20"]
    launch = ["--policy", "auto"] + (["--strategy", strategy] if strategy else [])
    compare(run_sharded(cluster, tmp_path, name, extra, launch=launch),
            run_reference(tmp_path, name, extra))
    plan = plan_show(cluster, name)
    st = plan["strategy"]
    assert st["executed"].startswith("k="), st
    if strategy:
        assert st["executed"] == strategy and st["reason"] == "pinned by the job"
    else:
        assert st["reason"].startswith("best of"), st
    names = [u["unit"] for u in plan["units"]]
    if units:
        assert names == units
        if strategy.startswith("k=2"):
            assert plan["units"][0]["members"] == ["layers.0", "layers.1"]
    k = int(st["executed"].split(",")[0][2:])
    grouped = [u for u in plan["units"] if u.get("members")]
    assert (k > 1) == bool(grouped), (st, names)


def test_bf16_mixed_precision_trains_close_to_fp32(backend_cluster, tmp_path):
    extra = ["--steps", "30"]
    b = backend_cluster.backend
    fp32 = json.load(open(run_sharded(backend_cluster, tmp_path, "mp-fp32-" + b, extra) +
                          ".json"))["losses"]
    bf16 = json.load(open(run_sharded(backend_cluster, tmp_path, "mp-bf16-" + b,
                                      extra + ["--param-dtype", "bf16"]) + ".json"))["losses"]
    assert bf16 != fp32 and bf16[-1] < 0.8 * bf16[0]
    assert abs(bf16[-1] - fp32[-1]) <= 0.03 * fp32[-1], (bf16[-1], fp32[-1])


def test_quantized_gathers_stay_within_two_percent(backend_cluster, tmp_path):
    final = {}
    for q in ("none", "int8", "fp8"):
        out = run_sharded(backend_cluster, tmp_path, f"quant-{q}-{backend_cluster.backend}",
                          ["--steps", "50", "--quantize", q])
        final[q] = json.load(open(out + ".json"))
    base = final["none"]["losses"]
    for q in ("int8", "fp8"):
        losses = final[q]["losses"]
        assert losses != base  # the gathers really were quantized
        rel = abs(losses[-1] - base[-1]) / abs(base[-1])
        assert rel <= 0.02, f"{q}: final loss {losses[-1]} vs {base[-1]} ({rel:.2%})"
        moved = final[q]["gathered_bytes"]
        assert 0 < moved["quantized"] < 0.3 * moved["full"], moved
    # Prefetched quantized gathers (the default) give the same bits as gathers started when
    # the unit needs them: the node's ranks dequantize into one shared buffer at once.
    out = run_sharded(backend_cluster, tmp_path, f"quant-int8-noprefetch-{backend_cluster.backend}",
                      ["--steps", "50", "--quantize", "int8", "--prefetch", "0"])
    assert json.load(open(out + ".json"))["losses"] == final["int8"]["losses"]


def test_torchrun_ranks_match_single_process(cluster, tmp_path):
    """Ranks started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ... from torchrun; the planner,
    job and daemon socket from RAGSHARD_*) train like ragshard.launch's."""
    ragshard.create_job(cluster.planner, "torchrun", 2)
    e = env()
    for k in ("RAGSHARD_RANK", "RAGSHARD_WORLD_SIZE", "RAGSHARD_NODE"):
        e.pop(k, None)
    e.update(RAGSHARD_PLANNER=cluster.planner, RAGSHARD_JOB="torchrun",
             RAGSHARD_SOCKET=cluster.sockets[0])
    out = str(tmp_path / "torchrun")
    extra = ["--steps", "5"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", EXAMPLE, "--out", out] + SMALL + extra,
                       env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    compare(out, run_reference(tmp_path, "torchrun", extra, world=2))


def attach_pair(cluster, job, inventory):
    return cluster.attach(job, inventory)


INV = {"units": [{"name": "u", "tensors": [
    {"name": "w", "shape": [64, 8], "dtype": "fp32", "granule": "rows:8"},
    {"name": "h", "shape": [40], "dtype": "fp32"}]}]}


def test_views_are_zero_copy_and_operations_work(cluster):
    inv = {"units": [{"name": "u", "tensors": [
        {"name": "w", "shape": [64, 8], "dtype": "fp32", "granule": "rows:8"}]}]}
    a, b = attach_pair(cluster, "binding", inv)
    s = a.shard_elems(0)
    assert a.world_size == 2 and a.units == 2 - 1

    def both(op):
        ha, hb = getattr(a, op)(0), getattr(b, op)(0)
        ha.wait()
        hb.wait()

    def address(array):
        return array.__array_interface__["data"][0]

    # The shards persist; the unsharded buffer exists from unshard to reshard.
    a.param_shard(0)[:] = 3.0
    # torch.from_numpy shares the shard's memory.
    t = torch.from_numpy(b.param_shard(0))
    t.fill_(5.0)
    assert t.data_ptr() == address(b.param_shard(0))
    with pytest.raises(ragshard.Error, match="'u' has no unsharded parameters now"):
        a.unsharded(0)
    both("unshard")
    # Both ranks of one daemon share the unsharded buffer, which holds both shards: a write
    # through one rank's view is visible in the other's at once.
    assert np.all(a.unsharded(0)[:s] == 3.0) and np.all(a.unsharded(0)[s:2 * s] == 5.0)
    a.unsharded(0)[0] = 7.0
    assert b.unsharded(0)[0] == 7.0
    used = a.stats()["pool_used"]
    both("reshard")
    assert a.stats()["pool_used"] < used  # released to the pool
    with pytest.raises(ragshard.Error, match="no unsharded parameters now"):
        b.unsharded(0)
    # Gradients: allocated zero-filled, reduce-scattered (avg), then released.
    both("allocate_grad")
    assert np.all(a.grad(0) == 0)
    a.grad(0)[:] = 1.0
    b.grad(0)[:] = 3.0
    assert np.all(a.grad(0) == 1.0)  # each rank's own gradient buffer
    ha, hb = a.reduce_scatter(0, "avg"), b.reduce_scatter(0, "avg")
    ha.wait()
    hb.wait()
    assert np.allclose(a.grad_shard(0), 2.0) and np.allclose(b.grad_shard(0), 2.0)
    with pytest.raises(ragshard.Error, match="no unsharded gradients now"):
        a.grad(0)
    assert a.stats()["staging_bytes"] == 0


def test_a_view_over_the_shards_keeps_them_from_writes_to_unsharded_parameters(cluster):
    """Shards of whole pages: the unsharded buffer maps them instead of a copy
    (protocol/unsharded_view.h). A rank's write to its unsharded parameters stays its own and is
    gone at reshard, as with FSDP2's separate all-gather output; the shard never sees it."""
    inv = {"units": [{"name": "u", "tensors": [
        {"name": "w", "shape": [1024, 4], "dtype": "fp32", "granule": "rows:8"}]}]}
    a, b = attach_pair(cluster, "view", inv)
    s = a.shard_elems(0)
    assert (s * 4) % 4096 == 0, s

    def both(op):
        ha, hb = getattr(a, op)(0), getattr(b, op)(0)
        ha.wait()
        hb.wait()

    a.param_shard(0)[:] = 3.0
    b.param_shard(0)[:] = 5.0
    used = a.stats()["pool_used"]
    both("unshard")
    # The node holds the whole shard group: its shards are the whole buffer, nothing allocated.
    assert a.stats()["pool_used"] == used
    assert np.all(a.unsharded(0)[:s] == 3.0) and np.all(a.unsharded(0)[s:] == 5.0)
    a.unsharded(0)[0] = 7.0
    a.unsharded(0)[s] = 9.0
    assert a.unsharded(0)[0] == 7.0 and a.unsharded(0)[s] == 9.0
    assert a.param_shard(0)[0] == 3.0 and b.param_shard(0)[0] == 5.0  # shards untouched
    assert b.unsharded(0)[0] == 3.0 and b.unsharded(0)[s] == 5.0  # the write is a's own
    both("reshard")
    # An optimizer step writes the shards; the next unshard shows them, not the old writes.
    a.param_shard(0)[0] = 4.0
    both("unshard")
    assert a.unsharded(0)[0] == 4.0 and a.unsharded(0)[s] == 5.0
    assert np.all(b.unsharded(0)[1:s] == 3.0)
    both("reshard")


def test_bad_input_raises_clear_errors(cluster):
    a, b = attach_pair(cluster, "badinput", INV)
    with pytest.raises(IndexError, match="unit 7 does not exist"):
        a.param_shard(7)
    with pytest.raises(ValueError, match="not one of avg, sum"):
        a.reduce_scatter(0, "max")
    # Operation kinds travel as ragshard.v1.OpKind numbers; a number that is none is refused.
    with pytest.raises(ragshard.Error, match="INVALID_ARGUMENT: kind: 4 is not an operation"):
        a._op(4, 0)  # OP_NOOP
    with pytest.raises(ragshard.Error, match="INVALID_ARGUMENT: kind: 77 is not an operation"):
        a._op(77, 0)
    assert a.unit_dtype(0) in ("fp32", "bf16")
    c = ragshard.Client(cluster.planner, cluster.sockets[0], "no-such-job", 0, cluster.nodes[0],
                        2000)
    with pytest.raises(ragshard.Error, match="no-such-job"):
        c.attach()
    with pytest.raises(ragshard.Error, match="INVALID_ARGUMENT"):
        c.register("{not json", True)


def test_cpp_example_trains(cluster):
    exe = os.path.join(BUILD, "examples", "train_mlp")
    ragshard.create_job(cluster.planner, "mlp", 2)
    procs = [subprocess.Popen([exe, "--planner", cluster.planner, "--socket", cluster.sockets[r],
                               "--job", "mlp", "--rank", str(r), "--world", "2", "--node",
                               cluster.nodes[r], "--steps", "100"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    losses = [float(line.split()[3]) for line in outs[0].splitlines() if line.startswith("step")]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], outs[0]


def test_a_container_unit_is_rejected_naming_it():
    """A ModuleList's forward is never called (its children are), so its hooks could never
    gather it: fully_shard refuses it before touching the job, as FSDP2 fails loudly."""
    import ragshard.torch as rt
    model = torch.nn.Sequential()
    model.add_module("blocks", torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))
    with pytest.raises(ValueError, match="unit 'blocks' is a ModuleList, whose forward is never"
                                         " called"):
        rt.fully_shard(model, None, units=lambda m: [m.blocks])
