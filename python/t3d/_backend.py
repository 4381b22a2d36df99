"""Registration of the "t3d" backend with torch.distributed (extended API: group rank/size, timeout, global ranks)."""

from __future__ import annotations

import os
import sys
import warnings

import torch.distributed as dist

from . import _C

BACKEND_NAME = "t3d"
_registered = False
_integrations_done = False


def _enable_cpu_integrations() -> None:
    """Once per process, when its first t3d group is created: what a script written for NCCL needs from t3d to run
    its 3D workflow on CPU, without importing anything from t3d (it may only have changed the backend string).

    - t3d.cp: torch's context_parallel on CPU SDPA (torch 2.9 handles only the CUDA kernels). It adds handlers for
      CPU ops that torch otherwise refuses, so nothing that worked changes.
    - t3d.hf's loading fix, when the script has already imported transformers: from_pretrained(device_mesh=<mesh>,
      tp_plan=...) in transformers 4.57 reads weights as CUDA device N on a CPU mesh, and transformers 5 replaces
      the mesh by one of WORLD_SIZE // (dp * pp) ranks (fix_cpu_tp_loading). transformers is never imported from
      here.

    - torch_compat.fix_fsdp1_optim_state_dict: torch 2.15's get_state_dict(model, optim) under FSDP1 on a dp
      sub-mesh without global rank 0 broadcasts from global rank 0 in a group that lacks it (the example's DCP save).

    T3D_AUTO_INTEGRATIONS=0 turns this off; a failure warns and leaves the group working.
    """
    global _integrations_done
    if _integrations_done:
        return
    _integrations_done = True
    if os.environ.get("T3D_AUTO_INTEGRATIONS", "1") == "0":
        return
    try:
        from . import cp

        cp.enable()
    except Exception as e:  # a torch without the private hooks: t3d.cp's own error says which
        warnings.warn(f"t3d: context_parallel on CPU is not available: {e}", stacklevel=2)
    try:
        from ._compat.torch_compat import fix_fsdp1_optim_state_dict

        fix_fsdp1_optim_state_dict()
    except Exception as e:  # never break the group over it
        warnings.warn(f"t3d: the FSDP1 optimizer state-dict fix could not be applied: {e}", stacklevel=2)
    if "transformers" in sys.modules:
        try:
            from . import hf  # noqa: F401  (applies fix_cpu_tp_loading on import)
        except Exception as e:
            warnings.warn(f"t3d: the transformers integration (t3d.hf) could not be loaded: {e}", stacklevel=2)


def _create(dist_backend_opts, backend_options):
    """Creator torch calls once per process group (for all of its devices): builds the C++ backend."""
    _enable_cpu_integrations()
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
    from ._compat.torch_compat import backend_registered, skip_torch_fr_hook

    # t3d's groups record their operations in t3d's own flight recorder (t3d.flight_recorder), in torch's format.
    skip_torch_fr_hook(BACKEND_NAME)
    if _registered or backend_registered(BACKEND_NAME):
        _registered = True
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True
