"""The checkpoint's files: one data file and one index per writing rank, and the metadata.

A checkpoint is a directory `step_NNNNNNNN` under the checkpoint root:

    metadata.json        every stored tensor in tensor coordinates (written last, at commit)
    rank00000.bin        the bytes of the pieces rank 0 holds, one after the other
    rank00000.json       rank 0's index of them (written after its data file is on disk)
    ...
    target               the name of this directory (rank 0 chose it when the save began)

A piece is a flat element range [start, start + count) of one tensor (row-major), stored at a
byte offset of one rank's data file; it carries a CRC-32 of every CHUNK_BYTES bytes from its
start, so that a load checks exactly the chunks it reads. A save writes into a hidden
`.step_NNNNNNNN.partial` directory and renames it once every rank's index is there and the
metadata is written; `latest` names the newest complete checkpoint. A crash leaves the partial
directory, which a load refuses, and `latest` unchanged.

A second save of a step that is already on disk goes to a new directory `step_NNNNNNNN.K` (K =
1, 2, ...: a directory is never renamed over another); `latest` is then pointed at it and only
after that is the older copy removed, so that `latest` names a complete checkpoint at every
instant. The newest copy of a step is the one with the highest K.
"""
import json
import os
import re
import zlib

from .. import _faults

FORMAT = "ragshard-checkpoint/1"
CHUNK_BYTES = 1 << 20
# The largest element count, byte size or offset a metadata file may give (as ragshardctl's
# check): no file is larger, and nothing larger is allocated or read.
MAX_COUNT = 9 * 10**15
METADATA = "metadata.json"
LATEST = "latest"

# Stored dtypes: name -> (torch dtype name, bytes per element).
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2),
          "int64": ("int64", 8), "uint8": ("uint8", 1), "int8": ("int8", 1)}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupted, or not matching."""


def step_dir_name(step):
    return f"step_{int(step):08d}"


def partial_dir_name(step):
    return f".{step_dir_name(step)}.partial"


# The file in the partial directory that names the directory the save commits to (written by
# rank 0 before the save's first barrier, read by the other ranks after it).
TARGET = "target"

_DIR_NAME = re.compile(r"step_(\d{8,})(?:\.(\d+))?")


def parse_dir_name(name):
    """(step, copy) of a checkpoint directory's name (`step_N` is copy 0, `step_N.K` copy K),
    or None for any other name."""
    m = _DIR_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def step_copies(root, step):
    """The names of the directories under `root` that hold (or held) step `step`, by copy."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(parse_dir_name(n), n) for n in names]
    return [n for key, n in sorted((k, n) for k, n in found if k is not None and k[0] == step)]


def new_dir_name(root, step):
    """The directory a new save of step `step` commits to: `step_N` unless a directory of that
    step exists, else `step_N.K` with K above every copy there."""
    copies = step_copies(root, step)
    if not copies:
        return step_dir_name(step)
    return f"{step_dir_name(step)}.{parse_dir_name(copies[-1])[1] + 1}"


def data_file(pos):
    return f"rank{pos:05d}.bin"


