"""The measuring side of bench/fsdp2_report.py: one configuration's run (Runner: ragshard through
ragshard.launch --preload on a fresh LocalCluster, FSDP2 through fsdp2_report.py --fsdp2-launch),
each in a process session of its own with every process's PSS sampled (Sampler), and step 1's
gradient norm in one process (reference_norm)."""
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from fsdp2_rank import PRELOAD, vm
from session import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp2_report.py")
WORLD = 4
TIMEOUT = 900  # seconds per run
SAMPLE_S = 0.1


def sh(cmd):
    return " ".join(shlex.quote(c) for c in cmd)


# --- runs, PSS sampling ---------------------------------------------------------------------------

def pss(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Every SAMPLE_S: the processes under `roots` ("launcher" for a root itself; a rank by the
    node its driver wrote to PREFIX.pidPID, since a forked rank's /proc/PID/environ is the
    launcher's) and `extra` ({pid: node}, the daemons); keeps each node's peak sum of Pss and
    the peak of the sum over all of them (bench/memory_report.py's method)."""

    def __init__(self, prefix, extra):
        super().__init__(daemon=True)
        self.roots, self.prefix, self.extra = [], prefix, dict(extra)
        self.node, self.peak, self.peak_total = {}, {}, 0
        self.halt = threading.Event()

    def node_of(self, pid):
        if pid not in self.node:
            try:
                with open(f"{self.prefix}.pid{pid}") as f:
                    self.node[pid] = f.read().strip()
            except OSError:
                return None  # not a rank, or its driver has not started yet
        return self.node[pid]

    def run(self):
        while not self.halt.is_set():
            pids = dict(self.extra)
            for r in self.roots:
                pids[r] = "launcher"
                for p in descendants(r):
                    pids[p] = self.node_of(p)
            sums = {}
            for pid, n in pids.items():
                v = pss(pid) if n is not None else None
                if v is not None:
                    sums[n] = sums.get(n, 0) + v
            for n, v in sums.items():
                self.peak[n] = max(self.peak.get(n, 0), v)
            self.peak_total = max(self.peak_total, sum(sums.values()))
            self.halt.wait(SAMPLE_S)


def run_group(cmd, env, log, sampler):
    """Runs `cmd` in a session of its own (output in `log`), sampled; on a timeout or an error
    the whole session is killed. Returns (exit code, wall seconds, output's tail)."""
    t0 = time.time()
    with open(log, "w+") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        sampler.roots.append(p.pid)
        sampler.start()
        try:
            p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            sampler.halt.set()
            sampler.join()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        f.seek(0)
        text = f.read()
    return p.returncode, time.time() - t0, text[-3000:]


class Runner:
    def __init__(self, build, work, example, model, steps, warmup):
        self.build, self.work, self.example = build, work, example
        self.env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "OMP_NUM_THREADS"):
            self.env.pop(k, None)
        self.common = model + ["--steps", str(steps), "--warmup", str(warmup), "--quiet"]
        self.commands = {}  # configuration -> its command line, as run
        self.rel_example = os.path.relpath(example, ROOT)

    def finish(self, name, out, code, wall, text, sampler, world):
        if code != 0:
            print(f"{name} exited with {code}:\n{text}", file=sys.stderr)
            return {"error": f"exited with {code}:\n{text}", "wall": wall}
        try:
            main = json.load(open(out + ".json"))
            ranks = [json.load(open(f"{out}.rank{r}.json")) for r in range(world)]
        except (OSError, ValueError) as e:
            return {"error": f"no output: {e}\n{text}", "wall": wall}
        return {"losses": main["losses"], "lrs": main["lrs"], "grad_norms": main["grad_norms"],
                "checksums": main["checksums"], "ranks": ranks, "wall": wall,
                "pss": dict(sampler.peak), "pss_total": sampler.peak_total}

    def ragshard(self, config, name, daemons, extra):
        from ragshard.cluster import LocalCluster
        out = os.path.join(self.work, name)
        args = ["--backend", "ragshard", "--out", out] + self.common + extra
        with LocalCluster(self.build, daemons=daemons, pool_bytes=3 << 30) as c:
            daemon_pids = {p.pid: f"node-{i}" for i, p in enumerate(c.procs[1:])}
            cmd = [sys.executable, "-m", "ragshard.launch", "--preload", ",".join(PRELOAD),
                   "--planner", c.planner, "--job", name, "--nproc", str(WORLD),
                   "--sockets", ",".join(c.sockets), "--create-job", THIS, "--rank", out,
                   self.example] + args
            self.commands.setdefault(config, (
                f"python -m ragshard.launch --preload {','.join(PRELOAD)} --planner ... "
                f"--job ... --nproc {WORLD} --sockets <{daemons} daemon socket"
                f"{'s' if daemons > 1 else ''}> --create-job bench/fsdp2_report.py --rank OUT " +
                sh([self.rel_example, "--backend", "ragshard", "--out", "OUT"] +
                   self.common + extra)))
            sampler = Sampler(out, daemon_pids)
            code, wall, text = run_group(
                cmd, dict(self.env, RAGSHARD_TOKEN_FILE=c.token_file), out + ".log", sampler)
            run = self.finish(name, out, code, wall, text, sampler, WORLD)
            if "error" in run:
                return run
            run["daemon_hwm"] = [vm("VmHWM", p.pid) for p in c.procs[1:]]
            ctl = subprocess.run([os.path.join(self.build, "ctl", "ragshardctl"), "--planner",
                                  c.planner, "nodes", "--json"], capture_output=True, text=True,
                                 timeout=60)
            run["ctl_pool_peak"] = {}
            if ctl.returncode == 0:
                for n in json.loads(ctl.stdout).get("nodes", []):
                    f = n.get("figures", {})
                    run["ctl_pool_peak"][n.get("nodeId", n.get("node_id"))] = int(
                        f.get("poolPeakBytes", f.get("pool_peak_bytes", 0)))
            run["daemons"] = daemons
            return run

    def fsdp2(self, config, name, extra):
        out = os.path.join(self.work, name)
        args = ["--backend", "fsdp2", "--store", out + ".store", "--out", out] + \
            self.common + extra
        cmd = [sys.executable, THIS, "--fsdp2-launch", str(WORLD), THIS, "--rank", out,
               self.example] + args
        self.commands.setdefault(config, (
            f"python bench/fsdp2_report.py --fsdp2-launch {WORLD} bench/fsdp2_report.py "
            "--rank OUT " + sh([self.rel_example, "--backend", "fsdp2", "--store", "STORE",
                                "--out", "OUT"] + self.common + extra) +
            f"   # forks ranks 0..{WORLD - 1} (RANK, WORLD_SIZE={WORLD}, OMP_NUM_THREADS=1)"))
        sampler = Sampler(out, {})
        code, wall, text = run_group(cmd, self.env, out + ".log", sampler)
        return self.finish(name, out, code, wall, text, sampler, WORLD)


# --- step 1's gradient norm in one process --------------------------------------------------------

def reference_norm(example, model, world):
    """Step 1's gradient norm in one process (the unsharded model, each rank's rows' mean loss
    averaged as the ranks' gradients are): (in fp64 from the fp32 gradients, torch's fp32
    get_total_norm)."""
    import importlib.util
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))  # its helpers
    spec = importlib.util.spec_from_file_location("train_hf_norm", example)
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    a = hf.parse(["--backend", "fsdp2"] + model)
    m = hf.build_model(a)
    x, y = hf.global_batch(a, hf.bigram_chain(a.vocab, a.seed), 0)
    rows = a.global_batch // world
    for r in range(world):
        sl = slice(r * rows, (r + 1) * rows)
        loss = torch.nn.functional.cross_entropy(
            m(input_ids=x[sl]).logits.float().reshape(-1, a.vocab), y[sl].reshape(-1))
        (loss / world).backward()
    grads = [p.grad for p in m.parameters()]
    return (float(sum(float((g.double() ** 2).sum()) for g in grads)) ** 0.5,
            float(torch.nn.utils.get_total_norm(grads)))
