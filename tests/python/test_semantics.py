"""fully_shard keeps PyTorch's semantics: examples/train_semantics.py (nn.TransformerEncoderLayer
units and a two-expert MoE unit) on 2 daemons x 2 ranks against the same model in one plain
PyTorch process, case by case, with AdamW and Muon and both zero_grad(set_to_none=...)
settings; a parameter used while its unit is resharded is an error naming it; and nodes whose
ranks run different units of equal size fail at once, naming both."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402
from test_training import LAUNCH  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_semantics.py")
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=64 << 20, cluster_profile=PROFILE) as c:
        yield c


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run(cmd):
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def results(out):
    data = json.load(open(out + ".json"))
    return data["losses"] + data["val_losses"], torch.load(out + ".pt")


def sharded_and_reference(cluster, tmp_path, extra):
    job = "sem-" + "-".join(a.lstrip("-") for a in extra)
    out = str(tmp_path / job)
    run(LAUNCH + ["--planner", cluster.planner, "--job", job,
                  "--nproc", "4", "--sockets", ",".join(cluster.sockets), "--create-job",
                  EXAMPLE, "--out", out] + extra)
    return results(out), reference_of(tmp_path, extra)


def reference_of(tmp_path, extra, order="batch"):
    """The one-process reference: the global batch's loss at once ("batch"), or the mean of the
    ranks' losses on their rows ("ranks"), the same numbers summed in another order."""
    ref = str(tmp_path / ("ref-" + order + "-" + "-".join(a.lstrip("-") for a in extra)))
    run([sys.executable, EXAMPLE, "--reference", "--world", "4", "--out", ref,
         "--reference-order", order] + extra)
    return results(ref)


def differences(sharded, reference, rtol=1e-5):
    """What differs by more than rtol (relative): losses by index, parameters by name."""
    (la, pa), (lb, pb) = sharded, reference
    assert len(la) == len(lb)
    assert pa.keys() == pb.keys()
    out = [f"loss {i}: {x} vs reference {y}" for i, (x, y) in enumerate(zip(la, lb))
           if abs(x - y) > rtol * abs(y)]
    for name in pb:
        rel = float((pa[name] - pb[name]).norm() / pb[name].norm().clamp_min(1e-12))
        if rel > rtol:
            out.append(f"{name}: |delta|/|p| = {rel:.3g}")
    return out


def assert_close(sharded, reference, tmp_path=None, extra=None):
    """Every loss and final parameter within 1e-5 of the one-process reference. Adam turns the
    rounding of a gradient that nearly cancels into a visible step, so two orders of the same
    sums in plain PyTorch may differ by more (1.8e-5 in one case on an AVX2 CPU, 7e-6 on
    another); where the batch-order reference differs, the sharded run must then be within
    1e-5 of the ranks-order one (the order it sums in), every number of it."""
    diff = differences(sharded, reference)
    if diff and tmp_path is not None:
        other = differences(sharded, reference_of(tmp_path, extra, order="ranks"))
        assert not other, f"{diff}; against the ranks-order reference too: {other}"
        return
    assert not diff, diff


CASES = [(case, stn) for case in ("skip-odd", "expert-unused", "expert-unused-one-rank")
         for stn in (1, 0)] + [(case, 1) for case in ("eval-no-grad", "two-forwards", "frozen")]
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("case,set_to_none", CASES)
def test_case_matches_single_process(cluster, tmp_path, case, set_to_none, optimizer):
    extra = ["--case", case, "--set-to-none", str(set_to_none), "--optimizer", optimizer]
    sharded, reference = sharded_and_reference(cluster, tmp_path, extra)
    assert_close(sharded, reference, tmp_path, extra)
    if case == "skip-odd":
        # The setting matters here (enc1 has a zero gradient, or none, in odd steps): the
        # reference under the other setting ends elsewhere, so matching it means something.
        other = str(tmp_path / "other")
        run([sys.executable, EXAMPLE, "--reference", "--world", "4", "--out", other, "--case",
             case, "--set-to-none", str(1 - set_to_none), "--optimizer", optimizer])
        _, po = results(other)
        delta = max(float((po[n] - reference[1][n]).norm() / reference[1][n].norm())
                    for n in po if n.startswith("enc1."))
        assert delta > 1e-3


