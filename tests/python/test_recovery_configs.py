"""Recovery in place where people train (docs/recovery.md, "What a rank keeps"): bf16 parameters
with fp32 masters, FP8 gathers, 8-bit Adam, Shampoo and NAdam, each on the host plane and the
device-shaped one. A 2 hosts x 2 ranks training (examples/train_tiny.py; hosts of their own, one
launcher per host, as test_recovery.py) loses four ranks to SIGKILL in one run: rank 1 in step 2's forward, rank 2 in step 3's backward, rank 3 inside step
4's optimizer step and rank 0 between steps 5 and 6. Its host's ragshard-launch --max-restarts 1
restarts each, the others exit on the daemons' notice, every rank attaches again to the state its daemon
kept (masters, bf16 shards, quantization scales, codes, preconditioners and scalars included),
and the job goes on from the last completed step with no checkpoint. The final parameters equal
an uninterrupted run's within 1e-6 (bit-exact in practice), and the journal says all 6 steps
completed.

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import os
import time

import pytest
from test_recovery import PROFILE, ctl, hosts, params, run  # beside this file

CONFIGS = {
    "bf16": ["--param-dtype", "bf16"],
    "fp8": ["--quantize", "fp8"],
    "adam8bit": ["--optimizer", "adam8bit"],
    # Roots recomputed every 2 steps: a restart between two refreshes uses the adopted ones.
    "shampoo": ["--optimizer", "shampoo", "--precondition-every", "2"],
    "nadam": ["--optimizer", "nadam"],  # NAdam's mu_product: a per-piece scalar in the pool
}
BACKENDS = ("host", "device-shaped")


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, tmp_path_factory):
    kw = {"cluster_profile": PROFILE} if request.param == "host" else \
        {"backend": request.param}
    with hosts(tmp_path_factory, **kw) as c:
        c.kind = request.param
        yield c


def kills(tmp_path):
    """One SIGKILL in each phase, each of another rank (--max-restarts 1 is per rank)."""
    out = []
    for rank, step, phase in ((1, 2, "forward"), (2, 3, "backward"), (3, 4, "step"),
                              (0, 5, "between")):
        out += ["--kill-at", f"{rank}:{step}:{phase}:{tmp_path / f'killed-{rank}'}"]
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_configuration_recovers_in_place(cluster, tmp_path, config):
    job = f"{config}-{cluster.kind}"
    ref, r = run(cluster, tmp_path, f"ref-{job}", CONFIGS[config])
    assert r.returncode == 0, r.stdout + r.stderr
    out, r = run(cluster, tmp_path, f"kill-{job}", CONFIGS[config] + kills(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(4):
        assert os.path.exists(tmp_path / f"killed-{rank}"), f"rank {rank} was not killed"
        assert f"rank {rank} exited with -9; restarting it" in r.launchers[rank // 2], r.stderr
    a, b = params(out), params(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        delta = float((a[name].float() - b[name].float()).abs().max())
        assert delta <= 1e-6, f"{config}: {name}: max |delta| {delta:.3g}"
    show = ctl(cluster, "job", "show", f"kill-{job}")
    assert "READY" in show.stdout and "recoveries:   4 recoveries" in show.stdout, show.stdout
    deadline = time.time() + 30
    while True:
        why = ctl(cluster, "job", "why", f"kill-{job}")
        if "steps:        6 completed by every rank" in why.stdout or time.time() > deadline:
            break
        time.sleep(0.2)
    assert "steps:        6 completed by every rank\n" in why.stdout, why.stdout + why.stderr
