"""The embedded model: a tiny Llama built from a LlamaConfig, saved once to a cache dir, then loaded the way
transformers' examples/3D_parallel.py loads it (from_pretrained with a tensor-parallel mesh; on CPU with t3d.hf's fix;
on transformers 5 a whole load plus the model's TP plan over that mesh).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

# Small enough that 8 ranks on 2 cores train in seconds, big enough to be a real Llama: GQA-free so that any TP
# degree dividing 4 heads works (tp 1, 2, 4), tied embeddings off so lm_head gets its own TP style (colwise_rep).
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def model_cache_root() -> str:
    base = os.environ.get("T3D_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "t3d", "models")
    return base


def tiny_config(layers: int | None = None) -> dict:
    """TINY_LLAMA, with `layers` decoder layers when given (a deeper model for more pipeline stages)."""
    return dict(TINY_LLAMA, **({"num_hidden_layers": layers} if layers else {}))


def model_dir(init_seed: int, root: str | None = None, layers: int | None = None) -> str:
    import transformers

    key = json.dumps({"config": tiny_config(layers), "seed": init_seed, "transformers": transformers.__version__},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(root or model_cache_root(), f"tiny-llama-{digest}")


def ensure_model(init_seed: int, root: str | None = None, layers: int | None = None) -> str:
    """Create the tiny model on each host's first rank (LOCAL_RANK 0; save_pretrained) if that host's cache lacks
    it; every rank returns its path.

    Hosts need not share a filesystem: the model is a function of init_seed, so every host writes the same one.
    Where they do share one, the save goes to a temporary sibling that is renamed into place, so concurrent writers
    (other hosts, tests) never expose a half written directory; the other ranks wait on a barrier.
    """
    path = model_dir(init_seed, root, layers)
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if local_rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        from transformers import LlamaConfig, LlamaForCausalLM

        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path))
        try:
            cpu_rng = torch.random.get_rng_state()
            torch.manual_seed(init_seed)
            model = LlamaForCausalLM(LlamaConfig(**tiny_config(layers)))
            torch.random.set_rng_state(cpu_rng)
            # Not model.save_pretrained: transformers 5 writes nothing there unless this is global rank 0 (its
            # distributed checkpointing), and every host's first rank writes its own copy.
            from safetensors.torch import save_model

            model.config.architectures = [type(model).__name__]
            model.config.save_pretrained(tmp)
            save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            try:
                os.rename(tmp, path)
            except OSError:  # another run won the race: its copy is identical
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return path


def load_model(path: str, tp_mesh, device: torch.device, dtype: torch.dtype = torch.float32, log=print):
    """Load the causal LM; with a TP mesh of size > 1, shard it over exactly that mesh with the model's own TP plan.

    transformers 4: from_pretrained(dir, device_mesh=tp_mesh, tp_plan="auto") as upstream (t3d.hf's CPU fix applied).
    transformers 5 builds its own TP mesh from WORLD_SIZE for that call, so the model is loaded whole and the plan
    applied over tp_mesh (t3d._compat.hf_compat hides the difference).
    """
    from t3d._compat import hf_compat

    return hf_compat.load_on_tp_mesh(path, tp_mesh, device, dtype=dtype, log=log)