def test_nodes_running_different_units_of_equal_size_fail_naming_both(cluster):
    """In step 1 the first node's ranks run enc1 where the other node's run enc0 (equal sizes,
    so nothing but the message checks tells them apart): every rank's operation fails with
    ABORTED naming both units, long before the operations' 120 s deadline."""
    start = time.monotonic()
    r = preloaded.run(
        LAUNCH + ["--planner", cluster.planner, "--job",
                  "sem-swapped", "--nproc", "4", "--sockets", ",".join(cluster.sockets),
                  "--create-job", EXAMPLE, "--case", "swapped-on-one-node"],
        env=env(), capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    assert r.returncode != 0, r.stdout + r.stderr
    errors = [line for line in (r.stdout + r.stderr).splitlines()
              if "ABORTED" in line and "OP_UNSHARD of unit 0 'enc0'" in line
              and "OP_UNSHARD of unit 2 'enc1'" in line]
    assert errors, r.stdout + r.stderr
    assert elapsed < 55, f"took {elapsed:.0f} s: the failure waited for a deadline"


def load_example():
    spec = importlib.util.spec_from_file_location("train_semantics", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_parameter_used_while_resharded_is_an_error_naming_it(cluster):
    """Outside its unit's forward and backward a parameter holds no storage: using it (or its
    submodule, bypassing the unit's hooks) raises naming it, and what reads no element works."""
    import ragshard.torch as rt
    ex = load_example()
    torch.manual_seed(0)
    net = ex.Net(vocab=16, d=16, heads=2, seq=4)
    ragshard.create_job(cluster.planner, "resharded-use", 1)
    client = ragshard.Client(cluster.planner, cluster.sockets[0], "resharded-use", 0,
                             cluster.nodes[0], 30000)
    model = rt.fully_shard(net, client, units=lambda m: [m.enc0, m.moe, m.enc1], world=1)
    opt = rt.ShardedAdamW(model)
    x = torch.randint(0, 16, (2, 4))
    model(x, x % 2).float().mean().backward()
    opt.step()
    opt.zero_grad()
    w = net.moe.experts[0].up.weight
    with pytest.raises(RuntimeError, match="parameter 'moe.experts.0.up.weight' is used while "
                                           "its unit 'moe' is resharded"):
        _ = w @ torch.ones(16)
    with pytest.raises(RuntimeError, match="'enc1.linear1.weight' is used while its unit "
                                           "'enc1' is resharded"):
        net.enc1.linear1(torch.ones(2, 16))  # the submodule, not the unit
    # No element read: shapes, names, .grad, printing; the full state is a collective.
    assert w.shape == (32, 16) and w.grad is None and w.untyped_storage().nbytes() == 0
    assert "moe.experts.0.up.weight" in dict(net.named_parameters())
    assert "TransformerEncoderLayer" in repr(net)
    state = model.state_dict()
    assert state["moe.experts.0.up.weight"].shape == (32, 16)
    assert float(state["moe.experts.0.up.weight"].abs().sum()) > 0
    # And the unit itself still runs. Inside its forward the parameter is of its own class
    # (no Python __torch_function__ per operation), the same object; outside it refuses again.
    seen = []
    # A pre-hook registered after fully_shard's runs after its unshard.
    hook = net.moe.register_forward_pre_hook(lambda m, i: seen.append(type(w)))
    model(x, x % 2)
    hook.remove()
    from ragshard.torch.fsdp.params import ShardedParameter
    assert seen == [torch.nn.Parameter] and net.moe.experts[0].up.weight is w
    assert type(w) is ShardedParameter
    with pytest.raises(RuntimeError, match="'moe.experts.0.up.weight' is used while"):
        _ = w @ torch.ones(16)
