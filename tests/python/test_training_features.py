"""The example's training features through ragshard against their one-process references: 2
daemons x 2 ranks through the launcher, policy ragged, 5 steps, against `--reference --world 4`
with the same flags (8-bit Adam, Shampoo, tied embeddings, meta-device initialization,
activation checkpointing), within a relative 1e-5 (Shampoo: 1e-4)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_training import (BUILD, EXAMPLE, LAUNCH, PROFILE, SMALL, compare, env,  # noqa: E402
                           run_reference, run_sharded)
from ragshard.cluster import LocalCluster  # noqa: E402

STEPS = ["--steps", "5"]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE) as c:
        yield c


def test_adam8bit_matches_its_reference(cluster, tmp_path):
    """Losses within 1e-5 at every step. The parameters: the runs' gradients differ in their
    last bits (4 ranks' reductions against one backward), and where such a difference moves a
    moment across a rounding boundary of its 8-bit code, that element's moment differs by a
    code step from then on. So all but a few elements per thousand agree within 1e-6, and no
    tensor differs by more than 1e-4 of its norm."""
    extra = STEPS + ["--optimizer", "adam8bit"]
    a = run_sharded(cluster, tmp_path, "feature-adam8bit", extra)
    b = run_reference(tmp_path, "adam8bit", extra)
    losses = compare(a, b, rtol=1e-5, param_rtol=1e-4)
    assert losses[-1] < losses[0]
    pa, pb = torch.load(a + ".pt"), torch.load(b + ".pt")
    off = sum(int(((pa[n] - pb[n]).abs() > 1e-6).sum()) for n in pa)
    total = sum(t.numel() for t in pa.values())
    assert off <= 0.003 * total, f"{off} of {total} elements differ by more than 1e-6"


def test_adam8bit_resumes_exactly(cluster, tmp_path):
    """The 8-bit moments are checkpointed as they are held (codes and block scales): saved at
    step 3 and resumed to step 6 under the same plan, the run equals the uninterrupted one bit
    for bit; resumed at 2 ranks instead of 4 (another plan, the same global batch), it equals
    it as the 4-rank run equals its reference."""
    six = STEPS[:1] + ["6", "--optimizer", "adam8bit", "--global-batch", "8"]
    whole = run_sharded(cluster, tmp_path, "adam8bit-6", six)
    root = str(tmp_path / "ckpt")
    run_sharded(cluster, tmp_path, "adam8bit-save", six[:1] + ["3"] + six[2:] +
                ["--save", root, "--save-step", "3"])
    same = run_sharded(cluster, tmp_path, "adam8bit-resume", six + ["--resume", root])
    a, b = json.load(open(same + ".json")), json.load(open(whole + ".json"))
    assert a["first_step"] == 4 and a["losses"] == b["losses"][3:]
    pa, pb = torch.load(same + ".pt"), torch.load(whole + ".pt")
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    two = run_sharded(cluster, tmp_path, "adam8bit-resume-2", six + ["--resume", root], world=2)
    a = json.load(open(two + ".json"))
    for x, y in zip(a["losses"], b["losses"][3:]):
        assert abs(x - y) <= 1e-5 * abs(y), (a["losses"], b["losses"])
    pa = torch.load(two + ".pt")
    for n in pb:
        assert float((pa[n] - pb[n]).norm() / pb[n].norm()) <= 1e-4, n


@pytest.mark.parametrize("block", [0, 32], ids=["whole", "blocked"])
def test_shampoo_matches_its_reference(cluster, tmp_path, block):
    """Shampoo on the owners, its roots recomputed at steps 1, 3 and 5 (every 2 from the first),
    unblocked and in 32 x 32 blocks: losses and parameters within 1e-4 of the one-process
    reference. Every matrix has its preconditioners on exactly one rank, and they are no
    multiple of the identity (which, once the update is grafted, would precondition nothing):
    the same distance from one as the reference's."""
    extra = STEPS + ["--optimizer", "shampoo", "--precondition-every", "2",
                     "--shampoo-block", str(block)]
    a = run_sharded(cluster, tmp_path, f"feature-shampoo-{block}", extra)
    b = run_reference(tmp_path, f"shampoo-{block}", extra)
    losses = compare(a, b, rtol=1e-4)
    assert losses[-1] < losses[0]
    want = json.load(open(b + ".json"))["shampoo"]
    assert len(want) == 8, want  # qkv, proj, up and down of 2 layers
    got = {}
    for r in range(4):
        for name, st in json.load(open(f"{a}.rank{r}.json"))["shampoo"].items():
            assert name not in got, f"{name}: preconditioned on two ranks"
            got[name] = st
    assert got.keys() == want.keys()
    for name, st in got.items():
        assert st["refreshed"] == [1, 3, 5] == want[name]["refreshed"], (name, st)
        assert st["off_identity"] > 0.05, (name, st)
        assert abs(st["off_identity"] - want[name]["off_identity"]) <= 1e-4, (name, st, want)


@pytest.mark.parametrize("name,flags", [
    ("meta-init", ["--meta-init"]),
    ("tie", ["--tie-embeddings"]),
    ("tie-muon", ["--tie-embeddings", "--optimizer", "muon"]),
    ("ckpt-act", ["--checkpoint-activations"]),
    ("ckpt-act-reentrant", ["--checkpoint-activations", "reentrant"]),
    # The gradients the recomputed layers produce are reduced like any others: with
    # accumulation they add up under no_sync first.
    ("ckpt-act-accum", ["--checkpoint-activations", "--accum", "2"]),
])
def test_feature_matches_its_reference(cluster, tmp_path, name, flags):
    extra = STEPS + flags
    losses = compare(run_sharded(cluster, tmp_path, f"feature-{name}", extra),
                     run_reference(tmp_path, name, extra))
    assert losses[-1] < losses[0]  # it learns


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpoint_activations_keep_units_sharded(cluster, tmp_path, mode):
    """The recompute in backward runs inside the unit's backward (gathered for it), and the
    unit is resharded and reduced right after it, as without checkpointing: no rank ever has
    more units unsharded at once than without (a recompute counted as another forward, or a
    reentrant checkpoint's first forward without autograd, would leave every unit's
    post-backward to the end of the backward)."""
    deep = ["--layers", "4", "--steps", "2"]
    peaks = []
    for name, flags in (("plain", []), (mode, ["--checkpoint-activations", mode])):
        out = run_sharded(cluster, tmp_path, f"feature-peak-{mode}-{name}", deep + flags)
        peaks.append([json.load(open(f"{out}.rank{r}.json"))["peak_units_unsharded"]
                      for r in range(4)])
    assert peaks[0] == peaks[1], peaks
    assert max(peaks[1]) <= 3, peaks  # the root, the layer in use and the one prefetched


def test_a_tie_across_units_is_gathered_per_use_and_reduced_once(cluster, tmp_path):
    """--tie-embeddings: the embedding is a unit of its own and the head, in the root, uses
    its weight. Per step that unit is gathered twice (the embedding's forward, the head's
    forward, kept for the head's backward and the embedding's) and reduce-scattered once,
    after both uses' gradients; every layer is gathered twice and reduced once too."""
    steps = 3
    out = run_sharded(cluster, tmp_path, "feature-tie-counts",
                      ["--steps", str(steps), "--tie-embeddings"])
    for r in range(4):
        rank = json.load(open(f"{out}.rank{r}.json"))
        # The module's count of this rank's gathers and reduce-scatters, and the daemon's
        # count of the operations its node ran (the node's ranks issue each one together).
        counts, daemon = rank["op_counts"], rank["daemon_unit_operations"]
        for unit in ("tok", "layers.0", "layers.1"):
            assert counts["gather"][unit] == 2 * steps, counts
            assert counts["reduce_scatter"][unit] == steps, counts
            assert daemon[unit]["OP_UNSHARD"] == 2 * steps, daemon
            assert daemon[unit]["OP_REDUCE_SCATTER"] == steps, daemon
    # The same figures reach the planner in the daemons' heartbeats: `ragshardctl node stats`
    # shows, for node-0, at least this job's operations (the jobs it holds add up).
    job_unshards = sum(u.get("OP_UNSHARD", 0) for u in json.load(
        open(f"{out}.rank0.json"))["daemon_unit_operations"].values())
    ctl = [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner", cluster.planner, "node",
           "stats", "node-0", "--json"]
    deadline = time.monotonic() + 60
    while True:  # until a heartbeat after the run arrives (one a second)
        r = subprocess.run(ctl, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        figures = json.loads(r.stdout)["figures"]
        kinds = {k["kind"]: int(k["count"]) for k in figures.get("operationsByKind", [])}
        if kinds.get("OP_UNSHARD", 0) >= job_unshards:
            break
        assert time.monotonic() < deadline, figures
        time.sleep(0.2)
    assert int(figures["operations"]) >= sum(kinds.values()) - kinds.get("OP_NOOP", 0) > 0
    assert int(figures["jobs"]) >= 1 and int(figures["poolCapacityBytes"]) == 128 << 20


def test_meta_init_values_come_from_the_init(tmp_path):
    """--meta-init's values are the seeded per-tensor init's, not torch's default init."""
    a = run_reference(tmp_path, "meta", ["--steps", "1", "--meta-init"])
    b = run_reference(tmp_path, "default", ["--steps", "1"])
    pa, pb = torch.load(a + ".pt"), torch.load(b + ".pt")
    assert all(not torch.equal(pa[n], pb[n]) for n in pa if "ln" not in n)


META_SCRIPT = """
import sys
import torch
import ragshard, ragshard.torch as rt
with torch.device("meta"):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
client = ragshard.connect(ragshard.Env())
fsdp = rt.fully_shard(model, client, units=lambda m: [m[0]], init="empty")
try:
    fsdp(torch.ones(1, 8))
    sys.exit("a forward before any load ran")
except RuntimeError as e:
    assert "the shards hold no values yet" in str(e), e
fsdp.load_state_dict({n: torch.full(p.shape, 0.5) for n, p in model.named_parameters()})
out = fsdp(torch.ones(1, 8))
assert torch.allclose(out, torch.full((1, 2), 0.5 * 8 * (0.5 * 8 + 0.5) + 0.5)), out
print("ok")
"""


def test_meta_init_empty_runs_only_after_a_load(cluster, tmp_path):
    """fully_shard on a meta model with init="empty": the module refuses a forward until a
    state_dict (or a checkpoint) is loaded, then computes with the loaded values."""
    script = tmp_path / "meta_script.py"
    script.write_text(META_SCRIPT)
    r = preloaded.run(LAUNCH + ["--planner", cluster.planner,
                                 "--job", "feature-meta-empty", "--nproc", "2", "--sockets",
                                 cluster.sockets[0], "--create-job", str(script)],
                       env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok") == 2, r.stdout


def test_meta_init_without_init_or_with_bad_values_is_refused():
    import ragshard.torch as rt
    from ragshard.torch.fsdp import meta
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="'0.weight' is on the meta device; pass init=fn"):
        rt.fully_shard(model, None, units=lambda m: [m[0]])
    with pytest.raises(ValueError, match=re.escape(
            "init('w') returned (3,), not a CPU tensor of shape (8, 8)")):
        meta.values(lambda n, t: torch.zeros(3), "w", torch.empty(8, 8, device="meta"))
    with pytest.raises(ValueError, match="init=7 is neither a function nor 'empty'"):
        rt.fully_shard(model, None, units=lambda m: [m[0]], init=7)


def test_adam8bit_quantizes_its_moments(tmp_path):
    """The reference's 8-bit moments differ from fp32 AdamW's: the runs are not the same."""
    a = run_reference(tmp_path, "8bit", STEPS + ["--optimizer", "adam8bit"])
    b = run_reference(tmp_path, "fp32", STEPS)
    pa, pb = torch.load(a + ".pt"), torch.load(b + ".pt")
    assert any(not torch.equal(pa[n], pb[n]) for n in pa)


def test_adam8bit_refuses_a_plan_that_cuts_its_blocks(cluster, tmp_path):
    """Under the granule rows:1 a rank's piece of a matrix may start inside a 128-row band:
    the optimizer refuses before the first step, naming the parameter."""
    out = str(tmp_path / "cut")
    cmd = LAUNCH + ["--planner", cluster.planner, "--job",
                    "feature-cut", "--nproc", "4", "--sockets", ",".join(cluster.sockets),
                    "--create-job", EXAMPLE, "--out", out] + SMALL + STEPS + \
        ["--optimizer", "adam8bit", "--granule", "rows:1"]
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "ShardedAdam8bit: parameter 'layers." in r.stderr, r.stderr
    assert "inside its 128x128 blocks; give matrices the granule rows:128" in r.stderr
