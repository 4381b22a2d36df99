"""Registration of the "t3d" backend with torch.distributed (extended API: group rank/size, timeout, global ranks)."""

from __future__ import annotations

import torch.distributed as dist

from . import _C

BACKEND_NAME = "t3d"
_registered = False


def _create(dist_backend_opts, backend_options):
    """Creator torch calls once per process group (for all of its devices): builds the C++ backend."""
    timeout = dist_backend_opts.timeout
    timeout_s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    if backend_options is not None and getattr(backend_options, "_timeout", None) is not None:
        timeout_s = backend_options._timeout.total_seconds()
    return _C._create_backend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout_s,
        str(dist_backend_opts.group_id),
        [int(r) for r in dist_backend_opts.global_ranks_in_group],
    )


def register() -> None:
    """Registers "t3d" for cpu and cuda once; later calls do nothing."""
    global _registered
    if _registered or BACKEND_NAME.upper() in dist.Backend._plugins:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True
