"""The optimizers on a ShardedModule's shards, each a torch.optim.Optimizer with param groups
over the module's own parameters (groups.py): any elementwise torch optimizer on this rank's
pieces (sharded.py: ShardedOptimizer, ShardedAdamW), the whole-matrix ones on the planner's
owners (owner.py: Muon, muon.py; Shampoo, shampoo.py) and 8-bit Adam in blocks that never
straddle ranks (adam8bit.py)."""
from .adam8bit import ShardedAdam8bit
from .muon import ShardedMuon, newton_schulz
from .shampoo import ShardedShampoo
from .sharded import ELEMENTWISE, ShardedAdamW, ShardedOptimizer

__all__ = ["ShardedOptimizer", "ShardedAdamW", "ELEMENTWISE", "ShardedMuon", "newton_schulz",
           "ShardedShampoo", "ShardedAdam8bit"]
