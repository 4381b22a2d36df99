"""Registered memory: CPU tensors that the other ranks of a host can map (t3d_mem_alloc, one memfd each).

The host analogue of NCCL's user-buffer registration. An all_reduce, reduce_scatter, all_gather, all_to_all or
broadcast of equal blocks, of at least T3D_SHM_MAPPED_BYTES (1 MiB), on a t3d group whose ranks share a host, whose
tensors are t3d memory on every rank, reads and writes the peers' tensors in place: one copy, where other tensors
go through the shared segment (two copies). Where some rank's tensor is not t3d memory, the call takes the segment
on every rank, with the same result. Each tensor holds one file descriptor until it is freed; allocate the large
buffers you communicate (gradient buckets, activations of context parallelism) here, not every small tensor.

    x = t3d.mem.empty(1 << 24)        # float32, like torch.empty
    dist.all_reduce(x)

Or, for tensors a library allocates (DDP's buckets, FSDP's and DTensor's buffers), an allocator: with
`enable_allocator()` (or T3D_CPU_ALLOCATOR=1 in the environment before `import torch`) torch's CPU allocations of at
least T3D_SHM_MAPPED_BYTES come from t3d memory, freed blocks cached for reuse (T3D_CPU_ALLOCATOR_CACHE_BYTES).

README, "Registered memory"; docs/architecture.md, "Registered memory".
"""

from __future__ import annotations

import contextlib
import math
import os

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


def _env_int(text: str, default: int) -> int:
    """An integer variable's text as libt3d reads them (base 0: 0x hex); empty or unparsable: the default."""
    try:
        return int(text, 0) if text else default
    except ValueError:
        return default


def enable_allocator(min_bytes: int | None = None, cache_bytes: int | None = None) -> None:
    """From now on torch's CPU allocations of at least min_bytes (default T3D_SHM_MAPPED_BYTES, 1 MiB) come from t3d
    memory; smaller ones from the allocator torch had. Up to cache_bytes (default T3D_CPU_ALLOCATOR_CACHE_BYTES,
    1 GiB) of freed blocks are kept for reuse. Existing tensors are unaffected."""
    if min_bytes is None:
        min_bytes = _env_int(os.environ.get("T3D_SHM_MAPPED_BYTES", ""), 1 << 20)
    if cache_bytes is None:
        cache_bytes = _env_int(os.environ.get("T3D_CPU_ALLOCATOR_CACHE_BYTES", ""), 1 << 30)
    if min_bytes <= 0:
        raise ValueError(f"t3d.mem.enable_allocator: min_bytes must be positive, not {min_bytes}")
    if cache_bytes < 0:
        raise ValueError(f"t3d.mem.enable_allocator: cache_bytes must not be negative, not {cache_bytes}")
    _C._mem_allocator(True, int(min_bytes), int(cache_bytes))


def disable_allocator() -> None:
    """Gives torch back the CPU allocator enable_allocator() replaced (tensors allocated meanwhile stay valid)."""
    _C._mem_allocator(False)


@contextlib.contextmanager
def allocator(min_bytes: int | None = None, cache_bytes: int | None = None):
    """enable_allocator() for the body of a with statement (unless it was enabled before)."""
    was = allocator_stats()["enabled"]
    enable_allocator(min_bytes, cache_bytes)
    try:
        yield
    finally:
        if not was:
            disable_allocator()


def allocator_stats() -> dict:
    """{'enabled', 'live_bytes' (in live tensors), 'cached_bytes' (freed, kept for reuse)}."""
    return dict(_C._mem_allocator_stats())


def empty_allocator_cache() -> None:
    """Frees the blocks the allocator keeps for reuse."""
    _C._mem_allocator_empty_cache()
