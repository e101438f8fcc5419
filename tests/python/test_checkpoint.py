"""Checkpoints that reshard (ragshard.checkpoint), through the example on a local planner and
2 daemons: saved at 2 daemons x 2 ranks after step 3 with --global-batch 8, resumed under other
world sizes, granules, HSDP and policy auto to step 6, against the uninterrupted one-process
reference; asynchronous saves; a plain state_dict loaded into a sharded run; a rank killed
with SIGKILL in the middle of a save; export; integrity errors; ragshardctl checkpoint inspect."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from ragshard import checkpoint  # noqa: E402
from ragshard.checkpoint import _format  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
CTL = os.path.join(BUILD, "client", "ragshardctl")
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--vocab", "32",
         "--global-batch", "8", "--quiet"]
OPTIMIZERS = {"adamw": [], "muon": ["--optimizer", "muon"]}


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE) as c:
        yield c


def launch(cluster, out, job, args, nproc=4, daemons=2, launch_args=(), check=True, **envs):
    cmd = [sys.executable, "-m", "ragshard.launch", "--planner", cluster.planner, "--job", job,
           "--nproc", str(nproc), "--sockets", ",".join(cluster.sockets[:daemons]),
           "--create-job", *launch_args, EXAMPLE, "--out", str(out / job)] + SMALL + args
    r = subprocess.run(cmd, env=env(**envs), capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def reference(out, name, args):
    cmd = [sys.executable, EXAMPLE, "--reference", "--world", "1", "--out",
           str(out / name)] + SMALL + args
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(out / name)


def result(path):
    return json.load(open(path + ".json")), torch.load(path + ".pt")


def assert_matches(run, ref, first_step, rtol=1e-5):
    """`run` (resumed at `first_step`) equals the reference's steps from there on, and its
    final parameters equal the reference's."""
    (a, pa), (b, pb) = result(run), result(ref)
    assert a["first_step"] == first_step
    want = b["losses"][first_step - 1:]
    assert len(a["losses"]) == len(want)
    for i, (x, y) in enumerate(zip(a["losses"], want)):
        assert abs(x - y) <= rtol * abs(y), f"step {first_step + i}: loss {x} vs {y}"
    assert pa.keys() == pb.keys()
    for name in pa:
        rel = float((pa[name] - pb[name]).norm() / pb[name].norm().clamp_min(1e-12))
        assert rel <= rtol, f"{name}: |delta|/|p| = {rel:.3g}"


@pytest.fixture(scope="module")
def saved(cluster, tmp_path_factory):
    """For each optimizer: a checkpoint saved at 2 x 2 after step 3, and the reference run to
    step 6."""
    out = tmp_path_factory.mktemp("saved")
    runs = {}
    for opt, flags in OPTIMIZERS.items():
        root = out / f"ckpt-{opt}"
        launch(cluster, out, f"save-{opt}", ["--steps", "3", "--save", str(root),
                                             "--save-step", "3"] + flags)
        runs[opt] = {"root": str(root), "run": str(out / f"save-{opt}"),
                     "ref": reference(out, f"ref-{opt}", ["--steps", "6"] + flags)}
    return runs


