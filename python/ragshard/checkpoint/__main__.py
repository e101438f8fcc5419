"""python3 -m ragshard.checkpoint export DIR --out FILE: a checkpoint as a plain PyTorch
state_dict (torch.save), which `load_state_dict` loads into the unsharded model."""
import argparse
import sys

import torch

from . import CheckpointError, export_state_dict


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m ragshard.checkpoint", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a plain state_dict of the unsharded model")
    ex.add_argument("dir", help="a checkpoint root (its newest checkpoint) or one checkpoint")
    ex.add_argument("--step", type=int, default=None, help="the step to export (default: latest)")
    ex.add_argument("--out", required=True, help="the file to write (torch.save)")
    a = p.parse_args(argv)
    try:
        state = export_state_dict(a.dir, a.step)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(state, a.out)
    print(f"{a.out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
