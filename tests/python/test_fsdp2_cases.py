"""FSDP2's training idioms give FSDP2's numbers under ragshard: every case of
tests/python/fsdp2_cases.py (several and nested units, gradient accumulation by repeated
backward, without reduction, both in one step and across steps, tied weights across units,
parameters frozen and unfrozen in both orders, unused parameters and units, several forwards
before one backward, user hooks registered before and after wrapping, tensor hooks on outputs,
non-tensor and nested inputs and outputs, train/eval/no_grad, every clipping path, full and DCP
state dicts, and FSDP2's module API: reshard_after_forward as bool, int and per unit, explicit
prefetch, the gradient divide factor, unshard/reshard, set_unshard_in_backward,
register_fsdp_forward_method, its hints, ignored_params, CPU offload, mixed precision) runs at
2 daemons x 2 ranks on the host backend and on the device-shaped one, and each step's loss and
every final parameter must equal one-process PyTorch's on the same global batch within 1e-5
(relative). In the same test the case runs under torch's own FSDP2 over gloo, 4 ranks, and must
equal the reference too: the suite's check that the case means what it says.

Besides: accumulation under HSDP (2 replicas of 2, with FSDP2's HSDP mesh beside it) and under
AMSP factors (g != os, against the reference); bf16 mixed precision against FSDP2 with the same
policy, within FSDP2's own difference from the fp32 one-process run; int8 gathers, where three
backward passes equal one backward of the same rows; and Muon's owners (against the reference).

Each mode runs every case of its kind in one launch (fsdp2_case_runs.py), once per module, and
the tests compare what they wrote."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp2_cases  # noqa: E402
from fsdp2_case_runs import (AMSP_STRATEGY, MIXED, PLAIN, QUANTIZED, RTOL, WITH_FSDP2,  # noqa: E402
                             differences, fsdp2_run, largest, ragshard_run, reference_run,
                             results)
# The module's clusters: 2 daemons on each host data plane (node-shared, device-shaped).
from test_training import cluster, device_cluster  # noqa: E402,F401


_RUNS = {}


def _run(key, tmp_path_factory, make):
    """The output directory of run `key`, made once per module by `make(dir)` (None, or the
    failed run's output)."""
    if key not in _RUNS:
        out = str(tmp_path_factory.mktemp(key.replace(":", "-")))
        _RUNS[key] = (out, make(out))
    out, error = _RUNS[key]
    assert error is None, error
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cases = [c for c in fsdp2_cases.CASES if c not in QUANTIZED]
    return _run("reference", tmp_path_factory, lambda out: reference_run(BUILD, cases, out))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return _run("fsdp2", tmp_path_factory, lambda out: fsdp2_run(BUILD, WITH_FSDP2, out))


@pytest.fixture(scope="module")
def fsdp2_hsdp(tmp_path_factory):
    return _run("fsdp2-hsdp", tmp_path_factory,
                lambda out: fsdp2_run(BUILD, sorted(fsdp2_cases.HSDP), out, hsdp=True))


def ours(request, tmp_path_factory, backend, kind, cases, **kwargs):
    """The output directory of ragshard's run of `cases` (`kind` names it) on `backend`."""
    cluster = request.getfixturevalue("cluster" if backend == "host" else "device_cluster")
    prefix = kind[:2] + ("h" if backend == "host" else "d")
    return _run(f"{kind}-{backend}", tmp_path_factory,
                lambda out: ragshard_run(BUILD, cluster, cases, prefix, out, **kwargs))


@pytest.mark.parametrize("case", PLAIN)
@pytest.mark.parametrize("backend", ["host", "device-shaped"])
def test_case_matches_one_process(case, backend, request, tmp_path_factory, reference):
    got = results(ours(request, tmp_path_factory, backend, "cases", PLAIN), case)
    want = results(reference, case)
    if case in fsdp2_cases.RAGSHARD_ONLY:
        assert not differences(got, want), differences(got, want)
        return
    theirs = results(request.getfixturevalue("fsdp2"), case)
    if case in MIXED:
        # bf16: ragshard within FSDP2's own difference from the fp32 one-process run.
        loss_tol, param_tol = largest(theirs, want)
        diff = differences(got, theirs, rtol=max(RTOL, 2 * loss_tol, 2 * param_tol))
        assert not diff, f"against FSDP2 (bf16 noise {loss_tol:.2g}, {param_tol:.2g}): {diff}"
        return
    assert not differences(theirs, want), f"FSDP2 itself: {differences(theirs, want)}"
    assert not differences(got, want), differences(got, want)


@pytest.mark.parametrize("case", sorted(fsdp2_cases.HSDP))
@pytest.mark.parametrize("backend", ["host", "device-shaped"])
def test_hsdp_accumulation_matches_one_process(case, backend, request, tmp_path_factory,
                                               reference, fsdp2_hsdp):
    got = results(ours(request, tmp_path_factory, backend, "hsdp", sorted(fsdp2_cases.HSDP),
                       replicate=2), case)
    want, theirs = results(reference, case), results(fsdp2_hsdp, case)
    assert not differences(theirs, want), f"FSDP2 itself: {differences(theirs, want)}"
    assert not differences(got, want), differences(got, want)


@pytest.mark.parametrize("backend", ["host", "device-shaped"])
def test_amsp_accumulation_matches_one_process(backend, request, tmp_path_factory, reference):
    got = results(ours(request, tmp_path_factory, backend, "amsp", ["amsp-accum"],
                       strategy=AMSP_STRATEGY), "amsp-accum")
    want = results(reference, "amsp-accum")
    assert not differences(got, want), differences(got, want)


@pytest.mark.parametrize("backend", ["host", "device-shaped"])
def test_quantized_gathers_accumulate(backend, request, tmp_path_factory):
    """int8 gathers: three backward passes before a step give the step of one backward over
    the same rows (the parameters, hence the quantized gathers, do not change between)."""
    out = ours(request, tmp_path_factory, backend, "quantized", sorted(QUANTIZED))
    got, want = results(out, "quantized-accum"), results(out, "quantized-once")
    assert not differences(got, want), differences(got, want)
