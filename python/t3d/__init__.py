"""t3d: a torch.distributed backend (and attention ops) over a C collective library.

`import t3d` registers backend "t3d" for cpu and cuda; with the package installed, torch's "torch.backends" entry
point does so during `import torch`, so `dist.init_process_group("t3d")` works without importing t3d.
"""

from __future__ import annotations

import sys

__version__ = "0.1.0"
BACKEND_NAME = "t3d"

# Set when loading failed under torch's autoload; attribute access then explains why (see __getattr__).
_LOAD_ERROR: BaseException | None = None


def _imported_by_torch_autoload() -> bool:
    # The entry point "t3d._autoload:autoload" imports this package first, from torch/__init__.py's
    # _import_device_backends, which turns any exception into a failed `import torch`.
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_import_device_backends" and f.f_globals.get("__name__") == "torch":
            return True
        f = f.f_back
    return False


try:
    import torch  # noqa: F401  (loads libtorch before the extension that links it)
    import torch.distributed  # noqa: F401  (registers the c10d types the extension's signatures use)

    from . import _C
    from ._backend import register

    register()
except Exception as _exc:  # noqa: BLE001
    if not _imported_by_torch_autoload():
        raise
    _LOAD_ERROR = _exc

    def __getattr__(name: str):
        raise ImportError(f"t3d failed to load during `import torch`: {_LOAD_ERROR!r}") from _LOAD_ERROR


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
    """Versions and capabilities of this build: t3d, the torch it was built against, CUDA/NCCL/UCX, CPU features."""
    if _LOAD_ERROR is not None:
        raise ImportError(f"t3d failed to load: {_LOAD_ERROR!r}") from _LOAD_ERROR
    import torch

    info = dict(_C._build_info())
    return {
        "version": info["version"],
        "torch_built": info["torch_built"],
        "torch_runtime": torch.__version__,
        "cuda": bool(info["cuda"]),
        "nccl_version": None,
        "ucx_version": info["ucx_version"] or None,
        "cpu_features": _cpu_features(),
    }


def transport(group=None) -> str:
    """The transport of a t3d process group (default group when None), e.g. "ucx" or "shm"."""
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return _C._transport(pg._get_backend(torch.device("cpu")))


__all__ = ["BACKEND_NAME", "build_info", "register", "transport", "__version__"]
