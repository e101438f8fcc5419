"""What recovery in place costs a training step on a real model (issue: recovery where people
train, item 5): examples/train_hf.py's Llama at >= 100 M parameters, D daemons x R ranks, each
run on a fresh LocalCluster, in alternated rounds of: no recovery, `--max-restarts 1` (the
state in the pool, each step journaled), and with redundancy across nodes (parity:2, replica).
Per run: rank 0's step times (their median and mean over the steps after the first two), and
each daemon's resident memory and pool figures at the end of training. `--steps-per-commit K`
runs the recovering configurations with `ragshard.launch --steps-per-commit K` (a journal
transaction and a protect every K steps: docs/recovery.md, "Steps per commit"); their cost then
comes once every K steps, which the mean over a whole number of K-step commits counts and a
median would hide.

    .venv/bin/python bench/recovery_cost.py --build build --work /tmp/rc --rounds 5 --json OUT

Prints one JSON line per run and writes every run to OUT (JSON: the commit, the runs), which
bench/recovery_cost_render.py makes docs/benchmarks/recovery_cost.md of."""
import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from recovery_runs import Launch, Others, sh  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
PRELOAD = "torch,transformers.models.llama.modeling_llama"
# About 105 M parameters: 14 layers of 7.1 M and an 8,192 x 768 tied embedding.
MODEL = ["--model", "llama", "--hidden", "768", "--layers", "14", "--heads", "12",
         "--intermediate", "2048", "--vocab", "8192", "--seq", "128", "--quiet"]
SEQUENCES_PER_RANK = 2
CONFIGS = {"none": [], "restarts": ["--max-restarts", "1"],
           "parity:2": ["--max-restarts", "1", "--redundancy", "parity:2"],
           "replica": ["--max-restarts", "1", "--redundancy", "replica"]}


def _rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _used_bytes():
    """The machine's memory in use: MemTotal less MemAvailable (/proc/meminfo; the pools'
    memfd pages count, reclaimable page cache does not)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            fields[k] = int(v.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class PeakMemory:
    """The most memory the machine used over the block, beyond what it used at its start,
    sampled every `every` seconds (the run's ranks, daemons and planner: nothing else runs)."""

    def __init__(self, every=0.25):
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def __enter__(self):
        self.base = _used_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, _used_bytes() - self.base)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def one_run(a, layout, config, job):
    from ragshard.cluster import LocalCluster
    daemons, per_node = layout
    out = os.path.join(a.work, job)
    with Others() as others, LocalCluster(a.build, daemons=daemons,
                                          pool_bytes=a.pool_gib << 30,
                                          pool_commit=True) as c:
        # (inside the cluster: the environment names its planner's token)
        env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))
        env.pop("OMP_NUM_THREADS", None)
        cmd = [sys.executable, "-m", "ragshard.launch", "--preload", PRELOAD, "--planner",
               c.planner, "--job", job, "--nproc", str(daemons * per_node), "--sockets",
               ",".join(c.sockets), "--create-job"] + CONFIGS[config] + (
               ["--steps-per-commit", str(a.steps_per_commit)]
               if config != "none" and a.steps_per_commit > 1 else []) + [
               EXAMPLE, "--backend", "ragshard", "--steps", str(a.steps), "--out", out,
               "--global-batch", str(SEQUENCES_PER_RANK * daemons * per_node)] + MODEL
        with PeakMemory() as memory:
            launch = Launch(cmd, env, a.timeout)
        daemon_rss = [_rss_kib(p.pid) for p in c._daemons.values()]
    with open(out + ".log", "w") as f:  # every line of the launch, with its time
        f.writelines(f"{t:9.3f} {text}\n" for t, text in launch.lines)
    if launch.code != 0:
        raise RuntimeError(f"{job}: exited with {launch.code}:\n{launch.tail()}")
    main = json.load(open(out + ".json"))
    steps = main["step_seconds"][2:]
    return {"job": job, "layout": f"{daemons}x{per_node}", "config": config,
            "command": sh(cmd).replace(ROOT + os.sep, ""), "wall": launch.wall,
            "others_cores": others.cores(), "steps": main["step_seconds"],
            "median_step": statistics.median(steps), "mean_step": statistics.fmean(steps),
            "steps_per_commit": a.steps_per_commit if config != "none" else 1,
            "daemon_rss_kib": daemon_rss,
            "peak_bytes_per_node": memory.peak / daemons, "node0": main.get("node", {}),
            "pool_committed": True}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layouts", default="2x2,3x2")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--pool-gib", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--steps-per-commit", type=int, default=1)
    p.add_argument("--json", default="")
    provenance.add_flag(p)
    a = p.parse_args()
    provenance.require(a)
    if a.steps_per_commit > 1 and (a.steps - 2) % a.steps_per_commit:
        p.error(f"--steps {a.steps}: the steps after the first two must be a whole number of "
                f"--steps-per-commit {a.steps_per_commit}")
    sys.path.insert(0, os.path.join(os.path.abspath(a.build), "python"))
    os.makedirs(a.work, exist_ok=True)
    layouts = [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",")]
    configs = a.configs.split(",")
    runs = []
    for r in range(a.rounds):
        for layout in layouts:
            for config in configs:
                if config == "parity:2" and layout[0] % 3:
                    continue  # (parity:2 needs the daemons in groups of 3)
                job = f"rc{r}-{layout[0]}x{layout[1]}-{config.replace(':', '')}-{int(time.time())}"
                run = one_run(a, layout, config, job)
                run["round"] = r
                runs.append(run)
                print(json.dumps({k: run[k] for k in ("layout", "config", "round",
                                                      "median_step", "peak_bytes_per_node",
                                                      "others_cores", "wall")}), flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump({"provenance": a.provenance, "runs": runs,
                                   "steps_per_commit": a.steps_per_commit}, f, indent=1)


if __name__ == "__main__":
    main()
