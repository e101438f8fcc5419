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
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from ragshard import checkpoint  # noqa: E402
from ragshard.checkpoint import _format  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402
# The ranks import the tests' fault hooks (fault_hooks.py: RAGSHARD_CHECKPOINT_FAULT and
# RAGSHARD_CHECKPOINT_WRITE_HOLD).
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch,fault_hooks"]

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
CTL = os.path.join(BUILD, "ctl", "ragshardctl")
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--vocab", "32",
         "--global-batch", "8", "--quiet"]
# Shampoo blocked (48 x 48 blocks, partial ones at the edges of every matrix), its roots
# recomputed at steps 1, 3 and 5: the resume at step 4 uses the roots saved at step 3.
OPTIMIZERS = {"adamw": [], "muon": ["--optimizer", "muon"],
              "shampoo": ["--optimizer", "shampoo", "--precondition-every", "2",
                          "--shampoo-block", "48"]}
RTOL = {"shampoo": 1e-4}


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                       os.path.dirname(os.path.abspath(__file__)),
                                       e.get("PYTHONPATH", "")])
    e.update(extra)
    return e


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, cluster_profile=PROFILE) as c:
        yield c


def launch(cluster, out, job, args, nproc=4, daemons=2, launch_args=(), check=True, **envs):
    cmd = LAUNCH + ["--planner", cluster.planner, "--job", job,
                    "--nproc", str(nproc), "--sockets", ",".join(cluster.sockets[:daemons]),
                    "--create-job", *launch_args, EXAMPLE, "--out", str(out / job)] + SMALL + args
    r = preloaded.run(cmd, env=env(**envs), capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def reference(out, name, args):
    cmd = [sys.executable, EXAMPLE, "--reference", "--world", "1", "--out",
           str(out / name)] + SMALL + args
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
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
    # Built on the meta device: the shards' values come only from the checkpoint.
    "2x2-meta": dict(args=["--meta-init"]),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("where", list(RESUMES))
def test_resume_under_another_plan_equals_the_reference(cluster, saved, tmp_path, opt, where):
    spec = dict(RESUMES[where])
    args = ["--steps", "6", "--resume", saved[opt]["root"]] + spec.pop("args", []) + \
        OPTIMIZERS[opt]
    job = f"resume-{opt}-{where}"
    launch(cluster, tmp_path, job, args, **spec)
    assert_matches(str(tmp_path / job), saved[opt]["ref"], first_step=4,
                   rtol=RTOL.get(opt, 1e-5))
    # Each rank reads exactly the chunks of the stored pieces that overlap its own pieces under
    # the new plan (for every record: parameters, moments, momentum), no more.
    nproc = spec.get("nproc", 4)
    path = os.path.join(saved[opt]["root"], "step_00000003")
    meta = _format.read_metadata(path)
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in meta["files"])
    ranks = [json.load(open(f"{tmp_path / job}.rank{r}.json"))["checkpoint"]
             for r in range(nproc)]
    reads = [c["load_bytes_read"] for c in ranks]
    want = [bytes_to_read(meta, c["layout"]) for c in ranks]
    assert reads == want, (reads, want, stored)
    # The optimizer ranges (the shard group when p = g = os): 2 at 1 x 2 and under HSDP (2
    # replicas of 2), 4 at 2 x 2, 1 at 1 x 1; policy auto chooses its own.
    group = len({c["layout"]["pos"] for c in ranks})
    assert {c["layout"]["pos"] for c in ranks} == set(range(group))
    assert group == {"1x2": 2, "1x1": 1, "2x2-rows1": 4, "2x2-hsdp": 2}.get(where, group)
    if group > 1:  # no rank reads the whole model
        assert max(reads) < stored, (reads, stored)
    else:  # one range: the whole model (a replica that shares a stepper's memory reads none)
        assert max(reads) == stored, (reads, stored)


def test_resume_from_one_strategy_to_another_equals_the_reference(cluster, saved, tmp_path):
    """Saved under one AMSP strategy (parameters replicated, gradients within a node, optimizer
    state over all four ranks), resumed under another (two layers per unit, parameters within
    a node, gradients and optimizer state over all): the tensors on disk are the same whatever
    the factors, and the run goes on equal to the reference."""
    opt = "muon"
    root = tmp_path / "ckpt-amsp"
    launch(cluster, tmp_path, "save-amsp", ["--steps", "3", "--save", str(root), "--save-step",
                                            "3"] + OPTIMIZERS[opt],
           launch_args=["--policy", "auto", "--strategy", "k=1,p=1x1,g=2x1,os=2x2"])
    run, ref = result(str(tmp_path / "save-amsp")), result(saved[opt]["ref"])
    for i, (x, y) in enumerate(zip(run[0]["losses"], ref[0]["losses"][:3])):
        assert abs(x - y) <= 1e-5 * abs(y), f"step {i + 1}: loss {x} vs {y}"
    launch(cluster, tmp_path, "resume-amsp", ["--steps", "6", "--resume", str(root)] +
           OPTIMIZERS[opt],
           launch_args=["--policy", "auto", "--strategy", "k=2,p=2x1,g=2x2,os=2x2"])
    assert_matches(str(tmp_path / "resume-amsp"), saved[opt]["ref"], first_step=4)
    # The four writers were the optimizer ranges, one file each.
    meta = _format.read_metadata(os.path.join(str(root), "step_00000003"))
    assert len(meta["files"]) == 4


