"""transformers internals t3d uses, in one place (tested: transformers 4.57.6, 5.17.0 and 5.24.0;
supported 4.57 .. 4.x and 5.16 .. 5.x).

Tensor parallelism over a mesh that t3d (or a script) built, e.g. the "tp" dimension of a (dp, tp, cp) mesh:

- transformers 4.57 ("v4" API): from_pretrained(device_mesh=tp_mesh, tp_plan="auto") shards over exactly that
  mesh; internally distribute_model() installs the plan's hooks and _load_state_dict_into_meta_model() calls
  shard_and_distribute_module() per weight. On a CPU mesh it passes device "cpu:N" on to safetensors as the bare int
  N, read as CUDA device N ("Found no NVIDIA driver"): install_mesh_loading_fix() strips that index.
- transformers 5.x ("v5" API): those three functions are gone. from_pretrained turns tp_plan into
  DistributedConfig(tp_plan=...), whose tp_size defaults to WORLD_SIZE // (dp_replicate * fsdp * pp), and builds its
  own (pp, dp_replicate, fsdp, tp) mesh; the device_mesh argument is then overwritten, so with dp or cp > 1 the
  model is split over the wrong ranks (tiny Llama, 8 ranks: "shape '[4, 32, -1, 16]' is invalid" in q_proj). The
  pieces to shard over a given mesh are model._resolve_parallel_plans(DistributedConfig) (the plan with layer
  numbers expanded) and transformers.distributed.tensor_parallel.apply_tensor_parallelism(model, mesh, plan), which
  turns each weight into a DTensor with distribute_tensor(..., src_data_rank=None): after a full load (the same
  weights on every rank) each rank keeps its own slice, no communication.

  Before 5.24 (5.16 .. 5.22) there is no _resolve_parallel_plans: apply_tensor_parallelism(model, mesh) shards
  by model.tp_plan (the model's plan with its base model's; a dict given replaces it, as from_pretrained does
  there). 5.0 .. 5.15 have neither API (their tensor parallelism is 4.x's without _load_state_dict_into_meta_model)
  and are refused with the one line below. Seen: transformers 5.17.0 on the GPU machines.

`tp_api()` says which applies; `apply_tp_plan` / `load_on_tp_mesh` / `install_mesh_loading_fix` hide the difference.
A transformers with neither API fails with one CompatError line naming its version and the missing pieces.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from . import CompatError, version_tuple

TESTED = ((4, 57), (5, 24))  # oldest and newest transformers (major, minor) the test suite runs on
V5_FIRST = (5, 16)  # the first 5.x with apply_tensor_parallelism: 5.0 .. 5.15 are not supported

V4_PIECES = ("transformers.integrations.tensor_parallel.distribute_model",
             "transformers.integrations.tensor_parallel.shard_and_distribute_module",
             "transformers.modeling_utils._load_state_dict_into_meta_model")
V5_PIECES = ("transformers.distributed.tensor_parallel.apply_tensor_parallelism",
             "transformers.distributed.DistributedConfig")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _resolve(dotted: str):
    """The object at a dotted path (module prefix imported, then attributes), or None."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _has(pieces) -> list[str]:
    """The pieces that are missing."""
    return [p for p in pieces if _resolve(p) is None]


def tp_api() -> str:
    """"v4" or "v5": which tensor-parallel API this transformers has (version first, then what is really there)."""
    order = (("v5", V5_PIECES), ("v4", V4_PIECES))
    if version_tuple(transformers_version()) < (5, 0):
        order = order[::-1]
    missing = {}
    for name, pieces in order:
        missing[name] = _has(pieces)
        if not missing[name]:
            return name
    lo, hi = TESTED
    raise CompatError(
        f"t3d.hf: transformers {transformers_version()} has no tensor-parallel API t3d knows (missing "
        f"{', '.join(missing['v5'])} (5.x) and {', '.join(missing['v4'])} (4.x); t3d supports transformers "
        f"{lo[0]}.{lo[1]}..{lo[0]}.x and {V5_FIRST[0]}.{V5_FIRST[1]}..{hi[0]}.x)")


