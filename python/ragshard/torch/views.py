"""Torch tensors over the daemon's buffers, without copying."""

import torch


def as_tensor(buffer):
    """A tensor over a daemon buffer: a numpy view of the host arena (host backends), or a
    DeviceBuffer of the GPU backend, whose __cuda_array_interface__ puts a CUDA tensor on the
    daemon's slab. Either way no byte is copied."""
    if hasattr(buffer, "__cuda_array_interface__"):
        return torch.as_tensor(buffer, device=f"cuda:{buffer.device}")
    return torch.from_numpy(buffer)
