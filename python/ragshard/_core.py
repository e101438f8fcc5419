"""ragshard._core: the C++ client library (libragshard_c.so, python/ragshard_c.h) through ctypes.

Loaded with ctypes over a C ABI, the library depends on no CPython version: one build imports
under any CPython 3.10 to 3.13 (docs/gpu.md). ctypes releases the GIL around every call.

numpy arrays view the daemon's buffers without copying (their base object keeps the client, hence
the mapping, alive); bf16 and fp16 buffers are uint16 arrays, to be viewed with torch's
.view(torch.bfloat16). Buffers in device memory are DeviceBuffers, whose
__cuda_array_interface__ torch turns into CUDA tensors without a copy. Errors raise Error
(a RuntimeError) with the status code's name first; a unit out of range raises IndexError and a
bad argument ValueError. The daemon's recovery notice raises RecoveryInProgress, a SystemExit
with status RECOVERY_EXIT (docs/recovery.md, "What happens when a rank process dies").
"""
import atexit
import ctypes
import enum
import json
import os
import sys
import time
import weakref

# The daemon's recovery notice, and what a rank does on it: RECOVERY_EXIT is its exit status,
# RecoveryInProgress what it raises (ragshard._notice).
from . import _notice
from ._notice import RECOVERY_EXIT, RECOVERY_NOTICE, RecoveryInProgress  # noqa: F401

ABI_VERSION = 13
_BAD_ARGUMENT, _OUT_OF_RANGE = -1, -2


class OpKind(enum.IntEnum):
    """The daemon's operations: ragshard.v1.OpKind (proto/ragshard/v1/daemon.proto), passed
    down to the daemon as these numbers."""
    UNSHARD = 1
    RESHARD = 2
    REDUCE_SCATTER = 3
    ALL_REDUCE = 5
    GATHER_TO_OWNER = 6
    SCATTER_FROM_OWNER = 7
    ALLOCATE_GRAD = 8
    ALLOCATE_UNSHARDED = 9
    UPDATE_GATHER = 10
    PROTECT = 11
    REBUILD = 12
    PROTECT_FINISH = 13


class ReduceKind(enum.IntEnum):
    """ragshard.v1.ReduceKind."""
    SUM = 0
    AVG = 1


def _reduce(op):
    if op == "avg":
        return ReduceKind.AVG
    if op == "sum":
        return ReduceKind.SUM
    raise ValueError(f"op: {op!r} is not one of avg, sum")


_BUFFER_KINDS = {"param_shard": 0, "unsharded": 1, "grad": 2, "grad_shard": 3, "owner_buffer": 4}


class Error(RuntimeError):
    """A failed call of the client library: "CODE: message" (absl's status code names)."""


class _Security(ctypes.Structure):
    """rs_security (python/ragshard_c.h): a NULL field takes its environment variable."""
    _fields_ = [("token_file", ctypes.c_char_p), ("tls_ca", ctypes.c_char_p),
                ("tls_cert", ctypes.c_char_p), ("tls_key", ctypes.c_char_p),
                ("tls_server_name", ctypes.c_char_p)]


def _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name):
    """How a client reaches the planner. token_file "" is RAGSHARD_TOKEN_FILE's; a TLS option
    None is its variable's (RAGSHARD_TLS_CA, RAGSHARD_TLS_CERT, RAGSHARD_TLS_KEY,
    RAGSHARD_TLS_SERVER_NAME; unset: none), "" none: without tls_ca the client speaks plaintext.
    The structure refers to its strings' bytes: keep it alive for the call."""
    return _Security(_b(token_file), _b(tls_ca), _b(tls_cert), _b(tls_key), _b(tls_server_name))


