"""Torch tensors over the daemon's buffers, without copying."""

import torch


def as_tensor(buffer):
    """A tensor over a daemon buffer: a numpy view of the host arena (host backends), or a
    DeviceBuffer of the GPU backend, whose __cuda_array_interface__ puts a CUDA tensor on the
    daemon's slab. Either way no byte is copied."""
    if hasattr(buffer, "__cuda_array_interface__"):
        return torch.as_tensor(buffer, device=f"cuda:{buffer.device}")
    return torch.from_numpy(buffer)


# The parameter dtypes fully_shard gathers and computes in.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tensor_of(array, dtype):
    """A torch tensor of `dtype` ("fp32" or "bf16") over a numpy view of a daemon buffer,
    without copying. numpy has no bfloat16: bf16 buffers arrive as uint16 arrays and are
    viewed as bfloat16."""
    t = as_tensor(array)
    want = DTYPES[dtype]
    if t.dtype == want:
        return t
    if t.element_size() != want.itemsize:
        raise RuntimeError(f"a daemon buffer of {t.dtype} cannot hold {dtype} elements")
    return t.view(want)
