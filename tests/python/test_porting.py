"""Issue 50's porting acceptance through examples/train_hf.py, whose two paths differ only in
the lines marked PORT: the same Hugging Face `transformers` model (random init from a config),
data and recipe (AdamW with decay and no-decay groups, LambdaLR warmup then cosine, global-norm
clipping at 1.0, fp32) under torch's FSDP2 (gloo on a CPU mesh) and under ragshard.

* Recipe parity: a Llama with tied embeddings and a Mixtral-style top-2 MoE, 8 steps, ragshard
  at 2 hosts x 2 ranks (hosts of their own, ragshard.cluster.NamespacedCluster: one
  `ragshard-launch --nnodes 2 --node-rank K` per host) against FSDP2 at 4 ranks (gloo, one
  host): every step's loss within 1e-5 of FSDP2's.
* Cross checkpoints (the Llama): ragshard at W=4 writes a DCP checkpoint with save_dcp after
  step 4 and FSDP2 at W=2 continues it (dcp.load, set_model_state_dict,
  set_optimizer_state_dict); FSDP2 at W=4 writes one with dcp.save after step 4 and ragshard at
  W=2 (1 host x 2 ranks) continues it with load_dcp. Steps 5 to 8 match the writer's own.
  The scheduler and the step ride in the checkpoint as extra Stateful entries.

Six runs cover the tests: the 8-step Llama runs of each backend at W=4 also write the
checkpoints after step 4 and are the references of the runs that continue them. Each run is one
process group: FSDP2's ranks are forked from one launcher that imported torch and transformers
once (tests/python/test_porting.py --fsdp2-launch, through tests/python/fsdp2_launcher.py),
ragshard's by ragshard.launch --preload on each host.
Every run has a timeout and its whole process group is killed on the way out.

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import host_runs  # noqa: E402  (beside this file, as those below)
from cluster_runs import require_namespaces  # noqa: E402
from fsdp2_launcher import fsdp2_launch  # noqa: E402  (--fsdp2-launch below)
from test_fsdp2 import env  # noqa: E402  (ranks' environment: no torchrun variables)

from ragshard.cluster import NamespacedCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
# Imported once by each launcher, before it forks the ranks (seconds of CPU per rank saved).
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "transformers.models.llama.modeling_llama",
           "transformers.models.mixtral.modeling_mixtral"]
STEPS = 8
SAVE_AFTER = 4
TOL = 1e-5  # |a - b| <= TOL * max(1, |b|)
TIMEOUT = 600  # seconds for one run, generous for a loaded 2-core machine


def run_group(cmd, log):
    """Runs `cmd` in a session of its own, its output in `log`; on a timeout or any error the
    whole session (the launcher and the ranks it forked) is killed."""
    with open(log, "w+") as f:
        p = subprocess.Popen(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            p.wait(timeout=TIMEOUT)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # ranks left behind, if any
            except ProcessLookupError:
                pass
            p.wait()
        f.seek(0)
        text = f.read()
    assert p.returncode == 0, f"{' '.join(cmd)}\nexited with {p.returncode}:\n{text[-6000:]}"
    return text


def run_fsdp2(work, name, world, args):
    out = os.path.join(work, name)
    cmd = [sys.executable, os.path.abspath(__file__), "--fsdp2-launch", str(world), EXAMPLE,
           "--backend", "fsdp2", "--store", out + ".store", "--out", out, "--quiet"] + args
    run_group(cmd, out + ".log")
    return json.load(open(out + ".json"))


def launch_on_hosts(c, job, nproc, nnodes, argv):
    """`job` over `nproc` ranks on the first `nnodes` hosts of cluster `c`: one ragshard.launch
    per host (--nnodes N --node-rank K) running `argv`, each forked from the tests' preloaded
    interpreter in its host's namespaces; each host's (exit code, output), in order."""
    procs = {k: host_runs.spawn(c, c.nodes[k], ["-m", "ragshard.launch", "--preload",
                                                ",".join(PRELOAD), "--planner", c.planner,
                                                "--job", job, "--create-job", "--nproc",
                                                str(nproc), "--nnodes", str(nnodes),
                                                "--node-rank", str(k), "--sockets",
                                                c.sockets[k], "--nodes", c.nodes[k]] + argv,
                                PYTHONPATH=env()["PYTHONPATH"], PYTHONFAULTHANDLER="1")
             for k in range(nnodes)}
    got = host_runs.outputs(procs, TIMEOUT)
    return [got[k] for k in range(nnodes)]


def run_ragshard(cluster, work, name, world, daemons, args):
    """train_hf under ragshard as `name`: `world` ranks on the first `daemons` hosts; its
    record (the launchers' outputs in NAME.log)."""
    out = os.path.join(work, name)
    got = launch_on_hosts(cluster, name, world, daemons,
                          [EXAMPLE, "--backend", "ragshard", "--out", out, "--quiet"] + args)
    with open(out + ".log", "w") as f:
        f.write("\n".join(f"host {k}'s launcher:\n{text}" for k, (_, text) in enumerate(got)))
    for k, (code, text) in enumerate(got):
        assert code == 0, f"{name}: host {k}'s launcher exited with {code}:\n{text[-6000:]}"
    return json.load(open(out + ".json"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 daemons on hosts of their own, the tests' temporary directories (the runs' outputs and
    checkpoints) seen on every host. Where namespaces cannot be made the tests fail or skip
    (cluster_runs.require_namespaces), not the module: test_dcp_hosts imports it."""
    require_namespaces()
    with NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20,
                           shared=[ROOT, str(tmp_path_factory.getbasetemp())]) as c:
        yield c


class Runs:
    """Each run once per module, whichever test asks first."""

    def __init__(self, work, cluster):
        self.work, self.cluster, self.done = str(work), cluster, {}
        self.fsdp2_ckpt = os.path.join(self.work, "fsdp2-ckpt")
        self.ragshard_ckpt = os.path.join(self.work, "ragshard-ckpt")

    def _once(self, name, start):
        if name not in self.done:
            try:
                self.done[name] = start()
            except BaseException as e:  # a failed run fails every test that needs it, once
                self.done[name] = e
        if isinstance(self.done[name], BaseException):
            raise self.done[name]
        return self.done[name]

    def fsdp2(self, model):
        save = ["--save-dcp", self.fsdp2_ckpt, "--save-after", str(SAVE_AFTER)] \
            if model == "llama" else []
        return self._once(f"fsdp2-{model}", lambda: run_fsdp2(
            self.work, f"fsdp2-{model}", 4, ["--model", model, "--steps", str(STEPS)] + save))

    def ragshard(self, model):
        save = ["--save-dcp", self.ragshard_ckpt, "--save-after", str(SAVE_AFTER)] \
            if model == "llama" else []
        return self._once(f"ragshard-{model}", lambda: run_ragshard(
            self.cluster, self.work, f"ragshard-{model}", 4, 2,
            ["--model", model, "--steps", str(STEPS)] + save))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cluster):
    return Runs(tmp_path_factory.mktemp("porting"), cluster)


def assert_losses_match(ours, theirs, first_step, what):
    assert len(ours) == len(theirs), (ours, theirs)
    for i, (x, y) in enumerate(zip(ours, theirs)):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), \
            f"{what}: step {first_step + i}: loss {x!r} vs {y!r} (|diff| {abs(x - y):.3g})"
    return max(abs(x - y) for x, y in zip(ours, theirs))


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_recipe_parity(runs, model):
    theirs, ours = runs.fsdp2(model), runs.ragshard(model)
    assert theirs["world"] == ours["world"] == 4
    assert ours["first_step"] == theirs["first_step"] == 1
    diff = assert_losses_match(ours["losses"], theirs["losses"], 1,
                               f"{model}: ragshard 2x2 vs FSDP2 W=4")
    print(f"{model}: max |loss diff| over {STEPS} steps = {diff:.3g}")
    # The same schedule (LambdaLR on ragshard's optimizer moves its groups' lr as torch's).
    assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12, abs=0)
    assert ours["losses"][-1] < ours["losses"][0]  # it learns
    # The same final parameters: each one's norm (the sums of near-zero tensors say little).
    a, b = ours["checksums"], theirs["checksums"]
    assert a.keys() == b.keys()
    for name in b:
        assert abs(a[name][1] - b[name][1]) <= TOL * b[name][1], (name, a[name], b[name])


def dcp_entries(path):
    """{key: (shape, dtype) of a tensor, or "bytes"} of the DCP checkpoint at `path`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) if isinstance(m, TensorStorageMetadata)
            else "bytes" for k, m in meta.items()}