def _load():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libragshard_c.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"ragshard: cannot load the client library {path}: {e}") from None
    c_p, i64, i32, cstr = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    out_str = ctypes.POINTER(cstr)
    sigs = {
        "rs_abi_version": (i32, []),
        "rs_pool_contract": (i32, [ctypes.POINTER(cstr)]),
        "rs_redundancy": (i32, [cstr, cstr, i64, ctypes.POINTER(cstr)]),
        "rs_last_error": (cstr, []),
        "rs_client_create_secure": (i32, [cstr, cstr, cstr, i64, cstr, i64,
                                          ctypes.POINTER(_Security), i32, ctypes.POINTER(c_p)]),
        "rs_client_destroy": (None, [c_p]),
        "rs_client_register": (i32, [c_p, cstr, i32, i64]),
        "rs_client_attach": (i32, [c_p, i32]),
        "rs_client_release_salvaged": (i32, [c_p]),
        "rs_client_plan_json": (i32, [c_p, out_str]),
        "rs_client_shape": (None, [c_p, ctypes.POINTER(i64), ctypes.POINTER(i32)]),
        "rs_client_unit_dtype": (i32, [c_p, i32, out_str]),
        "rs_client_shard_elems": (i32, [c_p, i32, ctypes.POINTER(i64)]),
        "rs_client_layout": (i32, [c_p, i32, ctypes.POINTER(i64)]),
        "rs_client_buffer": (i32, [c_p, i32, i32, ctypes.POINTER(ctypes.c_size_t),
                                   ctypes.POINTER(i64), out_str]),
        "rs_client_op": (i32, [c_p, i32, i32, i32, i32, i32, ctypes.POINTER(c_p)]),
        "rs_client_noop": (i32, [c_p]),
        "rs_client_stats": (i32, [c_p, out_str]),
        "rs_client_put": (i32, [c_p, cstr, c_p, i64]),
        "rs_client_get": (i32, [c_p, cstr, i64, ctypes.POINTER(c_p), ctypes.POINTER(i64)]),
        "rs_client_state_buffer": (i32, [c_p, cstr, i64, ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.POINTER(i32), ctypes.POINTER(i32)]),
        "rs_client_redundancy": (None, [c_p, ctypes.POINTER(cstr), ctypes.POINTER(i32)]),
        "rs_client_recovery": (None, [c_p, ctypes.POINTER(i64), ctypes.POINTER(i32),
                                      ctypes.POINTER(i32)]),
        "rs_handle_wait": (i32, [c_p, i64]),
        "rs_handle_poll": (i32, [c_p, ctypes.POINTER(i32)]),
        "rs_handle_times": (None, [c_p, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        "rs_handle_destroy": (None, [c_p]),
        "rs_create_job_secure": (i32, [cstr, cstr, i64, i64, cstr, cstr,
                                       ctypes.POINTER(_Security), cstr, i64, cstr, i64, i64,
                                       cstr, cstr, out_str]),
        "rs_delete_job_secure": (i32, [cstr, cstr, ctypes.POINTER(_Security)]),
        "rs_job_world_size_secure": (i32, [cstr, cstr, ctypes.POINTER(_Security),
                                           ctypes.POINTER(i64)]),
        "rs_job_json": (i32, [cstr, cstr, ctypes.POINTER(_Security), out_str]),
        "rs_plan_local": (i32, [cstr, i64, cstr, ctypes.c_int32, out_str]),
        "rs_data_plane_peak": (None, [ctypes.POINTER(i64), ctypes.POINTER(i64),
                                      ctypes.POINTER(ctypes.c_double), ctypes.POINTER(i64), i64,
                                      i64, i32, i64, i64, i64, i64, i64,
                                      ctypes.POINTER(ctypes.c_double)]),
        "rs_dequantize_chunks": (i32, [c_p, i64, c_p, i64, c_p, c_p, i64, c_p, i64]),
        "rs_block_amax": (i32, [c_p, i64, c_p, i64, c_p, i64]),
        "rs_encode_chunks": (i32, [c_p, i64, c_p, i64, c_p, i64, i32, c_p, i64]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    if lib.rs_abi_version() != ABI_VERSION:
        raise ImportError(f"ragshard: {path} has ABI version {lib.rs_abi_version()}, this "
                          f"package needs {ABI_VERSION}: rebuild the package")
    return lib


_lib = _load()


def _b(s):
    return s.encode() if isinstance(s, str) else s


def _check(code):
    """The C library's result `code` of a call: nothing for success, else the error it names.
    The recovery notice raises RecoveryInProgress; any call once it came, RecoveryInProgress
    again or an Error saying that the process must exit (_notice.after)."""
    if _notice.told():
        raise Error(_notice.after())
    if code == 0:
        return
    message = _lib.rs_last_error().decode(errors="replace")
    if code == _BAD_ARGUMENT:
        raise ValueError(message)
    if code == _OUT_OF_RANGE:
        raise IndexError(message)
    if RECOVERY_NOTICE in message:
        _notice.notice(message)
    raise Error(message)


def _unit(unit):
    """A unit index as the C ABI's int (ctypes would wrap larger ones silently)."""
    u = int(unit)
    if not -2**31 <= u < 2**31:
        raise IndexError(f"unit {u} does not exist")
    return u


class _NoCopy:
    """The object owns a C pointer that it frees once: it cannot be copied or pickled."""

    def __copy__(self):
        raise TypeError(f"a ragshard {type(self).__name__} cannot be copied")

    def __deepcopy__(self, memo):
        raise TypeError(f"a ragshard {type(self).__name__} cannot be copied")

    def __reduce__(self):
        raise TypeError(f"a ragshard {type(self).__name__} cannot be pickled")


def _string(call, *args):
    out = ctypes.c_char_p()
    _check(call(*args, ctypes.byref(out)))
    return out.value.decode()


class _HostView:
    """A host buffer as numpy's array interface; the array's base, it keeps the client alive."""

    def __init__(self, owner, ptr, count, typestr):
        self.owner = owner
        self.__array_interface__ = {"shape": (count,), "typestr": typestr,
                                    "data": (ptr, False), "version": 3}


class DeviceBuffer:
    """A daemon buffer in device memory; torch.as_tensor(b, device='cuda') builds a tensor on it
    without a copy. It keeps its client, and so the mapping of the slab, alive."""

    def __init__(self, owner, ptr, count, typestr, device):
        self.owner, self.ptr, self.device = owner, ptr, device
        self._count, self._typestr = count, typestr

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self._count,), "typestr": self._typestr, "data": (self.ptr, False),
                "strides": None, "version": 3}

    def __len__(self):
        return self._count


# How much longer than its operation's timeout a rank's wait() waits by default: the daemon's
# verdict at the deadline (giving up a transfer takes it a moment) comes first.
WAIT_GRACE_MS = 10000


class Handle(_NoCopy):
    """An operation in flight: wait() until it is done (an Error if it failed), or poll()."""

    def __init__(self, owner, handle, traced=None):
        self._owner = owner  # keeps the client alive while the handle exists
        self._h = handle
        self._traced = traced  # (kind, unit, issued ns) while the client traces

    def wait(self, timeout_ms=None):
        """Until the operation is done, at most `timeout_ms`. By default, its client's timeout
        (the operation's deadline at its daemon, which then fails it naming what it waited
        for, e.g. a peer that answers nothing) and WAIT_GRACE_MS more for that answer to
        come."""
        if timeout_ms is None:
            timeout_ms = self._owner._settings["timeout_ms"] + WAIT_GRACE_MS
        _check(_lib.rs_handle_wait(self._h, int(timeout_ms)))
        if self._traced is not None and self._owner.trace is not None:
            kind, unit, issued = self._traced
            self._traced = None
            started, finished = self.times()
            self._owner.trace.append({"event": "op", "kind": kind.name.lower(), "unit": unit,
                                      "issued": issued, "started": started,
                                      "finished": finished, "waited": time.monotonic_ns()})

    def times(self):
        """When the daemon ran the finished operation, (start, end) in time.monotonic_ns();
        (0, 0) before it finished or where the daemon did not say (over gRPC)."""
        started, finished = ctypes.c_int64(), ctypes.c_int64()
        _lib.rs_handle_times(self._h, ctypes.byref(started), ctypes.byref(finished))
        return started.value, finished.value

    def poll(self):
        done = ctypes.c_int()
        _check(_lib.rs_handle_poll(self._h, ctypes.byref(done)))
        return bool(done.value)

    def __del__(self):
        if getattr(self, "_h", None):
            _lib.rs_handle_destroy(self._h)
            self._h = None


# The places of a unit's buffer whose arrays a client keeps (Client._buffer); fully_shard keeps
# its views of as many (ragshard.torch.fsdp.buffers).
BUFFER_PLACES_KEPT = 4


class Client(_NoCopy):
    """One rank's connection to its planner and its node's daemon.

    The planner is reached with the bearer token in `token_file` ("": RAGSHARD_TOKEN_FILE's)
    and, where `tls_ca` names the planner's CA, over TLS: `tls_cert` and `tls_key` are this
    client's certificate for mutual TLS, `tls_server_name` the name to check in the planner's
    certificate (default: the host of `planner`). A TLS option left None takes RAGSHARD_TLS_CA,
    RAGSHARD_TLS_CERT, RAGSHARD_TLS_KEY or RAGSHARD_TLS_SERVER_NAME; "" is none. `local_ranks`
    is the job's ranks on this node (LOCAL_WORLD_SIZE): the daemon registers them with the
    planner in one call once they all have registered (0: not known, this rank alone)."""

    def __init__(self, planner, socket, job, rank, node="", timeout_ms=60000, token_file="",
                 device_memory="auto", tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, local_ranks=0):
        self._c = None
        if int(local_ranks) < 0:
            raise ValueError(f"local_ranks: {local_ranks} must not be negative (0: not known)")
        self.local_ranks = int(local_ranks)
        if device_memory not in ("auto", "fake"):
            raise ValueError(f"device_memory: '{device_memory}' is not one of auto, fake")
        c = ctypes.c_void_p()
        security = _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name)
        _check(_lib.rs_client_create_secure(_b(planner), _b(socket), _b(job), int(rank), _b(node),
                                            int(timeout_ms), ctypes.byref(security),
                                            int(device_memory == "fake"), ctypes.byref(c)))
        self._c = c
        _OPEN.add(self)
        self.job = job
        # What `for_job` makes another client of (a shrink's successor or predecessor).
        self._settings = dict(planner=planner, socket=socket, node=node, timeout_ms=timeout_ms,
                              token_file=token_file, device_memory=device_memory, tls_ca=tls_ca,
                              tls_cert=tls_cert, tls_key=tls_key,
                              tls_server_name=tls_server_name, local_ranks=local_ranks)
        # (unit, kind) -> {(address, count, typestr): the array over it}: a buffer the daemon
        # places at an address it had before is the same memory, and its array is reused (a
        # unit's unsharded buffer usually alternates between two places, forward and backward).
        self._arrays = {}
        # A list to record operations in (each waited operation's kind, unit, and when it was
        # issued, run by the daemon and waited for; time.monotonic_ns()), or None.
        self.trace = None

    def __del__(self):
        self.close()

    def for_job(self, job, rank):
        """A new Client with this one's planner, daemon and settings, for rank `rank` of job
        `job` (a shrunk job's successor, or its predecessor to salvage the state from)."""
        return Client(job=job, rank=rank, **self._settings)

    def job_info(self, job=None):
        """The planner's answer for `job` (default: this client's), as `job_info` gives it."""
        s = self._settings
        return job_info(s["planner"], job or self.job, s["token_file"], s["tls_ca"],
                        s["tls_cert"], s["tls_key"], s["tls_server_name"])

    def close(self):
        """Detaches from the daemon (a rank that leaves, rather than one lost: in a job that
        recovers in place only a lost process starts a recovery). Also at the interpreter's
        exit, for every client still open."""
        if getattr(self, "_c", None):
            _lib.rs_client_destroy(self._c)
            self._c = None

    def register(self, inventory_json, send_full=True):
        """Registers this rank through its node's daemon, which registers the node's ranks with
        the planner in one call once `local_ranks` of them have asked (0: this rank alone)."""
        _check(_lib.rs_client_register(self._c, _b(inventory_json), int(bool(send_full)),
                                       self.local_ranks))

    def attach(self, salvage=False):
        """Attaches to the daemon. `salvage`: only to read this rank's state of a job that cannot
        go on (a shrunk job's, whose successor takes it over: docs/recovery.md, "Shrinking in
        place"); no operation of the job runs."""
        _check(_lib.rs_client_attach(self._c, 1 if salvage else 0))

    def release_salvaged(self):
        """After attach(salvage=True), once every survivor of the shrink has taken its state
        over: detaches, and the daemon drops the stopped job, its buffers on this node back to
        the pool (tensors over them must not be read again). False on NOT_FOUND: another rank
        of the node released it first, or the planner no longer has the job (deleted: the
        daemon drops it then on its own)."""
        try:
            _check(_lib.rs_client_release_salvaged(self._c))
        except Error as e:
            if str(e).startswith("NOT_FOUND"):
                return False
            raise
        return True

    def plan_json(self):
        return _string(_lib.rs_client_plan_json, self._c)

    def _shape(self):
        out, on_device = (ctypes.c_int64 * 5)(), ctypes.c_int()
        _lib.rs_client_shape(self._c, out, ctypes.byref(on_device))
        return list(out), bool(on_device.value)

    units = property(lambda self: self._shape()[0][0])
    world_size = property(lambda self: self._shape()[0][1])
    replicas = property(lambda self: self._shape()[0][2])
    rank = property(lambda self: self._shape()[0][3])

    def unit_dtype(self, unit):
        return _string(_lib.rs_client_unit_dtype, self._c, _unit(unit))

    def shard_elems(self, unit):
        out = ctypes.c_int64()
        _check(_lib.rs_client_shard_elems(self._c, _unit(unit), ctypes.byref(out)))
        return out.value

    def layout(self, unit):
        """This rank's layout of `unit` under the job's AMSP factors (engine/sharding.h): a
        dict of its positions p, g and os, whether it steps the optimizer (`steps`: False where
        another local rank steps the same range in shared memory), the gradient shard's
        elements (`grad_elems`), and its optimizer range: `os_elems` elements at `os_param`
        in the parameter shard and `os_grad` in the gradient shard; and its os group's index
        (`os_group`: the ranks of group 0 hold every os position once)."""
        out = (ctypes.c_int64 * 9)()
        _check(_lib.rs_client_layout(self._c, _unit(unit), out))
        keys = ("p", "g", "os", "steps", "grad_elems", "os_elems", "os_param", "os_grad",
                "os_group")
        d = dict(zip(keys, list(out)))
        d["steps"] = bool(d["steps"])
        return d

    def _buffer(self, unit, kind):
        ptr, count, typestr = ctypes.c_size_t(), ctypes.c_int64(), ctypes.c_char_p()
        _check(_lib.rs_client_buffer(self._c, _unit(unit), _BUFFER_KINDS[kind], ctypes.byref(ptr),
                                     ctypes.byref(count), ctypes.byref(typestr)))
        if count.value < 0:
            return None
        where = (ptr.value, count.value, typestr.value)
        places = self._arrays.setdefault((unit, kind), {})
        if where in places:
            return places[where]
        shape, on_device = self._shape()
        if on_device:
            array = DeviceBuffer(self, ptr.value, count.value, typestr.value.decode(), shape[4])
        else:
            import numpy as np
            array = np.asarray(_HostView(self, ptr.value, count.value, typestr.value.decode()))
        if len(places) >= BUFFER_PLACES_KEPT:
            del places[next(iter(places))]  # the oldest
        places[where] = array
        return array

    def param_shard(self, unit):
        return self._buffer(unit, "param_shard")

    def unsharded(self, unit):
        return self._buffer(unit, "unsharded")

    def grad(self, unit):
        return self._buffer(unit, "grad")

    def grad_shard(self, unit):
        return self._buffer(unit, "grad_shard")

    def owner_buffer(self, unit):
        return self._buffer(unit, "owner_buffer")

    def _op(self, kind, unit, reduce=ReduceKind.SUM, keep=0, accumulate=False):
        h = ctypes.c_void_p()
        issued = time.monotonic_ns()
        _check(_lib.rs_client_op(self._c, int(kind), _unit(unit), int(reduce), int(keep),
                                 int(bool(accumulate)), ctypes.byref(h)))
        return Handle(self, h, (kind, unit, issued) if self.trace is not None else None)

    def unshard(self, unit):
        return self._op(OpKind.UNSHARD, unit)

    def reshard(self, unit, keep=0):
        return self._op(OpKind.RESHARD, unit, keep=keep)

    def allocate_unsharded(self, unit):
        return self._op(OpKind.ALLOCATE_UNSHARDED, unit)

    def allocate_grad(self, unit):
        return self._op(OpKind.ALLOCATE_GRAD, unit)

    def reduce_scatter(self, unit, op="avg", accumulate=False):
        """Reduces unit `unit`'s gradients (op "avg" or "sum") into this rank's gradient shard
        and releases them; `accumulate`: added to what the shard holds (repeated backward
        passes add up), else the shard is replaced."""
        return self._op(OpKind.REDUCE_SCATTER, unit, _reduce(op), accumulate=accumulate)

    def all_reduce(self, unit, op="avg"):
        return self._op(OpKind.ALL_REDUCE, unit, _reduce(op))

    def gather_to_owner(self, unit):
        return self._op(OpKind.GATHER_TO_OWNER, unit)

    def scatter_from_owner(self, unit):
        return self._op(OpKind.SCATTER_FROM_OWNER, unit)

    def update_gather(self, unit):
        return self._op(OpKind.UPDATE_GATHER, unit)

    def noop(self):
        _check(_lib.rs_client_noop(self._c))

    def put(self, key, value):
        """Sets `key` of this client's job on the planner to `value` (bytes; the planner takes
        up to --max-value-bytes, 1 MiB by default): the job's rendezvous keys, which every rank
        of the job may read (`get`), kept until the job is deleted. A later put replaces it."""
        value = bytes(value)
        _check(_lib.rs_client_put(self._c, _b(key), value, len(value)))

    def get(self, key, wait_ms=0):
        """The value (bytes) of `key` of this client's job on the planner, waiting up to
        `wait_ms` for a rank to put it: ragshard.Error (DEADLINE_EXCEEDED or NOT_FOUND, naming
        the key) where none did."""
        ptr, n = ctypes.c_void_p(), ctypes.c_int64()
        _check(_lib.rs_client_get(self._c, _b(key), int(wait_ms), ctypes.byref(ptr),
                                  ctypes.byref(n)))
        return ctypes.string_at(ptr, n.value) if n.value else b""

    def stats(self):
        return json.loads(_string(_lib.rs_client_stats, self._c))

    def state_buffer(self, name, nbytes):
        """(the bytes of a buffer of this rank's own in the daemon, whether it existed): kept by
        `name` for the job's life, so that a restarted process of this rank gets it back with
        what was written (docs/recovery.md); a new one is zeros. A uint8 numpy array in host
        memory, or a DeviceBuffer of uint8 where the buffer lives beside the rank's parameter
        shards on a GPU (the optimizers' state and undo copies on the cuda backend)."""
        import numpy as np
        ptr, existed, on_device = ctypes.c_size_t(), ctypes.c_int(), ctypes.c_int()
        _check(_lib.rs_client_state_buffer(self._c, _b(name), int(nbytes), ctypes.byref(ptr),
                                           ctypes.byref(existed), ctypes.byref(on_device)))
        if on_device.value:
            shape, _ = self._shape()
            return DeviceBuffer(self, ptr.value, int(nbytes), "|u1", shape[4]), bool(existed.value)
        return np.asarray(_HostView(self, ptr.value, int(nbytes), "|u1")), bool(existed.value)

    def _recovery(self):
        epoch, adopted, recoverable = ctypes.c_int64(), ctypes.c_int(), ctypes.c_int()
        _lib.rs_client_recovery(self._c, ctypes.byref(epoch), ctypes.byref(adopted),
                                ctypes.byref(recoverable))
        return epoch.value, bool(adopted.value), bool(recoverable.value)

    recovery_epoch = property(lambda self: self._recovery()[0],
                              doc="The job's recovery epoch this attachment runs in.")
    adopted = property(lambda self: self._recovery()[1],
                       doc="Whether this rank adopted the state a previous process of it left "
                           "in the daemon (a recovery in place): its shards hold trained "
                           "values, not to be initialized again.")
    recoverable = property(lambda self: self._recovery()[2],
                           doc="Whether the job recovers lost rank processes in place.")

    def _redundancy(self):
        text, replacement = ctypes.c_char_p(), ctypes.c_int()
        _lib.rs_client_redundancy(self._c, ctypes.byref(text), ctypes.byref(replacement))
        return (text.value or b"").decode(), bool(replacement.value)

    redundancy = property(lambda self: self._redundancy()[0],
                          doc="The job's redundancy across nodes: '' (none), 'parity:K' or "
                              "'replica' (docs/recovery.md, \"A lost node\").")
    replacement = property(lambda self: self._redundancy()[1],
                           doc="Whether this rank's daemon replaced a lost node: the rank's "
                               "state is rebuilt from the other nodes (rebuild()).")

    def protect(self):
        """OP_PROTECT: starts protecting this rank's persistent state into the job's redundancy
        (every rank, once a step commits); the daemon moves it in the background of the
        operations that follow, until protect_finish()."""
        return self._op(OpKind.PROTECT, 0)

    def protect_finish(self):
        """OP_PROTECT_FINISH: the protect under way, whole on every node (every rank, before a
        step changes the state)."""
        return self._op(OpKind.PROTECT_FINISH, 0)

    def rebuild(self):
        """OP_REBUILD: a replacement node's ranks' state from the other nodes (every rank,
        once all are back at the step they agreed on)."""
        return self._op(OpKind.REBUILD, 0)


_OPEN = weakref.WeakSet()  # the clients not yet closed
# Whether this process is ending on an uncaught exception: sys.excepthook, which the interpreter
# (and ragshard-launch --preload for a forked rank) calls for one, sets it. Such a process is
# lost, not leaving: in a job that recovers in place its clients stay attached to the end, so
# that their daemons start a recovery, as for a killed process (docs/recovery.md, "A rank that
# crashes"). KeyboardInterrupt and SystemExit (sys.exit, the recovery notice) leave as before.
_CRASHED = False
_previous_excepthook = sys.excepthook


def _excepthook(kind, value, tb):
    global _CRASHED
    if issubclass(kind, Exception):
        _CRASHED = True
    _previous_excepthook(kind, value, tb)


sys.excepthook = _excepthook


@atexit.register
def _close_open_clients():
    for client in list(_OPEN):
        if _CRASHED and getattr(client, "_c", None) and client.recoverable:
            continue  # lost: the side channel closes with the process
        client.close()


# The planner's job calls and the C library's kernels, in files of their own; ragshard._core's
# callers keep reaching them here.
from ._jobs import create_job, delete_job, job_info, job_world_size, redundancy  # noqa: E402,F401
from ._kernels import (block_amax, data_plane_peak, dequantize_chunks,  # noqa: E402,F401
                       encode_chunks, plan_local)
