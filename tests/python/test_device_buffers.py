"""The GPU backend's buffers as the binding exposes them: DeviceBuffer objects whose
__cuda_array_interface__ torch turns into CUDA tensors without a copy. There is no GPU here, so
the client runs with device_memory="fake": the device path (pointers from the slab's base plus
the daemon's placements, shapes, typestrs) over the host arena of a device-shaped daemon, where
the pointers can be read and written through ctypes. The real slab (cuIpcOpenMemHandle) is
exercised on a GPU by tests/server/daemon/cuda and the GPU bundle (docs/daemon.md, "GPU backend")."""
import ctypes
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

CTYPES = {"<f4": ctypes.c_float, "<u2": ctypes.c_uint16, "|u1": ctypes.c_uint8}
INV = {"units": [
    {"name": "a", "tensors": [{"name": "w", "shape": [64, 8], "dtype": "fp32",
                               "granule": "rows:8"}]},
    {"name": "b", "tensors": [{"name": "v", "shape": [96], "dtype": "bf16"}]}]}


@pytest.fixture(scope="module")
def clients():
    with LocalCluster(BUILD, daemons=1, pool_bytes=64 << 20, backend="device-shaped") as c:
        pair = c.attach("device-buffers", INV, device_memory="fake")
        yield pair


def array(buffer):
    """The memory behind a DeviceBuffer, read and written as numpy (host memory here)."""
    cai = buffer.__cuda_array_interface__
    (n,) = cai["shape"]
    return np.ctypeslib.as_array((CTYPES[cai["typestr"]] * n).from_address(cai["data"][0]))


def both(pair, op, *args):
    handles = [getattr(c, op)(*args) for c in pair]
    for h in handles:
        h.wait()


def test_interface_names_pointer_shape_and_type_of_each_buffer(clients):
    a, _ = clients
    for u, typestr in ((0, "<f4"), (1, "<u2")):
        s = a.shard_elems(u)
        shard = a.param_shard(u)
        cai = shard.__cuda_array_interface__
        assert isinstance(shard, ragshard.DeviceBuffer)
        assert cai["version"] == 3 and cai["strides"] is None
        assert cai["shape"] == (s,) and cai["typestr"] == typestr
        assert cai["data"][1] is False and cai["data"][0] == shard.ptr and shard.ptr != 0
        assert len(shard) == s
        g = a.grad_shard(u).__cuda_array_interface__
        assert g["shape"] == (s,) and g["typestr"] == "<f4"  # gradient shards are fp32
        assert g["data"][0] != cai["data"][0]
        # Transient buffers have no pointer while released.
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION.*unsharded parameters"):
            a.unsharded(u)


def test_an_all_gather_and_a_reduce_scatter_through_the_pointers(clients):
    for u in (0, 1):
        s = clients[0].shard_elems(u)
        for r, c in enumerate(clients):
            mine = array(c.param_shard(u))
            # Small integers: exact in bf16 (as the high half of their fp32 bits).
            values = (np.arange(s) % 16 + 64 * r).astype(np.float32)
            mine[:] = values if mine.dtype == np.float32 else \
                (values.view(np.uint32) >> 16).astype(np.uint16)
        both(clients, "unshard", u)
        for c in clients:
            full = c.unsharded(u)
            assert full.__cuda_array_interface__["shape"] == (2 * s,)
            got = array(full)
            got = got if got.dtype == np.float32 else \
                (got.astype(np.uint32) << 16).view(np.float32)
            want = np.concatenate([np.arange(s) % 16 + 64 * r for r in range(2)])
            np.testing.assert_array_equal(got, want)
        both(clients, "reshard", u)
        both(clients, "allocate_grad", u)
        for r, c in enumerate(clients):
            grad = array(c.grad(u))
            assert grad.shape == (2 * s,)
            ones = np.full(2 * s, r + 1, dtype=np.float32)
            grad[:] = ones if grad.dtype == np.float32 else \
                (ones.view(np.uint32) >> 16).astype(np.uint16)
        both(clients, "reduce_scatter", u, "sum")
        for c in clients:
            np.testing.assert_array_equal(array(c.grad_shard(u)), np.full(s, 3, np.float32))


def test_a_host_backend_client_without_fake_memory_keeps_numpy_views(tmp_path):
    with pytest.raises(ValueError, match="device_memory: 'gpu' is not one of auto, fake"):
        ragshard.Client("127.0.0.1:1", str(tmp_path / "none.sock"), "j", 0,
                        device_memory="gpu")


def test_state_beside_the_shards_is_device_memory_and_the_journals_marks_host(clients):
    """The optimizers' state and the undo copies live in the rank's memory (pool_contract.h,
    InRankMemory): on a GPU its slab, which the client hands out as it hands out the shards, so
    that they are CUDA tensors beside the parameters; the journal's marks stay host memory of
    the pool, which the daemon reads directly."""
    from ragshard import _pool
    a, b = clients
    name = _pool.optimizer_state("adam", "exp_avg", 0)
    opt, existed = a.state_buffer(name, 64)
    assert isinstance(opt, ragshard.DeviceBuffer) and not existed
    cai = opt.__cuda_array_interface__
    assert cai["typestr"] == "|u1" and cai["shape"] == (64,) and cai["data"][0] == opt.ptr
    assert bytes((ctypes.c_uint8 * 64).from_address(opt.ptr)) == bytes(64)  # zeroed
    (ctypes.c_uint8 * 64).from_address(opt.ptr)[3] = 7
    again, existed = a.state_buffer(name, 64)
    assert existed and again.ptr == opt.ptr
    assert (ctypes.c_uint8 * 64).from_address(again.ptr)[3] == 7
    other, existed = b.state_buffer(name, 64)  # another rank's own
    assert isinstance(other, ragshard.DeviceBuffer) and not existed and other.ptr != opt.ptr
    undo, _ = a.state_buffer(_pool.journal_undo(name), 64)
    assert isinstance(undo, ragshard.DeviceBuffer) and undo.ptr not in (opt.ptr, other.ptr)
    meta, _ = a.state_buffer(_pool.JOURNAL_META, 8 * _pool.JOURNAL_META_FIELDS)
    assert isinstance(meta, np.ndarray) and meta.dtype == np.uint8
    assert meta.shape == (8 * _pool.JOURNAL_META_FIELDS,)
