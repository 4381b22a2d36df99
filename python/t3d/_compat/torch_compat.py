"""torch internals t3d uses, in one place (tested: torch 2.9.1 and 2.15.0; supported range 2.9 .. 2.15).

What moved between the two ends:

- The context-parallel op-handler table. torch 2.9: `customized_ops` in
  torch.distributed.tensor.experimental._attention. torch 2.15: that module only re-exports names; the code lives in
  ..._context_parallel._attention and the table is called `custom_ops` (still a dict merged into DTensor's
  `_custom_op_handlers` each time context_parallel is entered, so handlers added to it take effect the same way).
  The options object `_cp_options` (enable_load_balance, and from 2.15 rotate_method) is in both modules.
- torch.distributed.checkpoint.state_dict now passes FSDP1's process group to FSDP.optim_state_dict, which
  broadcasts from src=0 meaning the group's rank 0: fix_fsdp1_optim_state_dict() (a torch bug, not a move).
- Everything else t3d reaches into (DeviceMesh._flatten, FSDP1 FlatParameter's _fqns/_shapes/_numels_with_padding/
  _is_padding_mask, distributed_c10d._get_default_group, ProcessGroup._get_backend, Backend._plugins) is unchanged
  from 2.9 to 2.15; the functions below still check for it and fail with one line if a later torch drops it.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from . import CompatError, version_tuple

TESTED = ((2, 9), (2, 15))  # oldest and newest torch (major, minor) the test suite runs on

# (module, table attribute) where torch keeps the context-parallel op-handler table, newest layout first.
_CP_NEW = ("torch.distributed.tensor.experimental._context_parallel._attention", "custom_ops")       # >= 2.10
_CP_OLD = ("torch.distributed.tensor.experimental._attention", "customized_ops")                      # 2.9
CP_TABLE_LOCATIONS = (_CP_NEW, _CP_OLD)


def torch_version() -> str:
    import torch

    return torch.__version__


def _range_note() -> str:
    lo, hi = TESTED
    return f"t3d supports torch {lo[0]}.{lo[1]}..{hi[0]}.{hi[1]}"


class CPHooks(NamedTuple):
    module: object    # the module that holds the table and the options
    table: dict       # aten op -> handler(op_call, args, kwargs), consulted while context_parallel is active
    options: object   # _cp_options: enable_load_balance (and rotate_method from torch 2.10)


def _cp_candidates():
    # Version check first (the layout the installed torch should have), then the other one as a fallback.
    return CP_TABLE_LOCATIONS if version_tuple(torch_version()) >= (2, 10) else (_CP_OLD, _CP_NEW)


def cp_hooks() -> CPHooks:
    """torch's context-parallel hook table and options, or CompatError (one line) naming torch and what was tried."""
    tried = []
    for modname, attr in _cp_candidates():
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            tried.append(f"{modname} (not importable)")
            continue
        table = getattr(mod, attr, None)
        options = getattr(mod, "_cp_options", None)
        if isinstance(table, dict) and options is not None:
            return CPHooks(mod, table, options)
        tried.append(f"{modname}.{attr} + _cp_options")
    raise CompatError(f"t3d.cp: torch {torch_version()} has no context-parallel hook table (looked for "
                      f"{'; '.join(tried)}; {_range_note()})")


def cp_load_balance() -> bool:
    """Whether torch's context_parallel shards the sequence load-balanced (head-tail / zigzag chunks)."""
    return bool(getattr(cp_hooks().options, "enable_load_balance", False))


def set_cp_load_balance(enabled: bool) -> None:
    opts = cp_hooks().options
    if not hasattr(opts, "enable_load_balance"):
        raise CompatError(f"t3d.cp: torch {torch_version()}'s _cp_options has no enable_load_balance "
                          f"({_range_note()})")
    opts.enable_load_balance = bool(enabled)


def set_cp_rotate_method(method: str) -> bool:
    """torch's set_rotate_method("allgather" | "alltoall"); False when this torch has none (nothing changed)."""
    fn = getattr(cp_hooks().module, "set_rotate_method", None)
    if fn is None:
        return False
    fn(method)
    return True


