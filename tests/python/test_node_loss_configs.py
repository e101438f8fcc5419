"""A lost node where people train (docs/recovery.md, "A lost node"): bf16 parameters with fp32
masters, and Shampoo (its owners' statistics, roots and step counts), under --redundancy
parity:2 and replica, on the host plane and the device-shaped one, on hosts of their own
(test_node_loss.py's cluster). A 3 hosts x 2 ranks training (examples/train_tiny.py) loses node
1's host (link down, then everything on it killed); a replacement daemon starts with the same
node id on a spare host and rebuilds their state (masters and preconditioners included) from
the other nodes' redundancy, and the job goes on from the last completed step with no
checkpoint. The final parameters equal an uninterrupted run's within 1e-6."""
import pytest
from host_runs import assert_same, ctl, finish  # beside this file
from test_node_loss import BUILD, ROOT, launch, lose_node

from ragshard.cluster import NamespacedCluster  # noqa: E402

CONFIGS = {"bf16": ("--param-dtype", "bf16"),
           "shampoo": ("--optimizer", "shampoo", "--precondition-every", "2")}


@pytest.fixture(scope="module", params=("host", "device-shaped"))
def cluster(request):
    kw = {} if request.param == "host" else {"backend": request.param}
    with NamespacedCluster(BUILD, daemons=3, spare_hosts=1, pool_bytes=128 << 20,
                           node_timeout_ms=2000, heartbeat_ms=250, shared=[ROOT], **kw) as c:
        c.kind = request.param
        c.references = {}
        c.at = list(c.nodes)  # the host each node's daemon is on
        yield c


def reference(cluster, config):
    """The uninterrupted run (redundancy only copies state: parity:2 and replica share it)."""
    if config not in cluster.references:
        ref, procs = launch(cluster, f"ref-{config}-{cluster.kind}", "parity:2", CONFIGS[config])
        finish(procs)
        cluster.references[config] = ref
    return cluster.references[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("redundancy,phase", [("parity:2", "step"), ("replica", "between")])
def test_a_lost_node_is_rebuilt_in_every_configuration(cluster, config, redundancy, phase):
    ref = reference(cluster, config)
    job = f"lost-{config}-{redundancy[:4]}-{cluster.kind}"
    out, _ = lose_node(cluster, job, redundancy, 3, phase, extra=CONFIGS[config])
    assert_same(out, ref, atol=1e-6)
    show = ctl(cluster, "job", "show", job)
    assert "READY" in show and "rebuilds:     1" in show, show
