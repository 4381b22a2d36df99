"""Entry point of group "torch.backends": torch calls autoload() at the end of `import torch`.

It lives outside the t3d package on purpose: torch turns any exception raised while *loading* an entry point into a
failed `import torch`, and loading a module inside t3d would first run t3d/__init__.py. This module imports nothing
at load time, and autoload() turns every failure into a warning; `dist.init_process_group("t3d")` then reports the
unknown backend.
"""

import os
import warnings


def autoload() -> None:
    if os.environ.get("T3D_AUTOLOAD", "1") == "0":
        return
    try:
        import t3d  # noqa: F401  (registers the backend)
    except Exception as exc:  # noqa: BLE001  (anything, including a missing shared library)
        warnings.warn(
            f"t3d: could not load the t3d backend ({type(exc).__name__}: {exc}); "
            'torch.distributed backend "t3d" is unavailable. Set T3D_AUTOLOAD=0 to skip this attempt.',
            RuntimeWarning,
            stacklevel=2,
        )
