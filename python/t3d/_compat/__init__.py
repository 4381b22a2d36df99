"""Version adapters: the only modules of t3d that touch private torch / transformers internals.

- torch_compat: torch 2.9 .. 2.15 (context-parallel hook table and options, mesh flattening, FSDP1 FlatParameter
  layout, default process group and its backend, backend registry).
- hf_compat: transformers 4.57 .. 4.x and 5.16 .. 5.x (tensor-parallel plan application and model loading on a given TP mesh).

Each picks its implementation by feature detection, ordered by the installed version, and raises
`CompatError` (a RuntimeError) with one line naming the installed version and the missing piece when neither the
known layouts nor detection find it. They import nothing heavy at module import (t3d is loaded while torch
imports, through its autoload entry point).
"""

from __future__ import annotations

import re


class CompatError(RuntimeError):
    """A private piece of torch / transformers that t3d needs is not where any supported version keeps it."""


def version_tuple(version: str) -> tuple[int, int]:
    """"2.15.0+cu132" -> (2, 15); "5.24.0.dev0" -> (5, 24); unparsable -> (0, 0)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m[1]), int(m[2])) if m else (0, 0)


__all__ = ["CompatError", "version_tuple"]