def bytes_to_read(meta, layout):
    """The bytes a load reads on a rank that holds `layout` (train_tiny's: its optimizer range's
    position, and each unit's range size and tensor offsets): for each tensor, the rank's flat
    elements
    [max(off, pos*S) - off, min(off + numel, (pos+1)*S) - off), and for each stored record of
    it, the whole chunks of every stored piece that overlap them; buffers are read whole."""
    chunk = meta["chunk_bytes"]
    mine = {}
    pos = layout["pos"]
    # A rank whose range another local rank loads (into memory both share) reads only buffers.
    for u in layout["units"] if layout.get("steps", True) else ():
        lo, hi = pos * u["shard_elems"], (pos + 1) * u["shard_elems"]
        for name, off, numel in u["tensors"]:
            if max(off, lo) < min(off + numel, hi):
                mine[name] = (max(off, lo) - off, min(off + numel, hi) - off)
    for name, t in meta["tensors"].items():
        if "buffer" in t:
            mine[name] = (0, int(torch.Size(t["shape"]).numel()))
    for name in layout["owned"]:  # Shampoo's preconditioners, whole, on their new owner
        key = name + "#shampoo"
        if key in meta["tensors"]:
            mine[key] = (0, int(meta["tensors"][key]["shape"][0]))
    total = 0
    for name, (lo, hi) in mine.items():
        for kind, rec in meta["tensors"][name].items():
            if kind == "shape":
                continue
            item = _format.DTYPES[rec["dtype"]][1]
            for p in rec["pieces"]:
                a, b = max(lo, p["start"]), min(hi, p["start"] + p["count"])
                if a < b:
                    first = (a - p["start"]) * item // chunk
                    last = ((b - p["start"]) * item - 1) // chunk
                    total += min((last + 1) * chunk, p["count"] * item) - first * chunk
    return total


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_the_saving_run_equals_the_reference_to_its_step(saved, opt):
    run, ref = result(saved[opt]["run"]), result(saved[opt]["ref"])
    assert run[0]["first_step"] == 1 and len(run[0]["losses"]) == 3
    for i, (x, y) in enumerate(zip(run[0]["losses"], ref[0]["losses"][:3])):
        assert abs(x - y) <= RTOL.get(opt, 1e-5) * abs(y), f"step {i + 1}: loss {x} vs {y}"


def assert_same_checkpoint(got_root, want_root):
    """The checkpoints hold the same step, optimizer kind and step counts, tensors and records,
    and every record the same bytes. Returns the kinds of record compared."""
    gp, wp = _format.resolve(got_root), _format.resolve(want_root)
    got, want = _format.read_metadata(gp), _format.read_metadata(wp)
    assert got["step"] == want["step"]
    assert got["optimizer"] == want["optimizer"]  # the kind, and every parameter's step count
    kinds = lambda m: {n: sorted(t) for n, t in m["tensors"].items()}  # noqa: E731
    assert kinds(got) == kinds(want)
    compared = set()
    with _format.Reader(gp, got) as rg, _format.Reader(wp, want) as rw:
        for name, t in want["tensors"].items():
            numel = int(torch.Size(t["shape"]).numel())
            for kind in t:
                if kind == "shape":
                    continue
                (a, da), (b, db) = rg.read(name, kind, 0, numel), rw.read(name, kind, 0, numel)
                same = da == db and bytes(a) == bytes(b)  # no dump of the bytes on failure
                assert same, f"tensor '{name}' ({kind}) differs"
                compared.add(kind)
    return compared


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_async_save_overlapping_the_next_step_holds_that_step(cluster, saved, tmp_path, opt):
    root, job = tmp_path / "async", f"async-{opt}"
    # The hook holds each rank's write after its first piece until the optimizer's step 4
    # waits for it: the write spans step 4's forward and backward.
    launch(cluster, tmp_path, job, ["--steps", "6", "--save", str(root), "--save-step", "3",
                                    "--async-save"] + OPTIMIZERS[opt],
           RAGSHARD_CHECKPOINT_WRITE_HOLD="1")
    for r in range(4):
        phases = json.load(open(f"{tmp_path / job}.rank{r}.json"))["checkpoint"][
            "save_phases"]
        assert phases[0].get("write_held") is True, (r, phases)
    # Training was not disturbed: all 6 steps equal the reference.
    assert_matches(str(tmp_path / job), saved[opt]["ref"], first_step=1,
                   rtol=RTOL.get(opt, 1e-5))
    # The checkpoint holds the state after step 3, not later: every record equals that of the
    # synchronous save at step 3 (the same plan), byte for byte.
    compared = assert_same_checkpoint(str(root), saved[opt]["root"])
    assert {"param", "exp_avg", "exp_avg_sq"} <= compared, compared
    assert ("muon_momentum" in compared) == (opt == "muon"), compared
    assert ({"shampoo_momentum", "shampoo"} <= compared) == (opt == "shampoo"), compared
    meta = _format.read_metadata(_format.resolve(str(root)))
    assert meta["step"] == 3 and set(meta["optimizer"]["steps"].values()) == {3.0}
    if opt == "adamw":
        launch(cluster, tmp_path, "async-resume", ["--steps", "6", "--resume", str(root)])
        assert_matches(str(tmp_path / "async-resume"), saved[opt]["ref"], first_step=4)


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


