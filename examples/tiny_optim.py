"""train_tiny.py's optimizers: which parameters each takes, built for a run through ragshard and
for its one-process reference (whose optimizers, in reference_optim.py beside this file, are
written independently of ragshard's sharded ones), and what Shampoo's preconditioners became.

--optimizer adamw | torch-adamw | nadam | adam8bit: every parameter. muon | shampoo: the blocks' weight
matrices (`is_matrix`), the other parameters through AdamW with --lr and no weight decay.
adamw is ragshard.torch.ShardedAdamW; torch-adamw is torch.optim.AdamW through
ragshard.torch.ShardedOptimizer (the same torch optimizer on this rank's pieces; its one-process
reference is torch.optim.AdamW, as adamw's).
"""
import torch

import reference_optim  # beside this script


# The torch optimizers a run takes through ragshard.torch.ShardedOptimizer, by --optimizer.
_TORCH = {"torch-adamw": torch.optim.AdamW, "nadam": torch.optim.NAdam}


def is_matrix(name, p):
    return p.dim() == 2 and "layers." in name  # the blocks' weight matrices


def add_arguments(p):
    p.add_argument("--optimizer", default="adamw",
                   choices=["adamw", "torch-adamw", "nadam", "muon", "adam8bit", "shampoo"],
                   help="adamw: ShardedAdamW; torch-adamw: ShardedOptimizer(model, "
                        "torch.optim.AdamW, lr=, weight_decay=) (ShardedAdamW is its AdamW "
                        "case); nadam: the same with torch.optim.NAdam; adam8bit: AdamW with block-quantized moments (128x128 blocks of "
                        "matrices, 256 of vectors; vectors are then not cut: granule whole); "
                        "muon and shampoo: for the blocks' weight matrices, on their owners")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--shampoo-lr", type=float, default=1.0,
                   help="shampoo's step size: its directions have the gradient's norm (SGD "
                        "grafting), and this model's gradients are small")
    p.add_argument("--precondition-every", type=int, default=10, metavar="N",
                   help="shampoo: recompute the inverse roots every N steps, from the first")
    p.add_argument("--shampoo-block", type=int, default=0, metavar="B",
                   help="shampoo: precondition in blocks of at most B x B (0: whole matrices)")
    p.add_argument("--weight-decay", type=float, default=0.01)


def check_arguments(p, a):
    if a.precondition_every < 1:
        p.error(f"--precondition-every {a.precondition_every}: must be at least 1")
    if a.shampoo_block < 0:
        p.error(f"--shampoo-block {a.shampoo_block}: must be 0 (whole matrices) or positive")


def is_adamw(args):
    """Whether the run's optimizer is plain AdamW (ShardedAdamW, or torch's through
    ShardedOptimizer)."""
    return args.optimizer in ("adamw", "torch-adamw")


def matrix_optimizer(args):
    """fully_shard's optimizer= for the run's optimizer."""
    kind = {"muon": "matrix", "shampoo": "shampoo" + (
        f":{args.shampoo_block}" if args.shampoo_block else "")}.get(args.optimizer)
    return lambda n, p: kind if kind and is_matrix(n, p) else "elementwise"


