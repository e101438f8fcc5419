"""Steps per commit (docs/recovery.md, "Steps per commit"): how many optimizer steps one
transaction of a rank's step journal holds, which ragshard.launch --steps-per-commit gives every
rank of a job in the environment and the rank's recovery reads (and checks the same on every
rank). Standard library only: the launcher imports it without torch."""
import os

ENV = "RAGSHARD_STEPS_PER_COMMIT"
LIMIT = 1 << 20


def check(k, name="--steps-per-commit"):
    """k as an int from 1 to LIMIT, else ValueError naming `name` and what it got."""
    try:
        n = int(k)
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= LIMIT:
        raise ValueError(f"{name} {k!r}: steps per commit must be an integer from 1 to {LIMIT}")
    return n


def steps_per_commit(environ=os.environ):
    """K of the environment (default 1): a transaction's undo copies, its commit and its
    protect once every K optimizer steps."""
    return check(environ.get(ENV, "") or "1", name=ENV)