def test_shampoo_preconditioners_are_tensors_of_their_own(cluster, saved, tmp_path):
    """Each matrix's preconditioners (every block's L, R and their roots) are one record that
    its owner wrote; inspect lists and checks them, export leaves them out, and a load under
    another block side is refused naming the matrix."""
    root = saved["shampoo"]["root"]
    j = subprocess.run([CTL, "checkpoint", "inspect", root, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert j.returncode == 0, j.stderr
    info = json.loads(j.stdout)
    assert info["integrity"] == "ok" and info["optimizer"] == "shampoo", info
    state = {t["name"]: t["kinds"] for t in info["tensors"] if t["name"].endswith("#shampoo")}
    matrices = [f"layers.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "up", "down")]
    assert state == {m + "#shampoo": "shampoo" for m in matrices}, state
    meta = _format.read_metadata(_format.resolve(root))
    # qkv 192 x 64 in 48 x 48 blocks: 4 x 2 blocks of 48 x 48 and 48 x 16.
    blocks = 4 * (48 * 48 + 48 * 48 + 48 * 48 + 48 * 48) + 4 * (48 * 48 + 16 * 16) * 2
    assert meta["tensors"]["layers.0.qkv.weight#shampoo"]["shape"] == [blocks]
    assert meta["optimizer"]["steps"]["layers.0.qkv.weight#shampoo"] == 3.0
    exported = checkpoint.export_state_dict(root)
    assert not [n for n in exported if "#" in n] and "layers.0.qkv.weight" in exported
    r = launch(cluster, tmp_path, "wrong-block", ["--steps", "4", "--resume", root,
                                                  "--optimizer", "shampoo",
                                                  "--shampoo-block", "32"], check=False)
    assert r.returncode != 0, r.stderr
    assert re.search(r"Shampoo's state of 'layers\.\d\.\w+\.weight' has \d+ elements there, "
                     r"\d+ here \(saved with another block side\? this plan's is 32\)",
                     r.stderr), r.stderr


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
    p = torch.nn.Parameter(torch.zeros(1))  # a parameter with no piece on this rank
    import contextlib
    # What an optimizer calls of a ShardedModule (its recovery's declared interface included).
    model = types.SimpleNamespace(units=lambda: [], masters={}, has_grad=[False], steps=True,
                                  gather_updates=lambda: None, checkpoint_writing=handle,
                                  parameters=lambda: [p], is_param=lambda q: q is p,
                                  param_index=lambda q: 0,
                                  recovery=types.SimpleNamespace(enabled=False, state_in_place=False),
                                  optimizer_step=contextlib.nullcontext)
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


def stage(saved, root, step):
    """What the 4 ranks of a save of step `step` leave under `root` for rank 0's commit: their
    data files and indexes (those of the saved checkpoint) in the partial directory."""
    src = os.path.join(saved["adamw"]["root"], "step_00000003")
    partial = os.path.join(root, _format.partial_dir_name(step))
    os.makedirs(partial)
    for f in os.listdir(src):
        if f.startswith("rank"):
            shutil.copy(os.path.join(src, f), partial)
    return partial


def commit(saved, root, step, partial=None):
    """Rank 0's commit of a save of step `step` (staged unless `partial` is given)."""
    partial = partial or stage(saved, root, step)
    return checkpoint._commit(root, partial, step, 4, {}, time.monotonic() + 60,
                              _format.new_dir_name(root, step))


def latest(root):
    return open(os.path.join(root, "latest")).read().strip()


def test_a_second_save_of_a_step_keeps_latest_loadable_at_every_instant(saved, tmp_path,
                                                                         monkeypatch):
    root = str(tmp_path / "ckpt")
    assert commit(saved, root, 3) == os.path.join(root, "step_00000003")
    partial = stage(saved, root, 3)
    # After every rename, replace and removal of the second commit, `latest` names a complete
    # checkpoint of step 3 (a crash between any two of them leaves one that loads).
    seen = []

    def checked(fn):
        def run(*a, **k):
            out = fn(*a, **k)
            path = _format.resolve(root)
            assert _format.read_metadata(path)["step"] == 3, (fn.__name__, a)
            checkpoint.export_state_dict(path)  # every record reads and checks
            seen.append((fn.__name__, os.path.basename(path)))
            return out
        return run
    with monkeypatch.context() as m:
        for mod, fn in ((os, "rename"), (os, "replace"), (shutil, "rmtree")):
            m.setattr(mod, fn, checked(getattr(mod, fn)))
        second = commit(saved, root, 3, partial)
    assert second == os.path.join(root, "step_00000003.1")
    assert {n for _, n in seen} == {"step_00000003", "step_00000003.1"}, seen
    assert ("rmtree", "step_00000003.1") in seen  # the old copy went after latest moved
    assert latest(root) == "step_00000003.1" and not os.path.exists(
        os.path.join(root, "step_00000003"))
    assert _format.resolve(root, 3) == second
    # A crash before the older copy went leaves both: a load of the step takes the newer.
    shutil.copytree(second, os.path.join(root, "step_00000003"))
    assert _format.resolve(root, 3) == second
    assert commit(saved, root, 3) == os.path.join(root, "step_00000003.2")
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000003.2"]


def test_a_late_commit_of_an_earlier_step_leaves_latest_at_the_later_one(saved, tmp_path):
    root = str(tmp_path / "ckpt")
    commit(saved, root, 4)
    assert commit(saved, root, 3) == os.path.join(root, "step_00000003")  # finished last
    assert latest(root) == "step_00000004"
    assert _format.read_metadata(_format.resolve(root))["step"] == 4
    assert _format.read_metadata(_format.resolve(root, 3))["step"] == 3
    commit(saved, root, 4)  # a second save of the newest step moves latest
    assert latest(root) == "step_00000004.1"


def test_a_commit_refuses_pieces_with_a_gap_and_an_overlap(saved, tmp_path):
    """A piece split in two halves that both hold the first half: the element count is right,
    but the second half is missing and the first stored twice."""
    root = str(tmp_path / "ckpt")
    partial = stage(saved, root, 3)
    path = os.path.join(partial, _format.index_file(1))
    idx = json.load(open(path))
    i, e = next((i, e) for i, e in enumerate(idx["pieces"])
                if e["kind"] == "param" and e["count"] % 2 == 0)
    half = dict(e, count=e["count"] // 2)
    idx["pieces"][i:i + 1] = [half, dict(half)]
    with open(path, "w") as f:
        json.dump(idx, f)
    with pytest.raises(checkpoint.CheckpointError,
                       match=re.escape(f"tensor '{e['name']}' (param): an overlap at element")):
        commit(saved, root, 3, partial)
    assert not os.path.exists(os.path.join(root, "latest"))
    assert not os.path.exists(os.path.join(root, "step_00000003"))


def first_piece(meta):
    """The first piece of the first tensor's parameter in a metadata file."""
    return next(iter(meta["tensors"].values()))["param"]["pieces"][0]


@pytest.mark.parametrize("edit,what", [
    (lambda m: m.update(chunk_bytes=1 << 62), "chunk_bytes"),
    (lambda m: first_piece(m).update(count=1 << 60), "out of range|truncated"),
    (lambda m: first_piece(m).update(offset=-5), "out of range"),
    (lambda m: first_piece(m).update(crc32=first_piece(m)["crc32"][:-1]),
     r"tensor '[\w.]+' \(param\): the metadata lists no CRC for every chunk"),
    (lambda m: first_piece(m).pop("crc32"),
     r"tensor '[\w.]+' \(param\): the metadata lists no CRC for every chunk"),
    (lambda m: first_piece(m).update(file="../rank00001.bin"),
     r"tensor '[\w.]+' \(param\) names no valid file"),
    (lambda m: first_piece(m).update(file=".."),
     r"tensor '[\w.]+' \(param\) names no valid file"),
    (lambda m: first_piece(m).update(file="rank09999.bin"),
     r"rank09999\.bin: missing: tensor '[\w.]+' \(param\) is stored there"),
], ids=["chunk", "count", "offset", "short-crc", "no-crc", "path", "dotdot",
                              "missing-file"])
def test_hostile_metadata_gets_a_clear_error(saved, tmp_path, edit, what):
    """Sizes, names and checksum lists in a metadata file are checked before anything is
    allocated or read; the error names the tensor."""
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