def sharded_optimizer(args, fsdp):
    import ragshard.torch as rt
    if args.optimizer == "muon":
        return rt.ShardedMuon(fsdp, lr=args.muon_lr, adamw_lr=args.lr)
    if args.optimizer == "shampoo":
        return rt.ShardedShampoo(fsdp, lr=args.shampoo_lr,
                                 precondition_every=args.precondition_every, adamw_lr=args.lr)
    if args.optimizer == "adam8bit":
        return rt.ShardedAdam8bit(fsdp, lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer in _TORCH:
        return rt.ShardedOptimizer(fsdp, _TORCH[args.optimizer], lr=args.lr,
                                   weight_decay=args.weight_decay)
    return rt.ShardedAdamW(fsdp, lr=args.lr, weight_decay=args.weight_decay)


def reference_optimizers(args, model):
    """The optimizers of a --reference run, each stepped once per step."""
    whole = args.optimizer in ("muon", "shampoo")
    matrices = [p for n, p in model.named_parameters() if whole and is_matrix(n, p)]
    others = [p for n, p in model.named_parameters() if not any(p is m for m in matrices)]
    wd = 0.0 if whole else args.weight_decay
    if args.optimizer == "adam8bit":
        return [reference_optim.Adam8bit(others, lr=args.lr, weight_decay=wd)]
    opts = [_TORCH.get(args.optimizer, torch.optim.AdamW)(others, lr=args.lr, weight_decay=wd)]
    if args.optimizer == "muon":
        opts.append(reference_optim.Muon(matrices, lr=args.muon_lr))
    elif args.optimizer == "shampoo":
        opts.append(reference_optim.Shampoo(matrices, lr=args.shampoo_lr,
                                            every=args.precondition_every,
                                            block=args.shampoo_block))
    return opts


def state_bytes(opt, fsdp):
    """This rank's optimizer state after a step, measured (ShardedOptimizer and its ShardedAdamW
    case; None for the others):
    * `bytes`: nbytes summed over the distinct storages (by data address) of every tensor in the
      torch optimizer's state on this rank's pieces (`opt.opt.state`: the moments, views of the
      module's state tensors, and each piece's 0-dim step count), each storage counted once;
      `storages` and `tensors` count them; `scalar_bytes` and `scalar_storages`: the 0-dim ones;
    * `module_bytes`: the same over the module's state tensors (`fsdp.optimizer_state_tensors()`);
    * `master_bytes`: the fp32 masters the module keeps apart from the shards (bf16 parameters,
      quantized gathers), which the optimizer steps but which are not its state;
    * `range_elems`: this rank's optimizer range, S_os summed over the units
      (`fsdp.os_elems`), 0 where another local rank steps the same memory (`steps`:
      `fsdp.steps` False);
    * `pieces` and `stepped_elems`: the pieces the optimizer steps and their elements (the
      range less its padding, when every parameter is in the optimizer)."""
    import ragshard.torch as rt
    if not isinstance(opt, rt.ShardedOptimizer):
        return None
    storages, scalars, tensors = {}, {}, 0
    for st in (opt.opt.state.values() if opt.opt is not None else ()):
        for v in st.values():
            if torch.is_tensor(v):
                tensors += 1
                s = v.untyped_storage()
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
                if v.dim() == 0:
                    scalars[s.data_ptr()] = s.nbytes()
    module = {}
    for t in fsdp.optimizer_state_tensors():
        s = t.untyped_storage()
        module[s.data_ptr()] = s.nbytes()
    masters = {}
    for t in fsdp.masters.values():
        s = t.untyped_storage()
        masters[s.data_ptr()] = s.nbytes()
    return {"bytes": sum(storages.values()), "storages": len(storages), "tensors": tensors,
            "scalar_bytes": sum(scalars.values()), "scalar_storages": len(scalars),
            "module_bytes": sum(module.values()), "master_bytes": sum(masters.values()),
            "range_elems": sum(int(fsdp.os_elems[u]) for u in fsdp.units()) if fsdp.steps
            else 0,
            "steps": bool(fsdp.steps),
            "pieces": len(opt.where),
            "stepped_elems": sum(hi - lo for _, lo, hi in opt.where)}


def off_identity(root):
    """How far a root is from a multiple of the identity (which preconditions nothing once the
    update is grafted): |P - (tr P / n) I| / |P| (Frobenius)."""
    n = root.shape[0]
    return float((root - torch.trace(root) / n * torch.eye(n)).norm() / root.norm())


def shampoo_report(opt, model=None):
    """{matrix name: {"refreshed": the steps whose roots were computed, "off_identity": the
    least off_identity of its roots}}: a sharded ShardedShampoo's owned matrices, or, with
    `model`, every matrix of a reference run's optimizers `opt` (a list)."""
    out = {}
    if model is None:
        for name, st in opt.state.items():
            out[name] = {"refreshed": list(st.refreshed), "off_identity": min(
                off_identity(r) for r in st.left_root + st.right_root)}
        return out
    shampoo = [o for o in opt if isinstance(o, reference_optim.Shampoo)]
    for name, p in model.named_parameters():
        st = shampoo[0].state.get(p) if shampoo else None
        if st:
            out[name] = {"refreshed": list(st["refreshed"]), "off_identity": min(
                off_identity(t[k]) for t in st["tiles"] for k in ("root_L", "root_R"))}
    return out
