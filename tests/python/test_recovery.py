"""Recovery in place (docs/recovery.md): a rank of a 2 hosts x 2 ranks training
(examples/train_tiny.py; hosts of their own, ragshard.cluster.NamespacedCluster, one
`ragshard-launch --nnodes 2 --node-rank K` per host) is killed with SIGKILL in the forward, the
backward, the optimizer step or between steps; its host's launcher (--max-restarts 1) restarts
it, the other ranks, on both hosts, exit on their daemons' recovery notice and are restarted by
their own launchers too, every rank attaches again to the state its daemon kept, and the job
goes on from the last completed step, with no checkpoint. The final parameters equal an
uninterrupted run's within 1e-6. Without restarts the loss fails the job on both hosts, named.
Under torchrun likewise: a torchrun per host (static rendezvous, --max-restarts 1).

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import json
import os
import subprocess
import sys
import time
import types

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch
# beside this file; they put the build's package on the path
from cluster_runs import require_namespaces
from host_runs import launchers, outputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

from ragshard.cluster import NamespacedCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch"]
PROFILE = os.path.join(ROOT, "profiles", "host-2x2-loopback.json")  # for policy auto
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "6"]


def hosts(tmp_path_factory, **options):
    """2 daemons on hosts of their own; the tests' temporary directories seen on every host
    (their outputs, marks and checkpoints). Where namespaces cannot be made, the tests on them
    fail or skip (cluster_runs.require_namespaces), not the module (test_recovery_configs
    imports it)."""
    require_namespaces()
    return NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20,
                             shared=[ROOT, str(tmp_path_factory.getbasetemp())], **options)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with hosts(tmp_path_factory, cluster_profile=PROFILE) as c:
        yield c


@pytest.fixture(scope="module")
def device_cluster(tmp_path_factory):
    with hosts(tmp_path_factory, backend="device-shaped") as c:
        yield c


# Imported by every interpreter of a run (the launcher's and the ranks'): any checkpoint load
# raises, so a run that recovers shows it read none.
NO_LOADS = """import ragshard.checkpoint as c


def _refused(*args, **kwargs):
    raise RuntimeError("a checkpoint load during a recovery in place")


c.load = c.load_dcp = _refused
"""


def no_loads(directory):
    """A directory whose sitecustomize makes every checkpoint load raise (for PYTHONPATH)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(NO_LOADS)
    return str(directory)


def env(no_loads_dir=None):
    """The ranks' environment; with `no_loads_dir`, every checkpoint load raises."""
    e = dict(os.environ)
    paths = [os.path.join(BUILD, "python")]
    if no_loads_dir is not None:
        paths.append(no_loads(no_loads_dir))
    e["PYTHONPATH"] = os.pathsep.join(paths + [e.get("PYTHONPATH", "")])
    return e


def run(cluster, tmp_path, job, extra, restarts=1, launch=(), loads=False):
    """The training of `job` over the cluster's 2 daemons x 2 ranks: with `restarts`, recovering
    in place; unless `loads`, a checkpoint load raises. On hosts, one launcher per host, whose
    outputs the result's stderr holds one after the other; its returncode is 0 if each was."""
    out = str(tmp_path / job)
    recovers = ["--max-restarts", str(restarts), "--recovery-deadline", "60"] * bool(restarts)
    script = SMALL + extra
    if not isinstance(cluster, NamespacedCluster):
        cmd = LAUNCH + ["--planner", cluster.planner, "--job", job, "--nproc", "4",
                        "--sockets", ",".join(cluster.sockets), "--create-job", *recovers,
                        *launch, EXAMPLE, "--out", out] + script
        return out, preloaded.run(cmd, env=env(None if loads else tmp_path / "no-loads"),
                                  capture_output=True, text=True, timeout=300)
    got = outputs(launchers(cluster, job, out, enumerate(cluster.nodes), script=script,
                            base=["--preload", "torch", *recovers, *launch],
                            paths=[] if loads else [no_loads(tmp_path / "no-loads")]))
    return out, types.SimpleNamespace(
        returncode=next((rc for rc, _ in got.values() if rc), 0), stdout="",
        stderr="\n".join(f"node rank {k}'s launcher:\n{text}" for k, (_, text) in got.items()),
        launchers={k: text for k, (_, text) in got.items()})


def params(out):
    return torch.load(out + ".pt")


_REFERENCES = {}  # optimizer -> the uninterrupted run's output, once per session


def reference(cluster, tmp_path, optimizer):
    """The same training without a kill (recovery on, so the same journaled steps)."""
    if optimizer not in _REFERENCES:
        out, r = run(cluster, tmp_path, f"ref-{optimizer}", ["--optimizer", optimizer])
        assert r.returncode == 0, r.stdout + r.stderr
        _REFERENCES[optimizer] = out
    return _REFERENCES[optimizer]


