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

On CUDA, torch's own handlers run its flash / efficient / cuDNN kernels around its ring. With T3D_CP_CUDA=1 (or
enable(cuda=True)) t3d's handlers take the flash and efficient ops too and run the same ring with t3d's CUDA
attention kernels (torch.ops.t3d.attention on CUDA); torch's handlers come back with disable() or
enable(cuda=False). Opt-in until the GPU check has compared them with torch's on a GPU.

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


def _ring_forward(query, key, value, dropout_p, is_causal, attn_mask, scale):
    """The ring's output and log-sum-exp as DTensors, and the local query and key with their mesh."""
    from .nn.ring import ring_forward

    _check_unsupported(dropout_p, attn_mask)
    q, mesh = _unwrap(query, "query")
    k, _ = _unwrap(key, "key")
    v, _ = _unwrap(value, "value")
    out, lse = ring_forward(q, k, v, mesh.get_group(), bool(is_causal), _layout(), scale)
    return _wrap(out, mesh), _wrap(lse, mesh), q, k, mesh


def _flash_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None,
               scale: Optional[float] = None):
    return _ring_forward(query, key, value, dropout_p, is_causal, attn_mask, scale)[:2]


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


def _replicated(local, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(local, mesh, [Replicate()], run_check=False)


# The CUDA ops return more than (out, logsumexp): what their backward gets back. t3d's backward ignores it, so it
# only has to have the schema's types: the random state as small int64 tensors (replicated, as torch's sharding
# rules place them), no cumulative sequence lengths (dense inputs), and the local lengths.
def _flash_cuda(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False,
                *, scale: Optional[float] = None):
    if return_debug_mask:
        raise NotImplementedError("t3d.cp: SDPA's return_debug_mask is not supported")
    out, lse, q, k, mesh = _ring_forward(query, key, value, dropout_p, is_causal, None, scale)
    rng = _replicated(torch.zeros(2, dtype=torch.int64, device=q.device), mesh)
    unused = _replicated(torch.empty(0, dtype=torch.int64, device=q.device), mesh)
    debug = _replicated(torch.empty(0, dtype=q.dtype, device=q.device), mesh)
    return out, lse, None, None, q.size(2), k.size(2), rng, unused, debug


def _flash_cuda_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p: float, is_causal: bool, philox_seed, philox_offset, *,
                         scale: Optional[float] = None):
    return _flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)


def _efficient_cuda(query, key, value, attn_bias=None, compute_log_sumexp: bool = True, dropout_p: float = 0.0,
                    is_causal: bool = False, *, scale: Optional[float] = None):
    out, lse, q, _, mesh = _ring_forward(query, key, value, dropout_p, is_causal, attn_bias, scale)
    seed = _replicated(torch.zeros((), dtype=torch.int64, device=q.device), mesh)
    offset = _replicated(torch.zeros((), dtype=torch.int64, device=q.device), mesh)
    return out, lse, seed, offset


def _efficient_cuda_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                             dropout_p: float, grad_input_mask, is_causal: bool = False, *,
                             scale: Optional[float] = None):
    dq, dk, dv = _flash_cpu_backward(grad_out_, query, key, value, out, logsumexp, dropout_p, is_causal,
                                     attn_mask=attn_bias, scale=scale)
    return dq, dk, dv, None


def _ops():
    """{op: t3d's function} for the CPU ops and, separately, the CUDA ones."""
    aten = torch.ops.aten
    cpu = {aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_cpu_backward}
    cuda = {aten._scaled_dot_product_flash_attention.default: _flash_cuda,
            aten._scaled_dot_product_flash_attention_backward.default: _flash_cuda_backward,
            aten._scaled_dot_product_efficient_attention.default: _efficient_cuda,
            aten._scaled_dot_product_efficient_attention_backward.default: _efficient_cuda_backward}
    return cpu, cuda


def _handler(op_call, args, kwargs):
    cpu, cuda = _ops()
    fn = cpu.get(op_call) or cuda.get(op_call)
    if fn is None:
        raise NotImplementedError(f"t3d.cp: no handler for {op_call}")
    return fn(*args, **kwargs)


_torch_cuda_handlers: dict = {}  # torch's own handlers of the CUDA ops, while t3d's replace them


def enable(cuda: Optional[bool] = None) -> None:
    """Registers t3d's handlers for the CPU SDPA ops in torch's context-parallel table (idempotent); with cuda (default:
    T3D_CP_CUDA=1) also for the CUDA flash and efficient ops, in place of torch's own; cuda=False gives those back."""
    global _enabled
    import os

    if cuda is None:
        cuda = os.environ.get("T3D_CP_CUDA", "0") not in ("", "0")
    _, table = _hook_table()
    cpu, cuda_ops = _ops()
    for op in cpu:
        table[op] = _handler
    for op in cuda_ops:
        if cuda and op not in _torch_cuda_handlers:
            _torch_cuda_handlers[op] = table.get(op)
            table[op] = _handler
        elif not cuda and op in _torch_cuda_handlers:
            _restore(table, op)
    _enabled = True


def _restore(table, op) -> None:
    prev = _torch_cuda_handlers.pop(op)
    if prev is None:
        table.pop(op, None)
    else:
        table[op] = prev


def disable() -> None:
    """Removes the handlers again (context_parallel on CPU then fails as in plain torch; CUDA gets torch's own)."""
    global _enabled
    _, table = _hook_table()
    cpu, cuda_ops = _ops()
    for op in cpu:
        table.pop(op, None)
    for op in cuda_ops:
        if op in _torch_cuda_handlers:
            _restore(table, op)
    _enabled = False


def cuda_enabled() -> bool:
    """Whether t3d's handlers run context parallelism's CUDA attention ops."""
    return bool(_torch_cuda_handlers)


def is_enabled() -> bool:
    return _enabled


def set_load_balance(enabled: bool) -> None:
    """torch's CP load balancing (a private option): True -> zigzag chunks, False -> contiguous."""
    torch_compat.set_cp_load_balance(enabled)


enable()

__all__ = ["enable", "disable", "is_enabled", "cuda_enabled", "set_load_balance"]