def cp_unshard(mesh, buffers, seq_dims):
    """context_parallel_unshard: the full sequence of buffers sharded by context_parallel."""
    import torch.distributed.tensor.experimental as exp

    fn = getattr(exp, "context_parallel_unshard", None) or getattr(cp_hooks().module, "context_parallel_unshard",
                                                                   None)
    if fn is None:
        raise CompatError(f"t3d.cp: torch {torch_version()} has no context_parallel_unshard ({_range_note()})")
    return fn(mesh, buffers, seq_dims)


def dtensor_local(x):
    """A DTensor's local shard as is (no autograd node: t3d.cp calls it inside DTensor's op dispatch)."""
    local = getattr(x, "_local_tensor", None)
    return local if local is not None else x.to_local()


def flatten_mesh(mesh, name: str):
    """The 1-D mesh over all ranks of a (sub)mesh, registered under `name` (DeviceMesh._flatten)."""
    fn = getattr(mesh, "_flatten", None)
    if fn is None:
        raise CompatError(f"t3d: torch {torch_version()} has no DeviceMesh._flatten ({_range_note()})")
    return fn(mesh_dim_name=name)


def flat_param_layout(param):
    """For an FSDP1 FlatParameter: [(fqn or None for padding, numel, shape or None)] in storage order; None for any
    other parameter."""
    if not hasattr(param, "_numels_with_padding"):
        return None
    try:
        fqns, shapes = iter(param._fqns), iter(param._shapes)
        out = []
        for numel, is_pad in zip(param._numels_with_padding, param._is_padding_mask):
            out.append((None, numel, None) if is_pad else (next(fqns), numel, next(shapes)))
        return out
    except AttributeError as e:
        raise CompatError(f"t3d: torch {torch_version()}'s FSDP FlatParameter lacks {e.name or e} "
                          f"({_range_note()})") from None


def default_group():
    """The default (world) process group."""
    import torch.distributed as dist

    fn = getattr(dist.distributed_c10d, "_get_default_group", None)
    if fn is None:
        raise CompatError(f"t3d: torch {torch_version()} has no distributed_c10d._get_default_group "
                          f"({_range_note()})")
    return fn()


def group_backend(pg, device):
    """The c10d Backend object a ProcessGroup uses for `device`."""
    fn = getattr(pg, "_get_backend", None)
    if fn is None:
        raise CompatError(f"t3d: torch {torch_version()}'s ProcessGroup has no _get_backend ({_range_note()})")
    return fn(device)


def backend_registered(name: str) -> bool:
    """Whether a third-party backend `name` is registered with torch.distributed already."""
    import torch.distributed as dist

    plugins = getattr(dist.Backend, "_plugins", None)
    if plugins is None:  # no registry to ask: treat as unregistered (register_backend then says if it clashes)
        return False
    return name.upper() in plugins


def skip_torch_fr_hook(name: str) -> bool:
    """Tells torch that backend `name` records its own flight recorder entries, so that torch does not attach its
    backend-agnostic recording hook to the backend's groups. torch 2.15 attaches that hook to every group whose
    backend is not in distributed_c10d._FR_SELF_RECORDING_BACKENDS (torch 2.9 has neither): it would record each
    t3d operation a second time, taking a Python traceback on the caller's thread (about 2 us per operation, half of
    a small all_reduce through torch). False where this torch has no such hook."""
    from torch.distributed import distributed_c10d as c10d

    names = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if not isinstance(names, set):
        return False
    names.add(name)
    return True


def torch_fr_hook_attached(pg) -> bool | None:
    """Whether torch attached its own flight recorder hook to group `pg`; None where this torch has no such hook."""
    from torch.distributed import distributed_c10d as c10d

    hooks = getattr(getattr(c10d, "_world", None), "pg_flight_recorder_hooks", None)
    return None if hooks is None else pg in hooks


# torch's flight recorder analyser (torchfrtrace), newest location first. torch 2.15 ships it in the wheel; torch
# 2.9.1's wheel declares the torchfrtrace script but not the module it names (tools.flight_recorder), so there is
# none to run.
FR_ANALYSER_MODULES = ("torch.distributed.flight_recorder.fr_trace", "tools.flight_recorder.fr_trace")