RESUMES = {
    "1x2": dict(nproc=2, daemons=1),
    "1x1": dict(nproc=1, daemons=1),
    "2x2-rows1": dict(args=["--granule", "rows:1"]),
    "2x2-hsdp": dict(launch_args=["--replicate", "2"]),
    "2x2-auto": dict(launch_args=["--policy", "auto"]),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("where", list(RESUMES))
def test_resume_under_another_plan_equals_the_reference(cluster, saved, tmp_path, opt, where):
    spec = dict(RESUMES[where])
    args = ["--steps", "6", "--resume", saved[opt]["root"]] + spec.pop("args", []) + \
        OPTIMIZERS[opt]
    job = f"resume-{opt}-{where}"
    launch(cluster, tmp_path, job, args, **spec)
    assert_matches(str(tmp_path / job), saved[opt]["ref"], first_step=4)
    nproc = spec.get("nproc", 4)
    if nproc > 1:
        # No rank reads the whole model: each reads the chunks its own pieces need.
        stored = sum(os.path.getsize(os.path.join(saved[opt]["root"], "step_00000003", f))
                     for f in os.listdir(os.path.join(saved[opt]["root"], "step_00000003"))
                     if f.endswith(".bin"))
        reads = [json.load(open(f"{tmp_path / job}.rank{r}.json"))["checkpoint"]
                 ["load_bytes_read"] for r in range(nproc)]
        assert max(reads) < stored, (reads, stored)


def test_the_saving_run_equals_the_reference_to_its_step(saved):
    run, ref = result(saved["adamw"]["run"]), result(saved["adamw"]["ref"])
    assert run[0]["first_step"] == 1
    for x, y in zip(run[0]["losses"], ref[0]["losses"][:3]):
        assert abs(x - y) <= 1e-5 * abs(y)


def test_async_save_overlapping_the_next_step_holds_that_step(cluster, saved, tmp_path):
    root = tmp_path / "async"
    launch(cluster, tmp_path, "async", ["--steps", "6", "--save", str(root), "--save-step", "3",
                                        "--async-save"])
    # Training was not disturbed: all 6 steps equal the reference.
    assert_matches(str(tmp_path / "async"), saved["adamw"]["ref"], first_step=1)
    # The checkpoint holds the state after step 3 (that of the synchronous save), not later.
    got = checkpoint.export_state_dict(str(root))
    want = checkpoint.export_state_dict(saved["adamw"]["root"])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    meta = _format.read_metadata(_format.resolve(str(root)))
    assert meta["step"] == 3
    launch(cluster, tmp_path, "async-resume", ["--steps", "6", "--resume", str(root)])
    assert_matches(str(tmp_path / "async-resume"), saved["adamw"]["ref"], first_step=4)


def test_a_plain_state_dict_loads_into_a_sharded_run(cluster, saved, tmp_path):
    # The reference's parameters after 3 steps, as torch.save of the plain model.
    reference(tmp_path, "ref-3", ["--steps", "3"])
    plain = str(tmp_path / "ref-3.pt")
    launch(cluster, tmp_path, "plain", ["--steps", "4", "--load-state", plain])
    ref = reference(tmp_path, "plain-ref", ["--steps", "4", "--load-state", plain])
    assert_matches(str(tmp_path / "plain"), ref, first_step=1)


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(cluster, saved, tmp_path):
    root = tmp_path / "killed"
    r = launch(cluster, tmp_path, "killed", ["--steps", "6", "--save", str(root),
                                             "--save-step", "2,4"], check=False,
               RAGSHARD_CHECKPOINT_FAULT="pos=1,step=4,bytes=4096")
    assert r.returncode != 0 and "-9" in r.stderr, r.stderr
    assert open(root / "latest").read().strip() == "step_00000002"
    partial = root / ".step_00000004.partial"
    assert (partial / "rank00001.bin").exists()
    with pytest.raises(checkpoint.CheckpointError, match="incomplete checkpoint"):
        checkpoint.export_state_dict(str(partial))
    bad = subprocess.run([sys.executable, "-m", "ragshard.checkpoint", "export", str(partial),
                          "--out", str(tmp_path / "x.pt")], env=env(), capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "incomplete checkpoint" in bad.stderr
    # The previous checkpoint (step 2) resumes to step 6 equal to the reference.
    launch(cluster, tmp_path, "after-kill", ["--steps", "6", "--resume", str(root)])
    assert_matches(str(tmp_path / "after-kill"), saved["adamw"]["ref"], first_step=3)


def test_export_round_trips_into_the_plain_model(saved, tmp_path):
    out = tmp_path / "plain.pt"
    r = subprocess.run([sys.executable, "-m", "ragshard.checkpoint", "export",
                        saved["adamw"]["root"], "--out", str(out)], env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import train_tiny
    model = train_tiny.TinyLM(32, 64, 2, 4, 16)
    model.load_state_dict(torch.load(out))  # strict: every parameter, nothing else
    full = torch.load(saved["adamw"]["run"] + ".pt")  # full_state() after step 3
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), full[name]), name


def corrupt_copy(saved, tmp_path, name, how):
    root = tmp_path / name
    shutil.copytree(saved["adamw"]["root"], root)
    path = root / "step_00000003" / "rank00001.bin"
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    return root


@pytest.mark.parametrize("how,what", [("flip", "corrupted"), ("truncate", "truncated")])
def test_a_damaged_file_names_the_file_and_the_tensor(saved, tmp_path, how, what):
    root = corrupt_copy(saved, tmp_path, how, how)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.export_state_dict(str(root))
    msg = str(e.value)
    assert "rank00001.bin" in msg and what in msg and "tensor '" in msg, msg
    r = subprocess.run([CTL, "checkpoint", "inspect", str(root)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "rank00001.bin" in r.stdout + r.stderr and what in r.stdout + r.stderr


def test_reader_reads_only_the_chunks_a_range_needs(tmp_path):
    chunk = _format.CHUNK_BYTES
    data = torch.arange(3 * chunk // 4 + 100, dtype=torch.float32)  # 3 chunks and a bit
    entries = _format.write_pieces(str(tmp_path / "rank00000.bin"), [
        ("w\0param", 10, data.numel(), "fp32", memoryview(data.view(torch.uint8).numpy()))])
    e = entries[0]
    meta = {"tensors": {"w": {"shape": [data.numel() + 10], "param": {
        "dtype": "fp32", "pieces": [dict(file="rank00000.bin", offset=e["offset"],
                                         start=e["start"], count=e["count"],
                                         crc32=e["crc32"])]}}}}
    with _format.Reader(str(tmp_path), meta) as reader:
        lo = 10 + chunk // 4 - 5  # the last elements of chunk 0 and the first of chunk 1
        got, dt = reader.read("w", "param", lo, lo + 10)
        assert torch.equal(torch.frombuffer(got, dtype=torch.float32), data[lo - 10:lo])
        assert reader.bytes_read == 2 * chunk
    with _format.Reader(str(tmp_path), meta) as reader:
        with pytest.raises(checkpoint.CheckpointError, match="not all stored"):
            reader.read("w", "param", 0, 20)


def test_ctl_inspect_lists_the_tensors_and_checks_them(saved):
    r = subprocess.run([CTL, "checkpoint", "inspect", saved["adamw"]["root"]],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step 3" in r.stdout and "layers.0.qkv.weight" in r.stdout and "OK" in r.stdout
    j = subprocess.run([CTL, "checkpoint", "inspect", saved["adamw"]["root"], "--json"],
                       capture_output=True, text=True, timeout=120)
    assert j.returncode == 0, j.stderr
    info = json.loads(j.stdout)
    assert info["step"] == 3 and info["world"] == 4 and info["integrity"] == "ok"
    names = {t["name"] for t in info["tensors"]}
    assert "tok.weight" in names and len(names) == 2 * 11 + 5
    missing = subprocess.run([CTL, "checkpoint", "inspect", "/nonexistent/ckpt"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "/nonexistent/ckpt" in missing.stderr


def test_load_errors_name_what_is_wrong(cluster, saved, tmp_path):
    # Another model (wider): the shapes differ, and the error names the tensor.
    r = launch(cluster, tmp_path, "wrong-model", ["--steps", "4", "--dim", "128", "--resume",
                                                  saved["adamw"]["root"]], check=False)
    assert r.returncode != 0, r.stderr
    assert re.search(r"tensor '[\w.]+' has shape \[[\d, ]+\] there, \[[\d, ]+\] here",
                     r.stderr), r.stderr
    # Muon state into AdamW.
    r = launch(cluster, tmp_path, "wrong-opt", ["--steps", "4", "--resume",
                                                saved["muon"]["root"]], check=False)
    assert r.returncode != 0 and "holds muon optimizer state" in r.stderr, r.stderr
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint directory"):
        _format.resolve(str(tmp_path / "none"))


def test_the_optimizer_step_waits_for_an_asynchronous_write():
    """The fence of an asynchronous save: the optimizer's step (which changes the shards that
    the save's thread is writing) waits until this rank's part is written."""
    import threading
    import types
    from ragshard.torch import ShardedAdamW, ShardedModule
    release = threading.Event()
    handle = checkpoint.SaveHandle(write=release.wait, commit=lambda: "committed")
    model = types.SimpleNamespace(units=lambda: [], masters={}, has_grad=[],
                                  checkpoint_writing=handle)
    model.wait_for_checkpoint_write = lambda: ShardedModule.wait_for_checkpoint_write(model)
    opt = ShardedAdamW(model)
    stepped = threading.Thread(target=opt.step)
    stepped.start()
    stepped.join(0.5)
    assert stepped.is_alive(), "the step ran while the save was writing"
    release.set()
    stepped.join(60)
    assert not stepped.is_alive()
    assert handle.result(60) == "committed" and model.checkpoint_writing is None
    # A failed write is raised at the next step, not lost.
    failing = checkpoint.SaveHandle(write=lambda: (_ for _ in ()).throw(OSError("disk full")),
                                    commit=lambda: None)
    model.checkpoint_writing = failing
    with pytest.raises(OSError, match="disk full"):
        opt.step()


@pytest.mark.parametrize("edit,what", [
    (lambda m: m.update(chunk_bytes=1 << 62), "chunk_bytes"),
    (lambda m: next(iter(m["tensors"].values()))["param"]["pieces"][0].update(count=1 << 60),
     "out of range|truncated"),
    (lambda m: next(iter(m["tensors"].values()))["param"]["pieces"][0].update(offset=-5),
     "out of range"),
])
def test_hostile_metadata_gets_a_clear_error(saved, tmp_path, edit, what):
    """Sizes in a metadata file are checked before anything is allocated or read."""
    root = tmp_path / "hostile"
    shutil.copytree(saved["adamw"]["root"], root)
    path = root / "step_00000003" / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=what):
        checkpoint.export_state_dict(str(root))
    r = subprocess.run([CTL, "checkpoint", "inspect", str(root)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode in (1, 2), r.stdout + r.stderr
    assert re.search(what, r.stderr), r.stderr
