"""Hugging Face transformers integration: `import t3d.hf` registers the attention implementation "t3d".

    import t3d.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="t3d")

Attention runs in torch.ops.t3d.attention (CPU kernels, or CUDA ones when built), grouped-query heads without
repeating k/v. Masks: "t3d" also registers transformers' SDPA mask builder, so an unpadded causal batch arrives with
no mask and runs as causal; a 4-D mask that is exactly causal (aligned bottom-right, as with a KV cache) or exactly
all-visible is recognised and turned into (causal, q_start). Any other mask (padding, sliding windows, packed
sequences, arbitrary biases) raises ValueError: t3d's kernels cannot express it. Dropout > 0 in training raises too.

`import t3d.hf` also applies one compatibility fix, so that `from_pretrained(path, device_mesh=tp_mesh, tp_plan="auto")`
(as in transformers' examples/3D_parallel.py) shards over exactly that mesh, on CPU: see fix_cpu_tp_loading(). Nothing
else in transformers is changed.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops as _t3d_ops  # noqa: F401  (torch.ops.t3d + autograd)

NAME = "t3d"


def _mask_to_causal(mask: torch.Tensor, q_len: int, k_len: int) -> tuple[bool, int]:
    """(causal, q_start) equivalent to a 4-D mask [B or 1, 1 or H, q_len, k_len], or ValueError."""
    if mask.dim() != 4:
        raise ValueError(f"t3d attention: expected a 4-D attention mask, got shape {tuple(mask.shape)}")
    mask = mask[:, :, :, :k_len]
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        # Additive masks: 0 where visible, a very negative value (finfo.min or -inf) where masked.
        big = torch.finfo(mask.dtype).min / 2
        allowed = mask == 0
        if not bool(torch.all(allowed | (mask <= big))):
            raise ValueError("t3d attention: additive masks with values other than 0 and -inf/finfo.min "
                             "(attention biases) are not supported; use attn_implementation='sdpa' or 'eager'")
    else:
        raise ValueError(f"t3d attention: unsupported attention mask dtype {mask.dtype}")
    if bool(torch.all(allowed)):
        return False, 0
    q_start = k_len - q_len
    pos_q = torch.arange(q_len, device=mask.device)[:, None] + q_start
    pos_k = torch.arange(k_len, device=mask.device)[None, :]
    if bool(torch.all(allowed == (pos_k <= pos_q))):
        return True, q_start
    raise ValueError("t3d attention: the attention mask is neither causal nor all-visible (padding, packed "
                     "sequences or sliding windows); t3d's kernels cannot express it. Use unpadded inputs or "
                     "attn_implementation='sdpa'")


def t3d_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, S, D], key/value [B, Hkv, S_k, D] -> ([B, S, H, D], None)."""
    if dropout and module.training:
        raise ValueError(f"t3d attention: dropout ({dropout}) is not supported; set attention_dropout=0")
    if kwargs.get("output_attentions"):
        raise ValueError("t3d attention does not return attention weights (output_attentions=True); use 'eager'")
    if kwargs.get("head_mask") is not None:
        raise ValueError("t3d attention does not support head_mask; use 'eager'")
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is not None:
        causal, q_start = _mask_to_causal(attention_mask, q_len, k_len)
    else:
        if is_causal is None:
            is_causal = q_len > 1 and getattr(module, "is_causal", True)
        causal = bool(is_causal)
        # Queries are the last q_len positions of the keys (prefill: equal lengths; decode: one new token).
        q_start = k_len - q_len if causal else 0
    dtype = query.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        # float64 models: compute in float32 and cast back.
        query, key, value = query.float(), key.float(), value.float()
    out, _ = torch.ops.t3d.attention(query, key, value, causal, scaling, q_start, 0)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers "t3d" with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, t3d_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        # The SDPA mask builder: None for plain causal batches, a boolean 4-D mask otherwise (checked above).
        AttentionMaskInterface.register(NAME, sdpa_mask)
    except ImportError:  # older transformers without masking_utils: masks arrive in the model's own format
        pass


def fix_cpu_tp_loading() -> bool:
    """Make from_pretrained(path, device_mesh=<mesh>, tp_plan="auto") (as in transformers' examples/3D_parallel.py)
    shard over the ranks of that mesh, on CPU too (idempotent). Returns True when the fix is in place.

    transformers 4.57: given a `device_mesh` it sets device_map = torch.device(f"{mesh.device_type}:{LOCAL_RANK}");
    for a CPU mesh, _load_state_dict_into_meta_model passes that N to safetensors' safe_open(device=N), which takes it
    for CUDA device N ("RuntimeError: Found no NVIDIA driver" on every rank of a machine without a GPU). The fix wraps
    that one function so that cpu:N becomes cpu. transformers 5: the mesh argument is replaced by a mesh of
    WORLD_SIZE // (dp * pp) ranks of transformers' own, so with dp or cp > 1 the weights are split over the wrong
    ranks; the fix makes a call with an explicit device_mesh load whole and apply the model's TP plan over that
    mesh's "tp" dimension. Both live in t3d._compat.hf_compat.install_mesh_loading_fix.
    """
    from ._compat import hf_compat

    return hf_compat.install_mesh_loading_fix()


register()
fix_cpu_tp_loading()

__all__ = ["NAME", "fix_cpu_tp_loading", "register", "t3d_attention_forward"]