def _tp_submesh(mesh):
    """A 1-D TP mesh: a mesh with several dims must name one "tp" (as transformers 4 accepted)."""
    if mesh.ndim > 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError("t3d.hf: a device_mesh with several dimensions must have one named 'tp'")
        mesh = mesh["tp"]
    return mesh


def apply_tp_plan(model, tp_mesh, tp_plan="auto"):
    """Shard a fully loaded model (the same weights on every rank) over the 1-D `tp_mesh` with its own TP plan
    (tp_plan="auto"; a dict overrides rules of it on transformers 5), as from_pretrained(device_mesh=tp_mesh,
    tp_plan=...) does in transformers 4. Returns the model: parameters become DTensors (or plain local slices where
    the plan says so), forward hooks do the collectives."""
    tp = tp_mesh.size()
    if tp == 1:
        return model
    api = tp_api()
    if api == "v5":
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        cfg = DistributedConfig(tp_size=tp, tp_plan=tp_plan)  # tp_size given: nothing is derived from WORLD_SIZE
        if hasattr(model, "_resolve_parallel_plans"):  # 5.24 on
            plan, _, _ = model._resolve_parallel_plans(cfg)
            model = apply_tensor_parallelism(model, tp_mesh, plan)
        else:  # 5.16 .. 5.22: the plan is the model's own
            if isinstance(tp_plan, dict):
                model.tp_plan = tp_plan
            elif tp_plan != "auto":
                raise ValueError(f"t3d.hf: tp_plan must be 'auto' or a dict, got {tp_plan!r}")
            model = apply_tensor_parallelism(model, tp_mesh)
        # What maybe_distribute_model records for a TP-only config (read by save_pretrained and the Trainer).
        model.config.distributed_config = cfg
        model._device_mesh = tp_mesh
        model._tp_size = tp
        return model

    # transformers 4: the same two steps from_pretrained takes with a mesh, after a plain load.
    from transformers.integrations.tensor_parallel import distribute_model, shard_and_distribute_module

    if tp_plan != "auto":
        raise ValueError(f"t3d.hf: on transformers {transformers_version()} only tp_plan='auto' can be applied after "
                         f"loading (got {tp_plan!r})")
    model = distribute_model(model, None, tp_mesh, tp)
    rank = tp_mesh.get_local_rank()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for name, param in list(model.named_parameters()):
            full = param.detach()
            shard_and_distribute_module(model, full, full, name, dtype, True, rank, tp_mesh)
    return model


