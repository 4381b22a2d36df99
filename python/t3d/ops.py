"""torch.ops.t3d attention ops: Python wrappers and autograd.

`import t3d.ops` loads the op library (t3d._C holds the schemas, CPU and Meta kernels; t3d._C_cuda, when it was
built, the CUDA kernels) and registers autograd for `torch.ops.t3d.attention` through torch.library, so the ops work
eagerly, under autograd and under torch.compile (fullgraph; backends eager, aot_eager, inductor).

Layout [batch, heads, seq, head_dim] like SDPA; k/v may have fewer heads than q (grouped-query attention). Query i
sits at global position q_start + i and key j at k_start + j; with causal a key is visible when its position is not
after the query's. A row that sees no key gets out 0 and lse -inf.
"""

from __future__ import annotations

import warnings
import importlib.util
from typing import Optional

import torch

from . import _C  # noqa: F401  (TORCH_LIBRARY(t3d): schemas, CPU and Meta kernels)

CUDA_AVAILABLE = False
CUDA_LOAD_ERROR: Optional[str] = None
try:
    from . import _C_cuda  # noqa: F401  (TORCH_LIBRARY_IMPL(t3d, CUDA): present only in CUDA builds)

    CUDA_AVAILABLE = True
except ImportError as _e:  # not built (no nvcc / CPU torch) or the CUDA module cannot load here
    CUDA_LOAD_ERROR = repr(_e)
    # Not built is normal and quiet; built but not loadable is worth a warning. (The message of a missing submodule
    # depends on how the import was reached, so ask whether the module exists at all.)
    if importlib.util.find_spec(f"{__package__}._C_cuda") is not None:
        warnings.warn(f"t3d: CUDA attention kernels present but not loadable: {_e!r}", RuntimeWarning, stacklevel=2)

_ops = torch.ops.t3d


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: Optional[float] = None, q_start: int = 0, k_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention; returns (out like q, lse float32 [batch, heads, seq_q]). Differentiable in q, k, v
    (lse is not: it carries no gradient)."""
    return _ops.attention(q, k, v, causal, scale, q_start, k_start)


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, scale: Optional[float] = None,
                       q_start: int = 0, k_start: int = 0):
    """(dq, dk, dv) of `attention` for the upstream gradient dout, given its out and lse."""
    return _ops.attention_backward(dout, q, k, v, out, lse, causal, scale, q_start, k_start)


def attention_merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                     block_lse: torch.Tensor) -> None:
    """In place: merges the partial result (block_out, block_lse) into (out, lse) by log-sum-exp, in float32.
    out and lse must be contiguous."""
    _ops.attention_merge_(out, lse, block_out, block_lse)


# ---- autograd ----------------------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, q_start, k_start = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.q_start, ctx.k_start = causal, scale, q_start, k_start
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        return None, None, None, None, None, None, None
    dq, dk, dv = _ops.attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.q_start, ctx.k_start)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("t3d::attention", _backward, setup_context=_setup_context)


def sdpa(q, k, v, is_causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """Drop-in for F.scaled_dot_product_attention without mask or dropout (causal aligned top-left, like SDPA)."""
    return _ops.attention(q, k, v, is_causal, scale, 0, 0)[0]


__all__ = ["attention", "attention_backward", "attention_merge_", "sdpa", "CUDA_AVAILABLE"]
