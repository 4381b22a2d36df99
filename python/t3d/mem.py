"""Registered memory: CPU tensors that the other ranks of a host can map (t3d_mem_alloc, one memfd each).

The host analogue of NCCL's user-buffer registration. An all_reduce, reduce_scatter, all_gather, all_to_all or
broadcast of equal blocks, of at least T3D_SHM_MAPPED_BYTES (1 MiB), on a t3d group whose ranks share a host, whose
tensors are t3d memory on every rank, reads and writes the peers' tensors in place: one copy, where other tensors
go through the shared segment (two copies). Where some rank's tensor is not t3d memory, the call takes the segment
on every rank, with the same result. Each tensor holds one file descriptor until it is freed; allocate the large
buffers you communicate (gradient buckets, activations of context parallelism) here, not every small tensor.

    x = t3d.mem.empty(1 << 24)        # float32, like torch.empty
    dist.all_reduce(x)

README, "Registered memory"; docs/architecture.md, "Registered memory".
"""

from __future__ import annotations

import math

import torch

from . import _C


def _shape(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(d) for d in size)


def empty(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.empty(*size, dtype=dtype) on the CPU, in t3d memory (contiguous, page aligned)."""
    shape = _shape(size)
    dtype = dtype or torch.get_default_dtype()
    if any(d < 0 for d in shape):
        raise ValueError(f"t3d.mem.empty: size {shape} has a negative dimension")
    es = torch.empty((), dtype=dtype).element_size()
    raw = _C._mem_bytes(math.prod(shape) * es)
    return raw.view(dtype).view(shape)


def zeros(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.zeros(*size, dtype=dtype) in t3d memory."""
    return empty(*size, dtype=dtype).zero_()


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of t's shape and dtype in t3d memory."""
    return empty(t.shape, dtype=t.dtype)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of t (on the CPU) in t3d memory."""
    return empty_like(t).copy_(t)


def is_registered(t: torch.Tensor) -> bool:
    """Whether all of t's elements lie in one t3d memory allocation of this process (then a collective may use it
    in place; it must also be contiguous for the collectives that flatten it)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    return bool(_C._mem_owns(t.data_ptr(), t.numel() * t.element_size()))