def test_checkpoints_have_fsdp2s_layout(runs):
    """save_dcp's checkpoint has the entries of FSDP2's of the same run: the model's keys as
    get_model_state_dict gives them (tied aliases included), the optimizer's in
    get_optimizer_state_dict's layout, and the extra entries (scheduler, step)."""
    runs.fsdp2("llama"), runs.ragshard("llama")
    ours, theirs = dcp_entries(runs.ragshard_ckpt), dcp_entries(runs.fsdp2_ckpt)
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= theirs.keys()
    assert sorted(ours.keys() - theirs.keys()) == [] and \
        sorted(theirs.keys() - ours.keys()) == [], "keys only in ragshard's / only in FSDP2's"
    assert {k: v for k, v in ours.items() if v != theirs[k]} == {}


def check_continuation(cont, writer, what):
    """The run that continued a checkpoint written after step SAVE_AFTER: it ran the steps
    after it, at the writer's learning rates and losses."""
    assert cont["first_step"] == SAVE_AFTER + 1, cont["first_step"]
    assert cont["lrs"] == pytest.approx(writer["lrs"][SAVE_AFTER:], rel=1e-12, abs=0)
    diff = assert_losses_match(cont["losses"], writer["losses"][SAVE_AFTER:], SAVE_AFTER + 1,
                               what)
    print(f"{what}: max |loss diff| = {diff:.3g}")


def test_ragshard_checkpoint_continues_under_fsdp2(runs):
    writer = runs.ragshard("llama")  # its steps 5 to 8 are the reference
    cont = run_fsdp2(runs.work, "fsdp2-continues-ragshard", 2,
                     ["--model", "llama", "--steps", str(STEPS), "--load-dcp",
                      runs.ragshard_ckpt])
    assert cont["world"] == 2
    check_continuation(cont, writer, "FSDP2 W=2 from ragshard W=4's checkpoint")


def test_fsdp2_checkpoint_continues_under_ragshard(runs):
    writer = runs.fsdp2("llama")
    cont = run_ragshard(runs.cluster, runs.work, "ragshard-continues-fsdp2", 2, 1,
                        ["--model", "llama", "--steps", str(STEPS), "--load-dcp",
                         runs.fsdp2_ckpt])
    assert cont["world"] == 2
    check_continuation(cont, writer, "ragshard 1x2 from FSDP2 W=4's checkpoint")


if __name__ == "__main__" and sys.argv[1:2] == ["--fsdp2-launch"]:
    sys.exit(fsdp2_launch(int(sys.argv[2]), sys.argv[3], sys.argv[4:], PRELOAD))
