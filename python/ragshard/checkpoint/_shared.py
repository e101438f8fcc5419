"""What the ranks of a checkpoint's save or load agree on besides its bytes: that a phase
succeeded on every rank (a failure on any rank is raised on every rank, through a collective of
the daemons, so a rank that died makes the others fail rather than wait), and that the
directory rank 0 made for a save is the one every rank's host sees (a random token rank 0
writes there and posts through the job's keys on the planner, _exchange.py), so that no rank
writes its part where rank 0 cannot commit it."""
import secrets
import socket

from . import _exchange
from ._format import CheckpointError


def agree(model, failed):
    """A barrier that also says whether any rank failed."""
    return model.all_reduce_scalar(1.0 if failed else 0.0) > 0


def phase(model, what, fn, cleanup=None):
    """Runs fn on every rank; if it failed on any, every rank raises (this one its own error)
    after rank 0 runs `cleanup`."""
    error = None
    try:
        result = fn()
    except Exception as e:  # every rank must learn of it before anyone goes on
        error, result = e, None
    if agree(model, error is not None):
        if cleanup is not None and model.rank == 0:
            cleanup()
        if error is not None:
            raise error
        raise CheckpointError(f"{what}: another rank failed; nothing was committed")
    return result


def post_token(model, tag):
    """Rank 0: a new random token for the save `tag`, posted for the other ranks; rank 0 writes
    it into the directory it made, where each other rank reads it (`expect_token`)."""
    token = secrets.token_hex(16)
    _exchange.post(model.client, "save", 0, token, tag)
    return token


def expect_token(model, what, directory, found, tag):
    """Raises CheckpointError where `found` (the token this rank read in `directory`, None where
    it found none) is not the one rank 0 posted for the save `tag`: this rank's host does not
    see the directory rank 0 made."""
    if found != _exchange.fetch(model.client, "save", 0, tag):
        raise CheckpointError(
            f"{what}: rank {model.rank} (host {socket.gethostname()}) does not see the directory "
            f"rank 0 made for the save, {directory} "
            f"({'absent here' if found is None else 'another save there'}): a checkpoint's "
            "directory must be on a filesystem every rank's host shares, as for FSDP2's "
            "dcp.save; nothing was committed")
