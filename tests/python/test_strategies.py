"""AMSP strategies executed (docs/strategy.md): separate shard groups for parameters (p),
gradients (g) and optimizer state (os), and groups inside a node, on 2 daemons x 2 ranks through
`ragshard.launch --create-job --policy auto --strategy SPEC` with the planner started with this
machine's cluster profile; every run against the same model in one plain PyTorch process within
1e-5, with AdamW and Muon, on the host backend (a node's replicas share one slot) and the
device-shaped one (a slot per rank); the plans per factor as ragshardctl shows them."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ragshard.cluster import LocalCluster  # noqa: E402
from test_training import PROFILE, compare, run_reference, run_sharded  # noqa: E402

# The acceptance's strategies: p < g < os (parameters replicated), p = g < os, p < g = os.
PINNED = ["k=1,p=1x1,g=2x1,os=2x2", "k=1,p=2x1,g=2x1,os=2x2", "k=2,p=2x1,g=2x2,os=2x2"]
STEPS = ["--steps", "8"]


@pytest.fixture(scope="module")
def clusters():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE) as host, \
            LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE,
                         backend="device-shaped") as device:
        yield {"host": host, "device-shaped": device}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One reference per optimizer and feature set: the strategy does not change it."""
    tmp = tmp_path_factory.mktemp("refs")
    cache = {}

    def get(extra):
        key = " ".join(extra)
        if key not in cache:
            cache[key] = run_reference(tmp, f"ref{len(cache)}", extra)
        return cache[key]
    return get


def strategy_run(clusters, backend, tmp_path, job, strategy, extra):
    return run_sharded(clusters[backend], tmp_path, job, extra,
                       launch=["--policy", "auto", "--strategy", strategy])


