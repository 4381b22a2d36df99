"""t3d: a torch.distributed backend (and attention ops) over a C collective library.

`import t3d` registers backend "t3d" for cpu and cuda; with the package installed, torch's "torch.backends" entry
point does so during `import torch`, so `dist.init_process_group("t3d")` works without importing t3d.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"
BACKEND_NAME = "t3d"

# Submodules loaded on first attribute access (t3d.nn, t3d.cp, ...), so that `import t3d` stays cheap.
_LAZY_SUBMODULES = ("ops", "nn", "cp", "hf", "bench", "flight_recorder", "mem")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


import torch  # noqa: E402,F401  (loads libtorch before the extension that links it)
import torch.distributed  # noqa: F401  (registers the c10d types the extension's signatures use)

from . import _C
from ._backend import register

register()
if os.environ.get("T3D_CPU_ALLOCATOR", "0") not in ("", "0"):  # torch's large CPU tensors in t3d memory (t3d.mem)
    from . import mem as _mem

    _mem.enable_allocator()
# The attention ops' autograd and CUDA kernels; a failure there must not take the backend down with it.
try:
    from . import ops  # noqa: F401
except Exception as _ops_exc:  # noqa: BLE001
    import warnings

    warnings.warn(f"t3d: attention ops unavailable: {_ops_exc!r}", RuntimeWarning, stacklevel=2)


def _cpu_features() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma", "f16c", "amx_bf16")
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


def build_info() -> dict:
    """Versions and capabilities of this build: t3d, the torch it was built against, CUDA/NCCL/UCX, CPU features.

    `ucx`: the UCX transport is compiled in (without it, built with T3D_WITH_UCX=OFF, only groups whose ranks share
    a host work, over shared memory); `ucx_version`: the UCX library loaded, or None; `features`: what libt3d was
    built with (t3d_build_features(): ucx, shm, nccl, sanitize). `cuda`: the backend serves CUDA tensors (built
    against a CUDA torch); `nccl_version`: the NCCL those would use (loaded now if need be), or None with
    `nccl_error` saying why. `params`: every environment variable t3d reads, from libt3d's registry, with the value
    in effect in this process: a list of dicts with name, value, default, set, meaning, reader and more
    (t3d._params.params)."""
    import torch

    from . import _params

    info = dict(_C._build_info())
    features = dict(word.split("=", 1) for word in info["features"].split() if "=" in word)
    return {
        "version": info["version"],
        "torch_built": info["torch_built"],
        "torch_runtime": torch.__version__,
        "ucx": features.get("ucx", "no") != "no",
        "ucx_version": info["ucx_version"] or None,
        "features": features,
        "cuda": bool(info["cuda"]),
        "nccl_version": info["nccl_version"],
        "nccl_error": info["nccl_error"] or None,
        "cpu_features": _cpu_features(),
        "params": _params.params(info["params"]),
    }


def transport(group=None) -> str:
    """The transport of a t3d process group (default group when None), e.g. "ucx" or "shm"."""
    import torch
    import torch.distributed as dist

    from ._compat import torch_compat

    pg = group if group is not None else torch_compat.default_group()
    return _C._transport(torch_compat.group_backend(pg, torch.device("cpu")))


__all__ = ["BACKEND_NAME", "build_info", "register", "transport", "__version__"]
