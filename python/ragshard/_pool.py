"""The names of a rank's state buffers in the daemon's pool, and the step journal's layout: the
contract that protocol/pool_contract.h defines, read from the C library (never spelled here or
anywhere else on this side: tests/python/test_pool_contract.py checks)."""
import json

from ._core import _lib, _string

_CONTRACT = json.loads(_string(_lib.rs_pool_contract))
_PREFIXES, _NAMES = _CONTRACT["prefixes"], _CONTRACT["names"]

# Family prefixes, and whole names (protocol/pool_contract.h's).
SHARD, JOURNAL, OPTIMIZER, SHRINK, COPY = (
    _PREFIXES[k] for k in ("shard", "journal", "optimizer", "shrink", "copy"))
(JOURNAL_META, JOURNAL_MANIFEST, JOURNAL_HELD, SHRINK_TAKEN, SHRINK_RECUT, SHRINK_IN_PLACE,
 COPY_DIRECTORY, COPY_DIRECTORY_BYTES) = (_NAMES[k] for k in (
     "journal_meta", "journal_manifest", "journal_held", "shrink_taken", "shrink_recut",
     "shrink_in_place", "copy_directory", "copy_directory_bytes"))

# The step journal's marks (JOURNAL_META): int64 fields.
JOURNAL_META_FIELDS = _CONTRACT["journal_meta"]["fields"]
COMMITTED = _CONTRACT["journal_meta"]["committed"]
BEGUN = _CONTRACT["journal_meta"]["begun"]
# The training step is a transaction's number + BASE (a load sets it); BASE_BEFORE: BASE at the
# last transaction's start.
BASE = _CONTRACT["journal_meta"]["base"]
BASE_BEFORE = _CONTRACT["journal_meta"]["base_before"]


def shard(unit):
    """A parameter shard's name."""
    return f"{SHARD}{unit}"


def journal_undo(name):
    """The undo copy of state buffer `name`."""
    return f"{_NAMES['journal_undo']}{name}"


def optimizer_prefix(owner):
    """The prefix of optimizer `owner`'s state (an "opt/<tag>" family)."""
    return f"{OPTIMIZER}{owner}"


def optimizer_state(owner, key, unit):
    """Optimizer `owner`'s state `key` of unit `unit`."""
    return f"{optimizer_prefix(owner)}/{key}/{unit}"


def shrink_steps(prefix):
    """The step count a re-cut agreed on for optimizer state family `prefix`."""
    return f"{_NAMES['shrink_steps']}{prefix}"


def copy(step, rest):
    """A salvage attachment's view of another node's whole copy at `step`: `rest` is a segment's
    name, COPY_DIRECTORY or COPY_DIRECTORY_BYTES."""
    return f"{COPY}{step}/{rest}"
