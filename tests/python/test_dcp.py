"""DCP checkpoints (ragshard.checkpoint.save_dcp / load_dcp) across plans, and their bad input.

tests/python/dcp_ranks.py trains a model with tied embeddings (AdamW in two groups, LambdaLR,
clipping) through ragshard on a global batch that is the same at every world size: 8 steps at
2 daemons x 2 ranks, saving after step 4; then the checkpoint is loaded at 1 daemon x 2 ranks
with another granule, and at 2 x 2 as HSDP (2 shards x 2 replicas), and each runs steps 5-8,
whose losses must be within 1e-5 of the first run's. The FSDP2 directions are
tests/python/test_porting.py's. The rest runs in one process, a job of one rank."""
import json
import os
import subprocess
import sys

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch
import torch.distributed.checkpoint as dcp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ragshard  # noqa: E402
import ragshard.torch as rt  # noqa: E402
from ragshard import checkpoint  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402
from test_optimizers import Net  # noqa: E402
from test_training import LAUNCH, env  # noqa: E402

RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_ranks.py")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        yield c


def launch(cluster, job, sockets, nproc, args, replicate=1):
    r = preloaded.run(LAUNCH + ["--planner", cluster.planner, "--job", job, "--nproc",
                                 str(nproc), "--sockets", ",".join(sockets), "--create-job",
                                 "--replicate", str(replicate), RANKS] + args,
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_checkpoint_loads_under_other_plans(cluster, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    launch(cluster, "dcp-save", cluster.sockets, 4,
           ["--save", ckpt, "--save-after", "4", "--out", str(tmp_path / "a.json")])
    # DCP's own layout: a .metadata and one file per rank that wrote; tied aliases both there.
    assert ".metadata" in os.listdir(ckpt) and not os.path.exists(ckpt + ".partial")
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert "model.tok.weight" in keys and "model.head.weight" in keys
    assert "optim.state.tok.weight.exp_avg" in keys and "sched.last_epoch" in keys
    assert not any(k.startswith("optim.state.head.") for k in keys)  # FSDP2's: first name only
    full = json.load(open(tmp_path / "a.json"))
    for name, sockets, nproc, args, replicate in [
            ("two", cluster.sockets[:1], 2, ["--granule", "element"], 1),
            ("hsdp", cluster.sockets, 4, [], 2)]:
        out = tmp_path / f"{name}.json"
        launch(cluster, f"dcp-load-{name}", sockets, nproc,
               ["--load", ckpt, "--out", str(out)] + args, replicate)
        resumed = json.load(open(out))
        assert sorted(resumed, key=int) == ["5", "6", "7", "8"], resumed
        for step, loss in resumed.items():
            assert abs(loss - full[step]) <= 1e-5 * max(1.0, abs(full[step])), \
                f"{name}: step {step}: {loss} after the load, {full[step]} without"


# -- bad input, in one process ---------------------------------------------------------------


@pytest.fixture
def one_rank(cluster, request):
    def make(suffix, net=None):
        name = f"dcp-{request.node.name[:24]}-{suffix}"
        ragshard.create_job(cluster.planner, name, 1)
        client = ragshard.Client(cluster.planner, cluster.sockets[0], name, 0, cluster.nodes[0],
                                 30000)
        return rt.fully_shard(net or Net(), client, units=lambda m: list(m.layers), world=1)
    return make


def trained(fsdp):
    opt = rt.ShardedAdamW(fsdp, lr=1e-2)
    fsdp(torch.ones(2, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def test_bad_checkpoints_are_refused_by_name_before_anything_is_read(one_rank, tmp_path):
    fsdp = one_rank("a")
    opt = trained(fsdp)
    path = str(tmp_path / "ck")
    checkpoint.save_dcp(fsdp, None, path)  # parameters only
    with pytest.raises(checkpoint.CheckpointError, match="exists; a checkpoint is never "
                                                         "overwritten"):
        checkpoint.save_dcp(fsdp, opt, path)
    before = fsdp.state_dict()
    with pytest.raises(checkpoint.CheckpointError,
                       match="lacks the optimizer state the optimizer needs: optim"):
        checkpoint.load_dcp(fsdp, opt, path)

    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(3))
    other = one_rank("b", Wider())
    with pytest.raises(checkpoint.CheckpointError, match="lacks keys of this model: model.extra"):
        checkpoint.load_dcp(other, None, path)
    wrong = str(tmp_path / "wrong")
    sd = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in Net().state_dict().items()}
    sd["layers.0.0.weight"] = torch.zeros(4, 8)
    dcp.save({"model": sd}, checkpoint_id=wrong, no_dist=True)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"'model.layers.0.0.weight' has shape \[4, 8\] there, \[8, 8\] "
                             r"here; 'model.layers.0.0.bias' is torch.float64 there"):
        checkpoint.load_dcp(fsdp, None, wrong)
    for n, t in fsdp.state_dict().items():  # nothing was loaded
        assert torch.equal(t, before[n]), n
    with pytest.raises(checkpoint.CheckpointError, match="no DCP checkpoint at"):
        checkpoint.load_dcp(fsdp, None, str(tmp_path / "none"))
    with pytest.raises(checkpoint.CheckpointError, match="ShardedShampoo has no DCP layout"):
        checkpoint.save_dcp(fsdp, rt.ShardedShampoo.__new__(rt.ShardedShampoo),
                            str(tmp_path / "s"))


def test_a_failed_save_leaves_no_checkpoint(one_rank, tmp_path, monkeypatch):
    fsdp = one_rank("c")
    opt = trained(fsdp)
    path = str(tmp_path / "ck")

    def full_disk(self, *args):
        raise OSError("No space left on device")
    monkeypatch.setattr(dcp.FileSystemWriter, "finish", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_dcp(fsdp, opt, path)
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")
    monkeypatch.undo()
    checkpoint.save_dcp(fsdp, opt, path)  # the same path, now that nothing is there
    restored = one_rank("d")
    opt2 = rt.ShardedAdamW(restored, lr=1e-2)
    checkpoint.load_dcp(restored, opt2, path)
    for n, t in restored.state_dict().items():
        assert torch.equal(t, fsdp.state_dict()[n]), n
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_the_exchange_takes_plans_through_the_planner_and_nothing_else(one_rank, monkeypatch):
    """save_dcp's plans and results travel through the job's keys on the planner
    (checkpoint/_exchange.py): a value of any bytes round-trips, a large one in pieces; a value
    of another save, a piece changed, and a pickle that would run code are refused by name."""
    import pickle

    from ragshard.checkpoint import _exchange
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
    client = one_rank("x").client
    client.put("raw", b"a\0b\xff")  # the planner's keys hold bytes, NULs included
    assert client.get("raw") == b"a\0b\xff"
    with pytest.raises(ragshard.Error, match="absent"):
        client.get("absent")
    items = [WriteItem(index=MetadataIndex(f"model.w{i}", torch.Size([i, 0]), 0),
                       type=WriteItemType.SHARD,
                       tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([i, 0]),
                                                                        torch.Size([1, 8])),
                                                   TensorProperties(dtype=torch.bfloat16),
                                                   torch.Size([4096, 8])))
             for i in range(4096)]
    plan = SavePlan(items, planner_data={"model.w0": ("model", "w0")})
    monkeypatch.setattr(_exchange, "PIECE", 4096)  # many pieces
    _exchange.post(client, "plan", 3, plan, "/ck/a")
    got = _exchange.fetch(client, "plan", 3, "/ck/a")
    assert got == plan and got.items[7].tensor_data.properties.dtype == torch.bfloat16
    assert client.get("ragshard.ckpt.plan.3.2")  # (a piece)
    with pytest.raises(checkpoint.CheckpointError, match="belongs to the save of '/ck/a', not "
                                                         "of '/ck/b'"):
        _exchange.fetch(client, "plan", 3, "/ck/b")
    piece = client.get("ragshard.ckpt.plan.3.2")
    client.put("ragshard.ckpt.plan.3.2", piece[:-1] + bytes([piece[-1] ^ 1]))
    with pytest.raises(checkpoint.CheckpointError, match=r"plan.3 \(\d+ pieces, \d+ bytes\) "
                                                         "does not match its checksum"):
        _exchange.fetch(client, "plan", 3, "/ck/a")
    with pytest.raises(checkpoint.CheckpointError, match="rank 5's written is not on the "
                                                         "planner"):
        _exchange.fetch(client, "written", 5, "/ck/a")

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("true",))

    class TakesAnAttribute:  # getattr is let through for enums' members only
        def __reduce__(self):
            return (getattr, (torch.Size, "__class__"))
    for evil, named in [(RunsCode(), "'posix.system' is not something a checkpoint's plan "
                                     "holds"),
                        (pickle.loads, "'_pickle.loads' is not something"),
                        (TakesAnAttribute(), "getattr.*is not an enum's member"),
                        (torch.load, "'torch.serialization.load' is not something")]:
        _exchange.post(client, "plan", 0, evil, "/ck/a")
        with pytest.raises(checkpoint.CheckpointError, match=named):
            _exchange.fetch(client, "plan", 0, "/ck/a")
