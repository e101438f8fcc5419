"""A lost node where people train (docs/recovery.md, "A lost node"): bf16 parameters with fp32
masters, and Shampoo (its owners' statistics, roots and step counts), under --redundancy
parity:2 and replica, on the host plane and the device-shaped one. A 3 daemons x 2 ranks
training (examples/train_tiny.py) loses daemon 1 and both its ranks to SIGKILL; a replacement
daemon starts with the same node id and rebuilds their state (masters and preconditioners
included) from the other nodes' redundancy, and the job goes on from the last completed step
with no checkpoint. The final parameters equal an uninterrupted run's within 1e-6."""
import pytest

from test_node_loss import BUILD, command, ctl, env, lose_node, same  # beside this file
import preloaded

from ragshard.cluster import LocalCluster  # noqa: E402

CONFIGS = {"bf16": ("--param-dtype", "bf16"),
           "shampoo": ("--optimizer", "shampoo", "--precondition-every", "2")}


@pytest.fixture(scope="module", params=("host", "device-shaped"))
def cluster(request):
    kw = {} if request.param == "host" else {"backend": request.param}
    with LocalCluster(BUILD, daemons=3, pool_bytes=128 << 20, node_timeout_ms=2000,
                      heartbeat_ms=250, **kw) as c:
        c.kind = request.param
        c.references = {}
        yield c


def reference(cluster, tmp_path, config):
    """The uninterrupted run (redundancy only copies state: parity:2 and replica share it)."""
    if config not in cluster.references:
        ref, cmd = command(cluster, tmp_path, f"ref-{config}-{cluster.kind}", "parity:2",
                           CONFIGS[config])
        r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        cluster.references[config] = ref
    return cluster.references[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("redundancy,phase", [("parity:2", "step"), ("replica", "between")])
def test_a_lost_node_is_rebuilt_in_every_configuration(cluster, tmp_path, config, redundancy,
                                                       phase):
    ref = reference(cluster, tmp_path, config)
    job = f"lost-{config}-{redundancy[:4]}-{cluster.kind}"
    out, stderr = lose_node(cluster, tmp_path, job, redundancy, 3, phase,
                            extra=CONFIGS[config])
    assert "rank 2 exited with -9; restarting it" in stderr
    same(out, ref)
    show = ctl(cluster, "job", "show", job)
    assert show.returncode == 0, show.stderr
    assert "READY" in show.stdout and "rebuilds:     1" in show.stdout, show.stdout
