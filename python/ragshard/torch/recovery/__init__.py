"""Recovery in place (docs/recovery.md): the rank's state in its daemon's pool and the step
journal over it (journal.py), the one owner of a rank's recovery state that a ShardedModule holds
(rank.py: RankRecovery), a shrink's take-over of the state of the job it came from (takeover.py)
and the re-cut of one shard group's shards for fewer ranks (recut.py)."""
from .rank import RankRecovery

__all__ = ["RankRecovery"]