def index_file(pos):
    return f"rank{pos:05d}.json"


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path, obj):
    """Writes `obj` to `path` through a temporary file, fsynced, then renamed over it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def kill_point(pos, step):
    """The bytes of its part of the save of step `step` after which the rank at shard position
    `pos` kills itself (the tests' fault point "checkpoint.kill_after", ragshard._faults), or
    -1: always in production."""
    after = _faults.point("checkpoint.kill_after", pos=pos, step=step)
    return -1 if after is None else int(after)


def hold_write():
    """Whether an asynchronous save's write holds after its first piece until the training
    thread waits for it (the tests' point "checkpoint.hold_write", ragshard._faults): never in
    production."""
    return bool(_faults.point("checkpoint.hold_write"))


def write_pieces(path, pieces, kill_after=-1, after_first=None):
    """Writes the pieces' bytes to `path` one after another and fsyncs it. `pieces` is a list of
    (name, start, count, dtype, memoryview of the bytes). Returns the index entries
    {name, start, count, dtype, offset, crc32: [one per chunk]}. With kill_after >= 0 (the
    tests' fault hook, kill_point) the process kills itself with SIGKILL once that many bytes
    are written. `after_first` (the tests' hook, hold_write) is called once the first piece is
    written."""
    entries, offset = [], 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for i, (name, start, count, dtype, data) in enumerate(pieces):
            if i == 1 and after_first is not None:
                after_first()
            crcs = []
            for lo in range(0, len(data), CHUNK_BYTES):
                chunk = data[lo:lo + CHUNK_BYTES]
                crcs.append(zlib.crc32(chunk))
                written = 0
                while written < len(chunk):
                    written += os.write(fd, chunk[written:])
                if 0 <= kill_after <= offset + lo + len(chunk):
                    os.fsync(fd)
                    os.kill(os.getpid(), 9)
            entries.append({"name": name, "start": int(start), "count": int(count),
                            "dtype": dtype, "offset": offset, "crc32": crcs})
            offset += len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return entries


def resolve(root, step=None):
    """The directory of the checkpoint to load: `root` itself when it is one (it has
    metadata.json), else the step `step` under it, else the one `latest` names."""
    if os.path.isfile(os.path.join(root, METADATA)):
        return root
    base = os.path.basename(os.path.normpath(root))
    if base.startswith(".") and base.endswith(".partial"):
        raise CheckpointError(f"{root}: an incomplete checkpoint (its save did not finish: no "
                              f"{METADATA}); load the previous one")
    if step is not None:
        # The newest complete copy of the step (a crash after a second save of a step
        # committed, before it removed the older copy, leaves both).
        complete = [n for n in step_copies(root, int(step))
                    if os.path.isfile(os.path.join(root, n, METADATA))]
        path = os.path.join(root, complete[-1] if complete else step_dir_name(step))
    else:
        latest = os.path.join(root, LATEST)
        if not os.path.isfile(latest):
            if not os.path.isdir(root):
                raise CheckpointError(f"{root}: no such checkpoint directory")
            raise CheckpointError(f"{root}: no complete checkpoint (no '{LATEST}' file and no "
                                  f"{METADATA})")
        with open(latest) as f:
            path = os.path.join(root, f.read().strip())
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {METADATA})")
    return path


def read_metadata(path):
    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: format {got!r}, expected {FORMAT!r}")
    chunk = meta.get("chunk_bytes")
    if not isinstance(chunk, int) or not 4096 <= chunk <= 1 << 30:
        raise CheckpointError(f"{meta_path}: chunk_bytes {chunk!r} is not 4096 to 2^30")
    if not isinstance(meta.get("tensors"), dict):
        raise CheckpointError(f"{meta_path}: no tensors")
    return meta


class Reader:
    """Reads element ranges of stored tensors, checking the CRC of every chunk it reads."""

    def __init__(self, path, meta):
        self.path, self.meta = path, meta
        self.chunk = int(meta.get("chunk_bytes", CHUNK_BYTES))
        self._fds = {}
        self._checked = {}  # (tensor, kind) -> (record, bytes per element), checked
        self.bytes_read = 0

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _fd(self, fname, what):
        """The open file `fname` of this checkpoint; `what` names the tensor and record that
        needs it, for the error."""
        if fname not in self._fds:
            where = os.path.join(self.path, fname)
            try:
                self._fds[fname] = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise CheckpointError(f"{where}: missing: {what} is stored there "
                                      f"({e.strerror})") from None
        return self._fds[fname]

    def _record(self, tensor, kind):
        """The metadata's record `kind` of `tensor`, its dtype's size and its pieces, checked:
        every piece names a plain file in this directory, has integer start, count and offset
        in range, and one CRC-32 per chunk of its bytes."""
        if (tensor, kind) in self._checked:
            return self._checked[tensor, kind]
        what = f"tensor '{tensor}' ({kind})"
        t = self.meta["tensors"].get(tensor)
        rec = t.get(kind) if isinstance(t, dict) else None
        if rec is None:
            raise CheckpointError(f"{self.path}: no '{kind}' stored for tensor '{tensor}'")
        if not isinstance(rec, dict) or rec.get("dtype") not in DTYPES or \
                not isinstance(rec.get("pieces"), list):
            dtype = rec.get("dtype") if isinstance(rec, dict) else None
            raise CheckpointError(f"{self.path}: {what}: the metadata gives no known dtype "
                                  f"({dtype!r}) or no list of pieces")
        item = DTYPES[rec["dtype"]][1]
        for p in rec["pieces"]:
            if not isinstance(p, dict):
                raise CheckpointError(f"{self.path}: {what}: a piece is not an object: {p!r}")
            fname = p.get("file")
            if not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or \
                    "\0" in fname:
                raise CheckpointError(f"{self.path}: {what} names no valid file: {fname!r} "
                                      "(a file name in the checkpoint's directory)")
            where = os.path.join(self.path, fname)
            nums = [p.get(k) for k in ("start", "count", "offset")]
            if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT
                       for v in nums) or p["count"] * item > MAX_COUNT:
                raise CheckpointError(f"{where}: {what}: a piece with start {nums[0]!r}, count "
                                      f"{nums[1]!r} and offset {nums[2]!r} is out of range")
            crcs = p.get("crc32")
            chunks = -(-p["count"] * item // self.chunk)
            if not isinstance(crcs, list) or len(crcs) != chunks:
                listed = len(crcs) if isinstance(crcs, list) else "none"
                raise CheckpointError(f"{where}: {what}: the metadata lists no CRC for every "
                                      f"chunk ({listed} listed, {chunks} chunks)")
        self._checked[tensor, kind] = rec, item
        return rec, item

    def read(self, tensor, kind, lo, hi):
        """The bytes of elements [lo, hi) of stored tensor `tensor`, record `kind` ("param",
        "exp_avg", ...), from the pieces that hold them, as a writable memoryview; raises
        CheckpointError if the metadata is malformed or a piece is missing, short or
        corrupted (naming the file and the tensor)."""
        rec, item = self._record(tensor, kind)
        parts, covered = [], 0
        for p in rec["pieces"]:
            a, b = max(lo, p["start"]), min(hi, p["start"] + p["count"])
            if a >= b:
                continue
            parts.append((a, self._read_piece(tensor, kind, p, p["count"] * item,
                                              (a - p["start"]) * item, (b - p["start"]) * item)))
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self.path}: tensor '{tensor}' ({kind}): elements "
                                  f"[{lo}, {hi}) are not all stored ({covered} found)")
        if len(parts) == 1:
            return parts[0][1], rec["dtype"]  # one piece holds the range: no copy
        out = memoryview(_buffer((hi - lo) * item))
        for a, data in parts:
            out[(a - lo) * item:(a - lo) * item + len(data)] = data
        return out, rec["dtype"]

    def _read_piece(self, tensor, kind, p, size, lo, hi):
        """Bytes [lo, hi) of piece `p` (of `size` bytes, checked by _record), reading and
        checking the chunks that cover them."""
        fname = p["file"]
        first, last = lo // self.chunk, (hi - 1) // self.chunk
        start = first * self.chunk
        end = min((last + 1) * self.chunk, size)
        fd = self._fd(fname, f"tensor '{tensor}' ({kind})")
        where = os.path.join(self.path, fname)
        file_size = os.fstat(fd).st_size
        if p["offset"] + end > file_size:  # before allocating what a bad index asks for
            raise CheckpointError(f"{where}: truncated: tensor '{tensor}' ({kind}) needs bytes "
                                  f"[{p['offset'] + start}, {p['offset'] + end}), the file ends "
                                  f"at {file_size}")
        view = memoryview(_buffer(end - start))
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], p["offset"] + start + got)
            if n == 0:
                break
            got += n
        self.bytes_read += got
        if got != end - start:
            raise CheckpointError(f"{where}: truncated: tensor '{tensor}' ({kind}) needs bytes "
                                  f"[{p['offset'] + start}, {p['offset'] + end}), the file ends "
                                  f"at {p['offset'] + start + got}")
        for c in range(first, last + 1):
            chunk = view[(c - first) * self.chunk:(c - first + 1) * self.chunk]
            if zlib.crc32(chunk) != p["crc32"][c]:
                raise CheckpointError(
                    f"{where}: corrupted: tensor '{tensor}' ({kind}), chunk {c} at byte "
                    f"{p['offset'] + c * self.chunk} fails its CRC-32")
        return view[lo - start:hi - start]


def _buffer(n):
    """A writable buffer of n bytes, not zero-filled (numpy's empty)."""
    import numpy
    return numpy.empty(n, dtype=numpy.uint8)
