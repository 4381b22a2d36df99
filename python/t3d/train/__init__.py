"""t3d-train: transformers' 3D-parallel example (dp x tp x cp) as a command, on backend t3d, on CPU or CUDA.

    t3d-train [--dp 2 --tp 2 --cp 2] [--steps N] ...      (also: python -m t3d.train, or under torchrun)

See docs/3d_parallel.md for what differs from upstream and why.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Console entry point (pyproject: t3d-train = "t3d.train:main")."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
