"""Inside bench/fsdp2_report.py's runs: the driver every rank runs (fsdp2_report.py --rank OUT
EXAMPLE ARGS: examples/train_hf.py's main, unchanged, with a step timer and the rank's memory
figures), and FSDP2's launcher (fsdp2_report.py --fsdp2-launch W SCRIPT ARGS: a run's ranks forked
from one process that imported PRELOAD, tests/python/fsdp2_launcher.py)."""
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "python")
# Imported once by each launcher before it forks the ranks.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "transformers.models.llama.modeling_llama"]


# --- inside a rank: train_hf.py with a stopwatch ------------------------------------------------

def rank_main(out, example, args):
    """Runs `example`'s main(args) in this rank, timing its steps; writes OUT.rank{r}.json."""
    import importlib.util
    import torch
    rank = int(os.environ.get("RAGSHARD_RANK", os.environ.get("RANK", "0")))
    start_rss = vm("VmRSS")
    sys.path.insert(0, os.path.dirname(os.path.abspath(example)))  # its helpers
    spec = importlib.util.spec_from_file_location("train_hf", example)
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    with open(f"{out}.pid{os.getpid()}", "w") as f:  # the report's sampler: this rank's node
        f.write(os.environ.get("RAGSHARD_NODE") or "node-0")
    rec = {"rank": rank, "node": os.environ.get("RAGSHARD_NODE", ""), "start_rss_bytes": start_rss,
           "step_seconds": [], "threads": torch.get_num_threads()}
    box = {}

    parse, global_batch, param_groups, checksums = \
        hf.parse, hf.global_batch, hf.param_groups, hf.checksums

    def parse_(argv=None):
        box["a"] = parse(argv)
        return box["a"]

    def global_batch_(a, chain, step):
        xy = global_batch(a, chain, step)
        box["t0"] = time.perf_counter()  # the step starts with its forward
        return xy

    def param_groups_(model, wd):
        box["model"] = model  # the wrapped model
        return param_groups(model, wd)

    def pool_peak():
        client = getattr(box.get("model"), "client", None)
        return int(client.stats()["pool_peak"]) if client is not None else None

    def checksums_(named):  # after the last step and the gather of the full parameters
        sums = checksums(named)
        rec["exit_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rec["exit_pool_peak_bytes"] = pool_peak()
        with open(f"{out}.rank{rank}.json", "w") as f:  # FSDP2's path leaves with os._exit
            json.dump(rec, f)
        return sums

    Lambda = torch.optim.lr_scheduler.LambdaLR

    class LambdaLR_(Lambda):
        """train_hf's scheduler: wraps its optimizer's zero_grad, the step's last call."""

        def __init__(self, opt, *a, **k):
            zero_grad = opt.zero_grad

            def zero_grad_(*za, **zk):
                r = zero_grad(*za, **zk)
                rec["step_seconds"].append(time.perf_counter() - box["t0"])
                if len(rec["step_seconds"]) == box["a"].steps:  # the end of training
                    rec["train_max_rss_bytes"] = \
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                    rec["pool_peak_bytes"] = pool_peak()
                return r
            opt.zero_grad = zero_grad_
            super().__init__(opt, *a, **k)

    hf.parse, hf.global_batch, hf.param_groups, hf.checksums = \
        parse_, global_batch_, param_groups_, checksums_
    torch.optim.lr_scheduler.LambdaLR = LambdaLR_
    hf.main(args)


def vm(key, pid="self"):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fsdp2_launch(world, script, args):
    """FSDP2's ranks of one run: `world` processes forked from this one once it has imported
    PRELOAD (ragshard.launch --preload's mechanism, tests/python/fsdp2_launcher.py, which
    tests/python/test_porting.py uses too), with RANK, WORLD_SIZE and one intra-op thread each;
    when a rank fails the others are stopped."""
    if TESTS not in sys.path:
        sys.path.append(TESTS)
    from fsdp2_launcher import fsdp2_launch as launch
    return launch(world, script, args, PRELOAD)