def load_on_tp_mesh(path: str, tp_mesh, device: torch.device, dtype: torch.dtype = torch.float32, log=print):
    """AutoModelForCausalLM from `path`, sharded over the 1-D `tp_mesh` with the model's TP plan (plain when
    tp_mesh is None or of size 1)."""
    from transformers import AutoModelForCausalLM

    tp = tp_mesh.size() if tp_mesh is not None else 1
    if tp == 1:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    api = tp_api()
    if api == "v4":
        from transformers.utils import is_accelerate_available

        if is_accelerate_available():
            # transformers 4 honours the mesh it is given; a device_map (implied) needs accelerate.
            if device.type == "cpu":
                install_mesh_loading_fix()
            log("TP load: from_pretrained(device_mesh=tp_mesh, tp_plan='auto') as upstream (transformers 4)")
            return AutoModelForCausalLM.from_pretrained(path, device_mesh=tp_mesh, tp_plan="auto", dtype=dtype)
        why = "transformers needs `accelerate` for the device_map that tp_plan implies"
    else:
        why = "transformers 5 would build its own mesh with tp = WORLD_SIZE // (dp * pp)"
    log(f"TP load: from_pretrained + transformers' own TP plan applied on the tp mesh ({why})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return apply_tp_plan(model, tp_mesh)


# --- install_mesh_loading_fix -------------------------------------------------------------------------------------

def _strip_cpu_index(device_map):
    """device_map with torch.device("cpu", N) replaced by torch.device("cpu") (a dict's values, or the device itself);
    anything else unchanged."""
    def strip(d):
        return torch.device("cpu") if isinstance(d, torch.device) and d.type == "cpu" and d.index is not None else d

    if isinstance(device_map, dict):
        if any(strip(d) is not d for d in device_map.values()):
            return {k: strip(d) for k, d in device_map.items()}
        return device_map
    return strip(device_map)


def _fix_v4() -> bool:
    from transformers import modeling_utils

    original = getattr(modeling_utils, "_load_state_dict_into_meta_model", None)
    if original is None:
        return False
    if getattr(original, "_t3d_mesh_fix", False):
        return True

    @functools.wraps(original)
    def _load_state_dict_into_meta_model(*args, **kwargs):
        if "device_map" in kwargs:
            kwargs["device_map"] = _strip_cpu_index(kwargs["device_map"])
        elif len(args) > 4:  # (model, state_dict, shard_file, reverse_renaming_mapping, device_map, ...)
            args = (*args[:4], _strip_cpu_index(args[4]), *args[5:])
        return original(*args, **kwargs)

    _load_state_dict_into_meta_model._t3d_mesh_fix = True
    modeling_utils._load_state_dict_into_meta_model = _load_state_dict_into_meta_model
    return True


def _fix_v5() -> bool:
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__.get("from_pretrained")
    if current is None:
        return False
    original = current.__func__ if isinstance(current, classmethod) else current
    if getattr(original, "_t3d_mesh_fix", False):
        return True

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        mesh = kwargs.get("device_mesh")
        plan = kwargs.get("tp_plan")
        if (mesh is None or plan is None or kwargs.get("distributed_config") is not None
                or kwargs.get("tp_size") is not None):
            return original(cls, *args, **kwargs)
        # The caller's mesh, as transformers 4 used it: load whole, then shard over its "tp" dimension.
        kwargs.pop("device_mesh")
        kwargs.pop("tp_plan")
        mesh = _tp_submesh(mesh)
        if mesh.device_type != "cpu" and kwargs.get("device_map") is None:
            kwargs["device_map"] = torch.device(mesh.device_type, int(os.environ.get("LOCAL_RANK", "0")))
        model = original(cls, *args, **kwargs)
        return apply_tp_plan(model, mesh, plan)

    from_pretrained._t3d_mesh_fix = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    return True


def install_mesh_loading_fix() -> bool:
    """Make from_pretrained(path, device_mesh=<mesh>, tp_plan="auto") shard over that mesh's ranks (idempotent).

    transformers 4: the mesh is used, but on a CPU mesh "cpu:N" reaches safetensors as CUDA device N: the index is
    stripped in _load_state_dict_into_meta_model. transformers 5: the mesh is replaced by one of
    WORLD_SIZE // (dp*pp) ranks: PreTrainedModel.from_pretrained is wrapped so that a call with an explicit
    device_mesh and tp_plan (and no distributed_config / tp_size) loads whole, then apply_tp_plan() shards it over
    the mesh's "tp" dimension. Calls without device_mesh are untouched. Returns True when the fix is in place."""
    try:
        api = tp_api()
    except (CompatError, ImportError):
        return False
    return _fix_v5() if api == "v5" else _fix_v4()


def run_decoder_layer(layer, hidden, position_ids, position_embeddings):
    """One decoder layer of a Llama-like model outside the model's own loop (a pipeline stage): no cache, no mask
    (causal SDPA). transformers 4.57 and 5.x both take these keywords and return the hidden states; older 4.x
    returned a tuple, whose first item is taken."""
    out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out


__all__ = ["TESTED", "apply_tp_plan", "install_mesh_loading_fix", "load_on_tp_mesh", "run_decoder_layer",
           "tp_api", "transformers_version"]
