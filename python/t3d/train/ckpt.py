"""DCP checkpoints of model and optimizer (step 8), one folder per step plus a `latest` pointer and a JSON sidecar.

Both halves are keyed by parameter name with global shapes (TP shards as DTensors), so a checkpoint written under
one (dp, tp, cp) layout loads under another: DCP reads for each rank only the slices its own layout needs.

The model goes through torch's get/set_model_state_dict. The optimizer does not: with FSDP1 wrapping a TP model,
torch 2.9's get_state_dict returns AdamW's moments of TP-sharded parameters as plain local shards (the DTensor
layout is lost in FSDP's flatten/unflatten), so the checkpoint holds one TP rank's half under the full name. Here each
moment is read straight from AdamW's state (unflattening FSDP's FlatParameter by its recorded layout) and wrapped
with the parameter's own TP placements; loading writes into the same views, in place.

Under pipeline parallelism a rank holds one or several stage modules (`model` is then a list of them); they keep the
whole model's parameter names, so the rank's part of the checkpoint is the union of its stages' state, and DCP
matches names across any two pipeline layouts.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .._compat import torch_compat

META = "t3d_train.json"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _parts(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def param_layouts(model) -> dict:
    """name -> (mesh, placements, global shape, global stride) for DTensor parameters, None for plain ones.

    Taken before FSDP wraps the model: afterwards the names and the DTensor metadata are flattened away.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for part in _parts(model):
        for name, p in part.named_parameters():
            out[name] = (p.device_mesh, tuple(p.placements), p.shape, p.stride()) if isinstance(p, DTensor) else None
    return out


def _init_state(optimizer, p) -> dict:
    # What AdamW's first step would create (non-fused, non-capturable): zero moments and a CPU float step.
    st = optimizer.state[p]
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        for k in _MOMENTS:
            st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _optim_views(model, optimizer, layouts: dict) -> dict:
    """name -> {"step", "exp_avg", "exp_avg_sq"}: tensors aliasing AdamW's live state, in checkpoint layout."""
    from torch.distributed.tensor import DTensor

    def wrap(local, name):
        lay = layouts.get(name)
        if lay is None or isinstance(local, DTensor):
            return local
        mesh, placements, shape, stride = lay
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    views = {}
    for part, p in ((part, p) for part in _parts(model) for p in part.parameters()):
        if not p.requires_grad:
            continue
        st = _init_state(optimizer, p)
        flat_layout = torch_compat.flat_param_layout(p)
        if flat_layout is not None:  # FSDP1 FlatParameter (NO_SHARD: the whole local flat tensor)
            offset = 0
            for name, numel, shape in flat_layout:
                if name is not None:  # not padding
                    views[name] = {"step": st["step"]}
                    for k in _MOMENTS:
                        views[name][k] = wrap(st[k].narrow(0, offset, numel).view(shape), name)
                offset += numel
        else:
            name = _name_of(part, p)
            views[name] = {"step": st["step"], **{k: wrap(st[k], name) for k in _MOMENTS}}
    return views


def _name_of(model, param) -> str:
    cache = getattr(model, "_t3d_param_names", None)
    if cache is None:
        cache = {id(p): n for n, p in model.named_parameters()}
        model._t3d_param_names = cache
    return cache[id(param)]


class AppState(Stateful):
    """Model and optimizer as one stateful item, as in the upstream example."""

    def __init__(self, model, optimizer, layouts: dict):
        self.model, self.optimizer, self.layouts = model, optimizer, layouts
        self._views, self._keys = None, []

    def state_dict(self):
        self._views = _optim_views(self.model, self.optimizer, self.layouts)
        merged, self._keys = {}, []
        for part in _parts(self.model):
            sd = get_model_state_dict(part)
            self._keys.append(list(sd))
            merged.update(sd)
        return {"model": merged, "optim": self._views}

    def load_state_dict(self, state_dict):
        from torch.distributed.tensor import DTensor

        for part, keys in zip(_parts(self.model), self._keys):  # DCP calls state_dict() first
            set_model_state_dict(part, {k: state_dict["model"][k] for k in keys})
        # DCP loaded into the views in place; copy anyway in case a planner handed back new tensors.
        for name, loaded in state_dict["optim"].items():
            live = self._views[name]
            for k, v in loaded.items():
                dst, src = live[k], v
                if dst is src:
                    continue
                dst = dst.to_local() if isinstance(dst, DTensor) else dst
                src = src.to_local() if isinstance(src, DTensor) else src
                with torch.no_grad():
                    dst.copy_(src)


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:06d}")


def save(ckpt_dir: str, step: int, model, optimizer, layouts: dict, meta: dict) -> str:
    path = step_dir(ckpt_dir, step)
    dcp.save({"app": AppState(model, optimizer, layouts)}, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, META), "w") as f:
            json.dump(meta, f, indent=1)
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path) + "\n")
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))
    dist.barrier()
    return path


def resolve(resume: str, ckpt_dir: str | None) -> str:
    """--resume value to a step folder: 'latest' (the newest in --ckpt-dir), a step folder, or a --ckpt-dir."""
    base = ckpt_dir if resume == "latest" else resume
    if base is None:
        raise ValueError("--resume without a path needs --ckpt-dir")
    if os.path.exists(os.path.join(base, META)):
        return base
    latest = os.path.join(base, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(base, f.read().strip())
    raise FileNotFoundError(f"no t3d-train checkpoint at {base} (expected {META} or a 'latest' file)")


def load(path: str, model, optimizer, layouts: dict) -> dict:
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    dcp.load({"app": AppState(model, optimizer, layouts)}, checkpoint_id=path)
    return meta