def ctl(cluster, *args):
    argv = [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner", cluster.planner,
            "--token-file", cluster.token_file, *args]
    if isinstance(cluster, NamespacedCluster):  # from the planner's host
        return cluster.run("planner", argv, capture_output=True, text=True, timeout=60)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def assert_steps_completed(cluster, job, steps):
    """Every rank's journal, through its daemon's heartbeats, says `steps` steps completed
    (within 30 s: the heartbeats carry it)."""
    deadline = time.time() + 30
    while True:
        why = ctl(cluster, "job", "why", job)
        if f"steps:        {steps} completed by every rank" in why.stdout or \
                time.time() > deadline:
            break
        time.sleep(0.2)
    assert f"steps:        {steps} completed by every rank\n" in why.stdout, \
        why.stdout + why.stderr


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("rank,step,phase", [
    (1, 3, "forward"), (2, 4, "backward"), (3, 3, "step"), (0, 2, "between")])
def test_a_killed_rank_recovers_in_place(cluster, tmp_path, optimizer, rank, step, phase):
    extra = ["--optimizer", optimizer]
    ref = reference(cluster, tmp_path, optimizer)
    mark = str(tmp_path / "killed")
    job = f"kill-{optimizer}-{rank}-{phase}"
    out, r = run(cluster, tmp_path, job, extra + ["--kill-at", f"{rank}:{step}:{phase}:{mark}"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(mark), "the rank was not killed"
    # Its own host's launcher restarted it; the other host's ranks left on their own daemon's
    # notice and were restarted there.
    assert f"rank {rank} exited with -9; restarting it" in r.launchers[rank // 2], r.stderr
    assert "recovery in progress" in r.launchers[1 - rank // 2], r.stderr
    a, b = params(out), params(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), \
            f"{name}: max |delta| {float((a[name] - b[name]).abs().max()):.3g}"
    # The job is READY again, with one recovery in its record.
    show = ctl(cluster, "job", "show", job)
    assert show.returncode == 0, show.stderr
    assert "READY" in show.stdout and "recoveries:   1 recovery" in show.stdout, show.stdout
    # Every rank's journal, through its daemon's heartbeats: all 6 steps completed.
    assert_steps_completed(cluster, job, 6)


def test_a_rank_lost_inside_a_commit_of_several_steps_goes_back_to_its_start(cluster, tmp_path):
    """--steps-per-commit 3 (docs/recovery.md, "Steps per commit"): steps 1-3 are one
    transaction, 4-6 the next. A rank killed in step 5's backward: every rank goes back to the
    end of step 3 (the undo copies of step 4's start), redoes steps 4 to 6, and ends with the
    uninterrupted run's parameters; the journal counts 6 training steps at the end."""
    ref = reference(cluster, tmp_path, "adamw")
    job = "kill-k3"
    out, r = run(cluster, tmp_path, job, ["--optimizer", "adamw", "--kill-at",
                                          f"2:5:backward:{tmp_path / 'k3'}"],
                 launch=["--steps-per-commit", "3"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 2 exited with -9; restarting it" in r.launchers[1], r.stderr
    for rank in range(4):  # every rank's last process went on after step 3
        with open(f"{out}.rank{rank}.json") as f:
            assert json.load(f)["first_step"] == 4, rank
    a, b = params(out), params(ref)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert_steps_completed(cluster, job, 6)


def test_steps_per_commit_is_checked_by_the_launcher(tmp_path):
    for flags, named in ((["--max-restarts", "1", "--steps-per-commit", "0"], "from 1 to"),
                         (["--steps-per-commit", "2"], "needs --max-restarts")):
        r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--standalone", "--nproc",
                            "1", *flags, EXAMPLE], capture_output=True, text=True, timeout=60,
                           env=env())
        assert r.returncode == 2 and named in r.stderr, r.stderr
    # a rank's own reading of it (what the launcher put in its environment)
    from ragshard import _commit
    assert _commit.steps_per_commit({}) == 1
    assert _commit.steps_per_commit({_commit.ENV: "4"}) == 4
    for bad in ("0", "x", str((1 << 20) + 1)):
        with pytest.raises(ValueError, match=f"RAGSHARD_STEPS_PER_COMMIT '{bad}'"):
            _commit.steps_per_commit({_commit.ENV: bad})


# Each layout's launch flags and training flags. HSDP and AMSP train as large models do: bf16
# parameters (fp32 masters in the pool) and gradient accumulation by repeated backward, each
# adding into the gradient shards.
PEOPLE_TRAIN = ["--param-dtype", "bf16", "--accum", "2", "--reduce-every-backward"]
LAYOUTS = {"hsdp": (["--replicate", "2"], PEOPLE_TRAIN), "device-shaped": ([], []),
           # AMSP's separate factors: each rank steps its os range, the update gather spreads it.
           "amsp": (["--policy", "auto", "--strategy", "k=1,p=1x1,g=2x1,os=2x2"], PEOPLE_TRAIN)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_other_layouts_recover_in_place(request, tmp_path, layout):
    """Under HSDP (2 replicas of 2) the ranks agree over the replicas too; on the device-shaped
    plane each rank's unsharded buffers are its own; under AMSP's factors the update gather
    writes the parameter shards inside the step. HSDP and AMSP with bf16 parameters and two
    micro-batches per step, each its own backward that reduce-scatters: the rank is lost in the
    second one's, the first one's gradients already in the shards."""
    c = request.getfixturevalue("device_cluster" if layout == "device-shaped" else "cluster")
    launch, extra = LAYOUTS[layout]
    ref, r = run(c, tmp_path, f"{layout}-ref", extra, launch=launch)
    assert r.returncode == 0, r.stdout + r.stderr
    out, r = run(c, tmp_path, f"{layout}-kill",
                 extra + ["--kill-at", f"2:3:backward:{tmp_path / 'k'}"], launch=launch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 2 exited with -9; restarting it" in r.stderr
    a, b = params(out), params(ref)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name


def test_a_job_resumed_from_a_checkpoint_recovers_at_its_own_step(cluster, tmp_path):
    """A job resumed from a checkpoint of step 2 (docs/recovery.md, "Checkpoints"): the load
    sets the journal's base, so when rank 0 is lost in step 4's forward, the job goes on from
    step 3, not 2, and the restarted rank does not load the checkpoint again. The result is the
    uninterrupted resumed run's, and the daemons count training steps (6, not the 5
    transactions of a load and 4 steps)."""
    ckpt = str(tmp_path / "ckpt")
    _, r = run(cluster, tmp_path, "ckpt-source", ["--save", ckpt, "--save-step", "2"],
               loads=True)
    assert r.returncode == 0, r.stdout + r.stderr
    ref, r = run(cluster, tmp_path, "resumed-ref", ["--resume", ckpt], loads=True)
    assert r.returncode == 0, r.stdout + r.stderr
    mark = str(tmp_path / "killed-resumed")
    out, r = run(cluster, tmp_path, "resumed-kill",
                 ["--resume", ckpt, "--kill-at", f"0:4:forward:{mark}"], loads=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(mark) and "rank 0 exited with -9; restarting it" in r.stderr
    with open(ref + ".json") as f:
        assert json.load(f)["first_step"] == 3  # (the uninterrupted one loaded step 2)
    with open(out + ".json") as f:
        resumed = json.load(f)  # rank 0's, written by its restarted process
    assert resumed["first_step"] == 4, resumed["first_step"]
    assert "loaded" not in resumed["checkpoint"], resumed["checkpoint"]
    a, b = params(out), params(ref)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    deadline = time.time() + 30
    while True:
        why = ctl(cluster, "job", "why", "resumed-kill")
        if "steps:        6 completed by every rank" in why.stdout or time.time() > deadline:
            break
        time.sleep(0.2)
    assert "steps:        6 completed by every rank\n" in why.stdout, why.stdout + why.stderr


def test_two_losses_are_two_recoveries(cluster, tmp_path):
    """Rank 1 lost in step 2, then rank 2 in step 5 (epoch 1, then 2): --max-restarts 1 per
    rank covers both, and the result is the uninterrupted run's."""
    ref = reference(cluster, tmp_path, "adamw")
    out, r = run(cluster, tmp_path, "twice", [
        "--optimizer", "adamw", "--kill-at", f"1:2:backward:{tmp_path / 'k1'}",
        "--kill-at", f"2:5:step:{tmp_path / 'k2'}"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 1 exited with -9; restarting it" in r.stderr
    assert "rank 2 exited with -9; restarting it" in r.stderr
    a, b = params(out), params(ref)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    show = ctl(cluster, "job", "show", "twice")
    assert "recoveries:   2 recoveries" in show.stdout, show.stdout


# A torchrun per host (its static rendezvous at node-0's address; the port is free there: the
# host is the test's own).
MASTER_PORT = "29500"
CREATE_RECOVERING = ("import sys, ragshard; ragshard.create_job(sys.argv[1], sys.argv[2], 4, "
                     "recovery_deadline_ms=60000)")


def torchrun(cluster, tmp_path, job, extra):
    """2 hosts x 2 ranks, a torchrun per host (`--nnodes 2 --node-rank K --max-restarts 1`,
    which replaces both of its workers when one fails), in a job created with a recovery
    deadline. Each host's outcome is checked; the output path."""
    made = cluster.run("planner", [sys.executable, "-c", CREATE_RECOVERING, cluster.planner,
                                   job], env=cluster.env(PYTHONPATH=env()["PYTHONPATH"]),
                       capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    out = str(tmp_path / job)
    e = cluster.env(PYTHONPATH=env()["PYTHONPATH"], RAGSHARD_JOB=job)
    for k in ("RAGSHARD_RANK", "RAGSHARD_WORLD_SIZE", "RAGSHARD_NODE"):
        e.pop(k, None)
    procs = {k: cluster.spawn(host, [sys.executable, "-m", "torch.distributed.run",
                                     "--nnodes", "2", "--node-rank", str(k),
                                     "--nproc-per-node", "2", "--master-addr",
                                     cluster.hosts.address(cluster.nodes[0]), "--master-port",
                                     MASTER_PORT, "--max-restarts", "1", EXAMPLE, "--out", out] +
                              SMALL + extra, env=dict(e, RAGSHARD_SOCKET=cluster.sockets[k]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for k, host in enumerate(cluster.nodes)}
    for k, (rc, text) in outputs(procs).items():
        assert rc == 0, f"node rank {k}'s torchrun: {text[-4000:]}"
    return out


def test_torchrun_restarts_recover_in_place(cluster, tmp_path):
    """Rank 3 (node-1's host) is killed in step 3's optimizer step: its torchrun restarts both
    of its workers, node-0's ranks leave on the recovery notice and their torchrun restarts
    them, and the job goes on from the last completed step."""
    ref = torchrun(cluster, tmp_path, "tr-ref", [])
    out = torchrun(cluster, tmp_path, "tr-kill", ["--kill-at", f"3:3:step:{tmp_path / 'k'}"])
    assert os.path.exists(tmp_path / "k")
    a, b = params(out), params(ref)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert "recoveries:   1 recovery" in ctl(cluster, "job", "show", "tr-kill").stdout


def test_a_rank_that_crashes_recovers_in_place(cluster, tmp_path):
    """A rank that ends on an uncaught exception is lost, not leaving (ragshard's excepthook
    keeps its clients attached to the end): its daemon starts a recovery as for a kill, the
    launcher restarts it (one of its restarts), the others leave on the notice, and the job goes
    on from the last step every rank completed. Before, its exit detached it and the others
    failed on "detached" (docs/recovery.md, "A rank that crashes")."""
    ref = reference(cluster, tmp_path, "adamw")
    mark = str(tmp_path / "raised")
    out, r = run(cluster, tmp_path, "crash",
                 ["--optimizer", "adamw", "--raise-at", f"2:3:forward:{mark}"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(mark), "the rank did not raise"
    assert "RuntimeError: --raise-at: step 3, forward" in r.stderr, r.stderr  # its traceback
    assert "rank 2 exited with 1; restarting it" in r.stderr, r.stderr
    assert "recovery in progress" in r.stderr and "detached" not in r.stderr, r.stderr
    a, b = params(out), params(ref)
    for name in b:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    assert "recoveries:   1 recovery" in ctl(cluster, "job", "show", "crash").stdout


def test_without_restarts_a_lost_rank_fails_the_job_named(cluster, tmp_path):
    mark = str(tmp_path / "killed-nr")
    _, r = run(cluster, tmp_path, "norestart", ["--kill-at", f"1:2:forward:{mark}"], restarts=0)
    assert r.returncode != 0
    # The launcher may see rank 1's SIGKILL first ("rank 1 exited with -9; stopping the
    # others"), or another rank's failure on losing it first ("... stopping the others", then
    # "rank 1 exited with -9 too"): which exit it reaps first is the machine's timing. The other
    # host's launcher stops its ranks too, failing.
    assert "rank 1 exited with -9" in r.stderr and "stopping the others" in r.stderr, r.stderr
    assert "node rank 1's launcher" in r.stderr and r.stderr.count("stopping the others") >= 2, \
        r.stderr


def test_launcher_refuses_bad_recovery_flags(tmp_path):
    base = [sys.executable, "-m", "ragshard.launch", "--standalone", "--nproc", "2"]
    for flags, said in ((["--max-restarts", "-1"], "--max-restarts -1"),
                        (["--recovery-deadline", "5"], "--recovery-deadline needs"),
                        (["--max-restarts", "1", "--recovery-deadline", "0"],
                         "--recovery-deadline 0")):
        r = preloaded.run(base + flags + [EXAMPLE], env=env(), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_a_torchrun_job_recovers_when_the_environment_says_so():
    import ragshard
    base = {"RAGSHARD_PLANNER": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "run"}
    assert ragshard.Env(base).recovery_deadline_s == 0
    assert ragshard.Env(dict(base, RAGSHARD_RECOVERY_DEADLINE_S="90")).recovery_deadline_s == 90
    for bad in ("-1", "abc", "1e9"):
        with pytest.raises(ragshard.Error, match="RAGSHARD_RECOVERY_DEADLINE_S"):
            ragshard.Env(dict(base, RAGSHARD_RECOVERY_DEADLINE_S=bad))
