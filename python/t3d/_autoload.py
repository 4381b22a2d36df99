"""Entry point of group "torch.backends": torch calls autoload() at the end of `import torch`.

It must never raise (that would break `import torch` for every script in the environment), so a failure to load t3d
becomes a warning and `dist.init_process_group("t3d")` then reports the unknown backend. Importing this module runs
t3d/__init__.py first; that file catches its own failures when it sees it is being loaded from torch's autoload.
"""

import os
import warnings


def autoload() -> None:
    if os.environ.get("T3D_AUTOLOAD", "1") == "0":
        return
    try:
        import t3d  # registers the backend

        if t3d._LOAD_ERROR is not None:
            raise t3d._LOAD_ERROR
    except Exception as exc:  # noqa: BLE001  (anything, including a missing shared library)
        warnings.warn(
            f"t3d: could not load the t3d backend ({type(exc).__name__}: {exc}); "
            'torch.distributed backend "t3d" is unavailable. Set T3D_AUTOLOAD=0 to skip this attempt.',
            RuntimeWarning,
            stacklevel=2,
        )
