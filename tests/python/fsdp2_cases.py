"""FSDP2's training scenarios, written for ragshard's suite (tests/python/test_fsdp2_cases.py),
after the kinds of case PyTorch's own FSDP2 tests cover (test/distributed/_composable/fsdp/):
each case trains a small decoder STEPS steps with AdamW (or what the case says) in one of three
modes, on the same global batch:

    ragshard-launch ... fsdp2_cases.py --mode ragshard --jobs PREFIX --cases A,B --out DIR
        ragshard, rank r of W (its rows of each batch); case C runs in job PREFIX-C (and
        PREFIX-C-b where it builds a second model), created beforehand
    RANK=r WORLD_SIZE=W python fsdp2_cases.py --mode fsdp2 --store FILE --cases ... --out DIR
        torch's FSDP2 over gloo on a CPU mesh (--hsdp: a (2, W/2) mesh, HSDP)
    python fsdp2_cases.py --mode reference --world W --cases ... --out DIR
        one process, plain PyTorch, the whole global batch at once

Rank 0 writes DIR/<case>.json (each step's loss averaged over the ranks, and what the case
records besides) and DIR/<case>.pt (the final parameters, whole). The cases call FSDP2's API
(set_requires_gradient_sync, unshard, ...) on the model's own modules in both distributed modes
(ragshard gives its units and the wrapped module FSDP2's methods); the reference does what
they mean in one process (nothing, mostly).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp2_cases_api  # noqa: E402
import fsdp2_cases_training  # noqa: E402
from fsdp2_case_models import ROWS, batch  # noqa: E402


# -- the modes --------------------------------------------------------------------------------

class Mode:
    """What differs between the modes; the cases are written against it."""
    name = ""

    def __init__(self, args):
        self.args = args
        self.rank, self.world = 0, 1
        self.jobs = 0  # models built so far in this case

    def rows(self, t):
        """This rank's rows of a global batch (all of them in one process)."""
        return t[self.rank * ROWS:(self.rank + 1) * ROWS] if self.name != "reference" else t

    def data(self, step, micro=0, kind=batch):
        x, y = kind(step, micro, self.world)
        return self.rows(x), self.rows(y)

    def api(self, module, name, *args, **kwargs):
        """FSDP2's method `name` of `module`; nothing in one process."""
        if self.name != "reference":
            return getattr(module, name)(*args, **kwargs)
        return None


class Reference(Mode):
    name = "reference"

    def __init__(self, args):
        super().__init__(args)
        self.world = args.world

    def wrap(self, net, units, **kwargs):
        return net  # (mixed precision: the fp32 model, from which both bf16 runs differ)

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        return cls(list(model.parameters()) if params is None else params, **kw)

    def mean(self, v):
        return float(v)

    def full(self, model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def barrier(self, model):
        pass

    def end(self, model):
        pass


class Ragshard(Mode):
    name = "ragshard"

    def __init__(self, args):
        super().__init__(args)
        import ragshard
        self.env = ragshard.Env()
        self.rank, self.world = self.env.rank, self.env.world_size
        self.case = ""

    def wrap(self, net, units, **kwargs):
        import ragshard
        import ragshard.torch as rt
        job = f"{self.args.jobs}-{self.case}" + ("-b" if self.jobs else "")
        self.jobs += 1
        client = ragshard.Client(self.env.planner, self.env.socket, job, self.env.rank,
                                 self.env.node, 120000, self.env.token_file)
        return rt.fully_shard(net, client, units=lambda m: list(units), **kwargs)

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        import ragshard.torch as rt
        if cls == "muon":
            return rt.ShardedMuon(model, **kw)
        return rt.ShardedOptimizer(model, cls, params, **kw)

    def mean(self, v):
        return self.model_for_mean.all_reduce_scalar(float(v)) / self.world

    def full(self, model):
        return model.full_state(rank0_only=True)

    def barrier(self, model):
        model.all_reduce_scalar(0.0)

    def end(self, model):
        model.client.close()


class Fsdp2(Mode):
    name = "fsdp2"

    def __init__(self, args):
        super().__init__(args)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        self.dist = dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="file://" + args.store, rank=self.rank,
                                world_size=self.world)
        if args.hsdp:
            self.mesh = init_device_mesh("cpu", (2, self.world // 2),
                                         mesh_dim_names=("replicate", "shard"))
        else:
            self.mesh = init_device_mesh("cpu", (self.world,))

    def wrap(self, net, units, **kwargs):
        import dataclasses
        from torch.distributed.fsdp import fully_shard
        inner = dict(kwargs)
        mp = kwargs.get("mp_policy")
        if mp is not None and mp.output_dtype is not None:
            # ragshard's one policy casts the root's outputs; FSDP2's root policy does that
            inner["mp_policy"] = dataclasses.replace(mp, output_dtype=None)
        for u in units:
            fully_shard(u, mesh=self.mesh, **inner)
        kwargs.pop("reshard_after_forward", None)  # the root's default, as ragshard's
        fully_shard(net, mesh=self.mesh, **kwargs)
        return net

    def optimizer(self, model, cls=torch.optim.AdamW, params=None, **kw):
        return cls(list(model.parameters()) if params is None else params, **kw)

    def mean(self, v):
        t = torch.tensor([float(v)], dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t) / self.world

    def full(self, model):
        out = {}
        for n, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = full.detach().float().clone()
        return out if self.rank == 0 else {}

    def barrier(self, model):
        self.dist.barrier()

    def end(self, model):
        pass


# -- the cases, by name (the training idioms first, then FSDP2's module API) ------------------

CASES = {name[5:].replace("_", "-"): fn
         for module in (fsdp2_cases_training, fsdp2_cases_api)
         for name, fn in vars(module).items() if name.startswith("case_")}
# The cases that build a second model (a second ragshard job).
TWO_MODELS = {"state-dict-full", "state-dict-dcp"}
# The cases FSDP2 has no counterpart of here (run against the reference only).
RAGSHARD_ONLY = {"amsp-accum", "accum-muon", "quantized-accum", "quantized-once"}
# The cases of an HSDP job (a (2, W/2) mesh), and of AMSP factors.
HSDP = {"hsdp-accum", "hsdp-no-sync"}
AMSP = {"amsp-accum"}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ragshard", "fsdp2", "reference"], required=True)
    p.add_argument("--cases", required=True, help="comma-separated, of: " + ", ".join(CASES))
    p.add_argument("--jobs", default="", help="ragshard: job prefix")
    p.add_argument("--store", default="", help="fsdp2: the FileStore file")
    p.add_argument("--hsdp", action="store_true", help="fsdp2: a (2, W/2) mesh")
    p.add_argument("--world", type=int, default=4, help="reference: W")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    mode = {"ragshard": Ragshard, "fsdp2": Fsdp2, "reference": Reference}[a.mode](a)
    os.makedirs(a.out, exist_ok=True)
    for case in a.cases.split(","):
        torch.manual_seed(0)
        mode.case, mode.jobs = case, 0
        model, losses, extra = CASES[case](mode)
        state = mode.full(model)
        if mode.rank == 0:
            with open(os.path.join(a.out, case + ".json"), "w") as f:
                json.dump({"losses": losses, **extra}, f)
            torch.save(state, os.path.join(a.out, case + ".pt"))
        mode.end(model)
    if a.mode == "fsdp2":
        mode.dist.barrier()
        sys.stdout.flush()
        os._exit(0)  # no interpreter teardown under gloo


if __name__ == "__main__":
    main()
