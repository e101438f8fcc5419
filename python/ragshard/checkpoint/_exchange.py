"""What a torch.distributed process group would gather to rank 0 and scatter from it during a
DCP save (each rank's local plan, the central plans, each rank's write results), through the
job's own keys on the planner (Client.put / Client.get), with no file in a shared directory.

A value is pickled (DCP's plan and result classes are dataclasses), compressed, and cut into
pieces the planner takes (below its 1 MiB --max-value-bytes); its first key holds a header: the
save it belongs to (its tag: the checkpoint's path), the number of pieces, and the SHA-256 of
the whole. Keys are `ragshard.ckpt.<name>.<rank>[.<piece>]`, the same at every save, so a job
holds at most the pieces of its largest save; a value read is checked to be of this save, whole
and intact, and is unpickled with an allow-list (DCP's dataclasses and enums, torch.Size and
torch's dtypes, layouts and memory formats, and plain containers): a writer of the job's keys
cannot make a rank run code. Reads come after a collective that follows every write they need
(the caller's barrier), so they never wait."""
import dataclasses
import enum
import hashlib
import io
import pickle
import struct
import zlib

import torch

from ._format import CheckpointError

PREFIX = "ragshard.ckpt."
PIECE = 768 << 10  # below the planner's default --max-value-bytes (1 MiB), with room to spare
_MAGIC = b"RSX1"
_HEAD = struct.Struct("<4sII32s")  # magic, tag length, pieces, SHA-256 of the whole payload
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range"}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _member(cls, name):
    """getattr as an enum member pickles (Enum.__reduce_ex__), for enums only."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an enum's member")


class _Unpickler(pickle.Unpickler):
    """Unpickles what DCP's planners exchange, nothing else: any other global is refused."""

    def find_class(self, module, name):
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return _member
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, _TORCH_VALUES):
                return obj
        if module.startswith("torch.distributed.checkpoint.") or \
                module == "torch.distributed.checkpoint":
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or
                                          issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"'{module}.{name}' is not something a checkpoint's plan "
                                     "holds")


def _key(name, rank, piece=0):
    return f"{PREFIX}{name}.{rank}" + (f".{piece}" if piece else "")


def post(client, name, rank, obj, tag):
    """Puts `obj` under the keys of (`name`, `rank`) of the client's job, for the save `tag`."""
    payload = zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), 1)
    pieces = [payload[at:at + PIECE] for at in range(0, len(payload), PIECE)] or [b""]
    tag = tag.encode()
    head = _HEAD.pack(_MAGIC, len(tag), len(pieces), hashlib.sha256(payload).digest()) + tag
    for i, piece in enumerate(pieces):
        client.put(_key(name, rank, i), head + piece if i == 0 else piece)


def fetch(client, name, rank, tag):
    """The object rank `rank` posted under `name` for the save `tag`: CheckpointError naming the
    key where it is missing, of another save, cut short, corrupt, or not a plan."""
    key = _key(name, rank)
    try:
        first = client.get(key)
    except Exception as e:
        raise CheckpointError(f"checkpoint exchange: rank {rank}'s {name} is not on the "
                              f"planner ({key}): {e}") from None
    if len(first) < _HEAD.size:
        raise CheckpointError(f"checkpoint exchange: {key} holds {len(first)} bytes, not a "
                              "value a save posted")
    magic, tag_len, count, digest = _HEAD.unpack_from(first)
    theirs = first[_HEAD.size:_HEAD.size + tag_len].decode(errors="replace")
    if magic != _MAGIC or theirs != tag:
        raise CheckpointError(f"checkpoint exchange: {key} belongs to the save of '{theirs}', "
                              f"not of '{tag}' (a save that did not post it, or another "
                              "format)")
    parts = [first[_HEAD.size + tag_len:]]
    for i in range(1, count):
        try:
            parts.append(client.get(_key(name, rank, i)))
        except Exception as e:
            raise CheckpointError(f"checkpoint exchange: piece {i} of {count} of {key} is "
                                  f"missing: {e}") from None
    payload = b"".join(parts)
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint exchange: {key} ({count} pieces, {len(payload)} "
                              "bytes) does not match its checksum")
    try:
        return _Unpickler(io.BytesIO(zlib.decompress(payload))).load()
    except (pickle.UnpicklingError, zlib.error, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"checkpoint exchange: {key} is not a checkpoint's plan: "
                              f"{e}") from None
