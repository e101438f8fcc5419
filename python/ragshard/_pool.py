"""The names of a rank's state buffers in the daemon's pool, and the step journal's layout: the
contract that protocol/pool_contract.h defines, read from the C library (never spelled here or
anywhere else on this side: tests/python/test_pool_contract.py checks)."""
import json

from ._core import _lib, _string

_CONTRACT = json.loads(_string(_lib.rs_pool_contract))
_PREFIXES, _NAMES = _CONTRACT["prefixes"], _CONTRACT["names"]

SHARD = _PREFIXES["shard"]
JOURNAL = _PREFIXES["journal"]
OPTIMIZER = _PREFIXES["optimizer"]
SHRINK = _PREFIXES["shrink"]
COPY = _PREFIXES["copy"]

JOURNAL_META = _NAMES["journal_meta"]
JOURNAL_MANIFEST = _NAMES["journal_manifest"]
JOURNAL_HELD = _NAMES["journal_held"]
SHRINK_TAKEN = _NAMES["shrink_taken"]
SHRINK_RECUT = _NAMES["shrink_recut"]
SHRINK_IN_PLACE = _NAMES["shrink_in_place"]
COPY_DIRECTORY = _NAMES["copy_directory"]
COPY_DIRECTORY_BYTES = _NAMES["copy_directory_bytes"]

# The step journal's marks (JOURNAL_META): int64 fields.
JOURNAL_META_FIELDS = _CONTRACT["journal_meta"]["fields"]
COMMITTED = _CONTRACT["journal_meta"]["committed"]
BEGUN = _CONTRACT["journal_meta"]["begun"]


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