def flight_recorder_analyser() -> str:
    """The importable module of the installed torch's flight recorder analyser (run it with `python -m`), or
    CompatError naming torch and what was tried."""
    import importlib.util

    for name in FR_ANALYSER_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ImportError:  # a parent package is missing
            continue
    raise CompatError(f"t3d: torch {torch_version()} ships no flight recorder analyser (looked for "
                      f"{', '.join(FR_ANALYSER_MODULES)}); read the dumps with a newer torch's torchfrtrace")


class _GroupRankSrc:
    """torch.distributed as FSDP1's _optim_utils sees it after fix_fsdp1_optim_state_dict(): broadcast and
    broadcast_object_list take `src` as a rank of `group` (what _optim_utils means: it tests
    dist.get_rank(group) == 0 before each of them); everything else is torch.distributed itself."""

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def _as_group_src(self, kwargs):
        group, src = kwargs.get("group"), kwargs.get("src")
        if group is not None and src is not None and kwargs.get("group_src") is None:
            kwargs["group_src"] = kwargs.pop("src")
        return kwargs

    def broadcast_object_list(self, object_list, **kwargs):
        return self._dist.broadcast_object_list(object_list, **self._as_group_src(kwargs))

    def broadcast(self, tensor, **kwargs):
        return self._dist.broadcast(tensor, **self._as_group_src(kwargs))


def fix_fsdp1_optim_state_dict() -> bool:
    """get_state_dict(model, optim) with FSDP1 over a sub-mesh that does not hold global rank 0 (idempotent).

    From torch 2.10 or so (2.15 here; 2.9 passes no group) torch.distributed.checkpoint.state_dict hands FSDP's own
    process group to FSDP.optim_state_dict, whose _optim_utils then calls broadcast_object_list(..., src=0,
    group=group) / broadcast(..., src=0, group=group), meaning the group's rank 0, while torch reads `src` as a
    global rank: "ValueError: Global rank 0 is not part of group" on every dp group but the first (transformers'
    examples/3D_parallel.py with DP_SIZE=2 at its DCP save). The fix gives that one module a torch.distributed whose
    two broadcasts take `src` as a group rank. Returns True when installed (or already), False where torch passes
    no group (nothing to fix) or the module is not there.
    """
    try:
        from torch.distributed.checkpoint import state_dict as dcp_state_dict
        from torch.distributed.fsdp import _optim_utils
    except ImportError:
        return False
    if not hasattr(dcp_state_dict, "_get_fsdp_process_group"):
        return False
    if isinstance(getattr(_optim_utils, "dist", None), _GroupRankSrc):
        return True
    if getattr(_optim_utils, "dist", None) is None:
        return False
    _optim_utils.dist = _GroupRankSrc(_optim_utils.dist)
    return True


def wrap_pipeline_stage(stage, forward_one_chunk, backward_one_chunk) -> None:
    """Replace a torch.distributed.pipelining stage's per-microbatch forward and backward (the methods every
    schedule of torch 2.9 .. 2.15 calls) with the given wrappers of them, on that one stage object."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        if not callable(getattr(stage, name, None)):
            raise CompatError(f"t3d: torch {torch_version()}'s pipelining stage has no {name} ({_range_note()})")
    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


def premul_sum_op(factor: float):
    """ReduceOp.PREMUL_SUM with a scalar factor (torch.distributed._make_nccl_premul_sum, 2.9 .. 2.15)."""
    import torch.distributed as dist

    fn = getattr(dist, "_make_nccl_premul_sum", None)
    if fn is None:
        raise CompatError(f"t3d: torch {torch_version()} has no _make_nccl_premul_sum ({_range_note()})")
    return fn(factor)


__all__ = ["CPHooks", "CP_TABLE_LOCATIONS", "TESTED", "backend_registered", "cp_hooks", "cp_load_balance",
           "cp_unshard", "default_group", "dtensor_local", "fix_fsdp1_optim_state_dict", "flat_param_layout",
           "flatten_mesh", "group_backend", "premul_sum_op",
           "set_cp_load_balance", "set_cp_rotate_method", "torch_version",
           "wrap_pipeline_stage"]