def plan_show(cluster, job, *args):
    ctl = os.path.join(BUILD, "ctl", "ragshardctl")
    r = subprocess.run([ctl, "plan", "show", job, "--planner", cluster.planner, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("strategy", PINNED)
def test_pinned_strategies_match_single_process(clusters, references, tmp_path, strategy,
                                               optimizer):
    extra = STEPS + ["--optimizer", optimizer]
    job = f"amsp-{optimizer}-" + strategy.replace(",", "-").replace("=", "")
    compare(strategy_run(clusters, "host", tmp_path, job, strategy, extra), references(extra))
    plan = json.loads(plan_show(clusters["host"], job, "--json"))
    assert plan["strategy"]["executed"] == strategy
    assert plan["strategy"]["reason"] == "pinned by the job"
    spec = dict(part.split("=") for part in strategy.split(","))
    sizes = {f: int(a) * int(b) for f in ("p", "g", "os")
             for a, b in [spec[f].split("x")]}
    # One plan per factor, over the same units, shown per factor.
    def world(x):
        return int(x.get("worldSize", x.get("world_size", 0)))
    assert world(plan) == sizes["p"]
    factors = {f["component"]: f for f in plan.get("factors", [])}
    assert {c: world(f) for c, f in factors.items()} == {"g": sizes["g"], "os": sizes["os"]}
    for f in factors.values():
        assert [u["unit"] for u in f["units"]] == [u["unit"] for u in plan["units"]]
    text = plan_show(clusters["host"], job, "--factor", "os")
    assert f"factor os, W={sizes['os']}" in text
    assert "sharding on 2 nodes x 2" in text


@pytest.mark.parametrize("strategy", PINNED)
def test_pinned_strategies_on_the_device_shape_match_single_process(clusters, references,
                                                                    tmp_path, strategy):
    # Every rank has its own slot of each factor: replicas (p = 1x1's four copies) are copied
    # by the collectives, and each rank steps its own range.
    job = "amsp-dev-" + strategy.replace(",", "-").replace("=", "")
    compare(strategy_run(clusters, "device-shaped", tmp_path, job, strategy, STEPS),
            references(STEPS))


@pytest.mark.parametrize("backend", ["host", "device-shaped"])
@pytest.mark.parametrize("strategy,extra", [
    # Gradient accumulation and clipping with g replicas on a node (g = 1x2): ranks that share
    # a gradient shard step their own optimizer ranges of it.
    ("k=1,p=1x1,g=1x2,os=2x2", ["--accum", "2", "--clip", "0.5"]),
    # HSDP inside a node (shard = 1x2: each rank's replica is its node's other rank): on the
    # host one rank steps what both share; clipping counts each element once.
    ("k=1,shard=1x2", ["--clip", "0.5"]),
])
def test_features_under_separate_factors_match_single_process(clusters, references, tmp_path,
                                                              backend, strategy, extra):
    job = f"amsp-feat-{backend}-" + strategy.replace(",", "-").replace("=", "")
    compare(strategy_run(clusters, backend, tmp_path, job, strategy, STEPS + extra),
            references(STEPS + extra))


def test_quantized_gathers_under_a_pinned_strategy_train_close_to_the_reference(
        clusters, references, tmp_path):
    # The byte units follow the strategy's plans (ragshard.launch passes the strategy to the
    # ranks as RAGSHARD_STRATEGY): p = 1x1 quantizes whole units, each rank its own copy.
    extra = STEPS + ["--quantize", "int8"]
    out = strategy_run(clusters, "host", tmp_path, "amsp-int8", "k=1,p=1x1,g=2x1,os=2x2", extra)
    got = json.load(open(out + ".json"))["losses"]
    want = json.load(open(references(STEPS) + ".json"))["losses"]
    assert got[-1] < got[0]
    for x, y in zip(got, want):
        assert abs(x - y) <= 0.02 * y, (got, want)


def test_deepseek_v3s_strategy_scaled_down_matches_single_process(tmp_path):
    """The strategy `ragshardctl advise` recommends for DeepSeek-V3 at W = 1024 on 8 x H100
    nodes (tests/server/daemon/deepseek_shape_test.cc; docs/benchmarks/strategy.md): parameters
    over 16 whole nodes, gradients and optimizer state over 64 (two replicas), no prefetch.
    Scaled down to 4 daemons x 2 ranks (p = 2x1 inside a node, g = os = 2x2: two replicas) and
    6 smaller layers, it runs and equals the reference."""
    ctl = os.path.join(BUILD, "ctl", "ragshardctl")
    r = subprocess.run([ctl, "advise", "--model", "deepseek-v3", "--cluster",
                        os.path.join(ROOT, "profiles", "h100-8x-nvlink-ib400.json"), "--world",
                        "1024", "--granule", "rows:128", "--memory-budget", "80GiB",
                        "--max-rejected", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recommendation: k=1,p=8x16,g=8x64,os=8x64,prefetch=0\n" in r.stdout, r.stdout
    extra = ["--steps", "4", "--layers", "6"]
    with LocalCluster(BUILD, daemons=4, pool_bytes=64 << 20, cluster_profile=PROFILE) as c:
        out = run_sharded(c, tmp_path, "deepseek-shape", extra, world=8,
                          launch=["--policy", "auto", "--strategy",
                                  "k=1,p=2x1,g=2x2,os=2x2,prefetch=0"])
        plan = json.loads(plan_show(c, "deepseek-shape", "--json"))
    compare(out, run_reference(tmp_path, "deepseek-shape", extra, world=8))
    assert plan["strategy"]["executed"] == "k=1,p=2x1,g=2x2,os=2x2,prefetch=0", plan["strategy"]


def test_fully_shard_runs_the_prefetch_depth_the_plans_strategy_names():
    """fully_shard's prefetch=None takes the plan's strategy's depth (any D from 0 to 8, not
    only 0 or 1); a plan without one prefetches 1 unit; an explicit prefetch= overrides; a
    depth that is no number is an error naming it."""
    from ragshard.torch.fsdp.module import _prefetch_depth

    def plan(executed):
        return {"strategy": {"executed": executed}}

    assert _prefetch_depth(None, plan("k=1,p=2x1,g=2x2,os=2x2,prefetch=0")) == 0
    assert _prefetch_depth(None, plan("k=1,shard=2x2,prefetch=3")) == 3
    assert _prefetch_depth(None, plan("k=1,shard=2x2")) == 1
    assert _prefetch_depth(None, {}) == 1
    assert _prefetch_depth(2, plan("k=1,shard=2x2,prefetch=0")) == 2
    assert _prefetch_depth(True, {}) == 1
    with pytest.raises(ValueError, match="prefetch=x"):
        _prefetch_depth(None, plan("k=1,prefetch=x"))
    with pytest.raises(ValueError, match="negative"):
        _prefetch_depth(-1, {})
