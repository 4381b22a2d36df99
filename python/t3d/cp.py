"""torch context_parallel on CPU, computed by t3d's ring attention.

torch's context_parallel(mesh, buffers=..., buffer_seq_dims=...) wraps F.scaled_dot_product_attention's inputs in
DTensors sharded on the sequence and sends SDPA's fused ops to its ring-attention handler table. In torch 2.9 that
table knows only the CUDA kernels (flash, efficient, cudnn); on CPU, SDPA lowers to
aten._scaled_dot_product_flash_attention_for_cpu (and its backward), which then fails ("Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered").

enable() adds handlers for the two CPU ops to that table (a private dict, read each time the context is entered:
`customized_ops` of torch.distributed.tensor.experimental._attention in torch 2.9, `custom_ops` of
..._context_parallel._attention in torch 2.15; t3d._compat.torch_compat finds it). They run
t3d.nn.ring_attention's forward/backward over the mesh's process group: key/value blocks travel the ring by P2P
(whatever torch's rotate method says), the partial results merge by log-sum-exp and causal masking uses the true
global positions of each rank's chunks, so results equal non-parallel SDPA (up to float rounding). Torch's load
balancing (round-robin: rank r holds chunks r and 2W-1-r) maps to layout "zigzag", no load balancing to
"contiguous".

Enabling: importing t3d.cp (or calling t3d.cp.enable()) does it, and so does creating the first process group on
backend t3d (unless T3D_AUTO_INTEGRATIONS=0), so a script that only changed its backend string to "t3d" gets it.
`import t3d` alone does not, to keep that import (which runs during `import torch`) free of DTensor. Not supported (raises): attn_mask,
dropout, a mesh of more than one dimension.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._compat import torch_compat

_enabled = False


def _hook_table():
    """torch's CP hooks (module, handler dict), or t3d._compat.CompatError naming the installed torch."""
    hooks = torch_compat.cp_hooks()
    return hooks.module, hooks.table


def _layout() -> str:
    return "zigzag" if torch_compat.cp_load_balance() else "contiguous"


def _unwrap(x, what):
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(x, DTensor):
        raise RuntimeError(f"t3d.cp: expected '{what}' as a DTensor inside context_parallel, got {type(x).__name__}")
    if x.device_mesh.ndim != 1:
        raise NotImplementedError(f"t3d.cp: '{what}' lives on a {x.device_mesh.ndim}-D mesh; context_parallel on CPU "
                                  f"supports a 1-D mesh (pass the CP sub-mesh)")
    if tuple(x.placements) != (Shard(2),):
        raise NotImplementedError(f"t3d.cp: '{what}' has placements {x.placements}; expected (Shard(dim=2),)")
    return torch_compat.dtensor_local(x), x.device_mesh


def _wrap(local, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(2)], run_check=False)


def _check_unsupported(dropout_p: float, attn_mask) -> None:
    if attn_mask is not None:
        raise NotImplementedError("t3d.cp: SDPA with attn_mask is not supported by context_parallel on CPU "
                                  "(use is_causal=True for causal masks)")
    if dropout_p:
        raise NotImplementedError(f"t3d.cp: SDPA dropout (dropout_p={dropout_p}) is not supported")


def _flash_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None,
               scale: Optional[float] = None):
    from .nn.ring import ring_forward

    _check_unsupported(dropout_p, attn_mask)
    q, mesh = _unwrap(query, "query")
    k, _ = _unwrap(key, "key")
    v, _ = _unwrap(value, "value")
    out, lse = ring_forward(q, k, v, mesh.get_group(), bool(is_causal), _layout(), scale)
    return _wrap(out, mesh), _wrap(lse, mesh)


def _flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p: float, is_causal: bool, *,
                        attn_mask=None, scale: Optional[float] = None):
    from .nn.ring import ring_backward

    _check_unsupported(dropout_p, attn_mask)
    q, mesh = _unwrap(query, "query")
    k, _ = _unwrap(key, "key")
    v, _ = _unwrap(value, "value")
    dout, _ = _unwrap(grad_out, "grad_out")
    o, _ = _unwrap(out, "out")
    lse, _ = _unwrap(logsumexp, "logsumexp")
    dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, o.contiguous().to(q.dtype), lse.float().contiguous(),
                               mesh.get_group(), bool(is_causal), _layout(), scale)
    return _wrap(dq, mesh), _wrap(dk, mesh), _wrap(dv, mesh)


def _handler(op_call, args, kwargs):
    aten = torch.ops.aten
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        return _flash_cpu(*args, **kwargs)
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return _flash_cpu_backward(*args, **kwargs)
    raise NotImplementedError(f"t3d.cp: no handler for {op_call}")


def enable() -> None:
    """Registers t3d's handlers for the CPU SDPA ops in torch's context-parallel table (idempotent)."""
    global _enabled
    _, table = _hook_table()
    aten = torch.ops.aten
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = _handler
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _handler
    _enabled = True


def disable() -> None:
    """Removes the handlers again (context_parallel on CPU then fails as in plain torch)."""
    global _enabled
    _, table = _hook_table()
    aten = torch.ops.aten
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, None)
    _enabled = False


def is_enabled() -> bool:
    return _enabled


def set_load_balance(enabled: bool) -> None:
    """torch's CP load balancing (a private option): True -> zigzag chunks, False -> contiguous."""
    torch_compat.set_cp_load_balance(enabled)


enable()

__all__ = ["enable", "disable", "is_enabled", "set_load_balance"]
