# t3d._compat: every adapter function on the stack that runs the test (torch 2.9 .. 2.15, transformers 4.57 .. 5.x),
# and the one-line error when the private piece an adapter looks for is missing (detection monkeypatched).
import re

import pytest
import torch

import _dist
from t3d._compat import CompatError, hf_compat, torch_compat, version_tuple

ONE_LINE = re.compile(r"[^\n]+")


def test_version_tuple():
    assert version_tuple("2.15.0+cu132") == (2, 15)
    assert version_tuple("5.24.0.dev0") == (5, 24)
    assert version_tuple("garbage") == (0, 0)


# --- torch ----------------------------------------------------------------------------------------------------------

def test_cp_hooks_found_where_this_torch_keeps_them():
    hooks = torch_compat.cp_hooks()
    assert isinstance(hooks.table, dict) and hasattr(hooks.options, "enable_load_balance")
    name = hooks.module.__name__
    if version_tuple(torch.__version__) >= (2, 10):
        assert name.endswith("_context_parallel._attention") and hooks.table is hooks.module.custom_ops
    else:
        assert name.endswith("experimental._attention") and hooks.table is hooks.module.customized_ops
    # torch's own CUDA SDPA handlers are in the same table t3d adds its CPU ones to.
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in hooks.table


def test_cp_options_round_trip():
    before = torch_compat.cp_load_balance()
    try:
        torch_compat.set_cp_load_balance(False)
        assert torch_compat.cp_load_balance() is False
        assert torch_compat.cp_hooks().options.enable_load_balance is False
        torch_compat.set_cp_load_balance(True)
        assert torch_compat.cp_load_balance() is True
    finally:
        torch_compat.set_cp_load_balance(before)
    assert torch_compat.set_cp_rotate_method("allgather") in (True, False)


@pytest.mark.parametrize("missing", ["module", "table"])
def test_cp_hooks_missing_is_one_line_naming_torch(monkeypatch, missing):
    import t3d.cp  # imported (and enabled) before the table goes missing

    loc = ("t3d_no_such_module_for_test", "custom_ops") if missing == "module" else \
        (torch_compat.cp_hooks().module.__name__, "t3d_no_such_table")
    monkeypatch.setattr(torch_compat, "_cp_candidates", lambda: (loc,))
    with pytest.raises(CompatError) as e:
        torch_compat.cp_hooks()
    msg = str(e.value)
    assert ONE_LINE.fullmatch(msg), msg
    assert msg.startswith(f"t3d.cp: torch {torch.__version__} has no context-parallel hook table (looked for ")
    assert loc[0] in msg and "t3d supports torch 2.9..2.15" in msg
    # ... and that is what t3d.cp.enable() and t3d-train's CP set-up raise (CompatError is a RuntimeError).
    with pytest.raises(RuntimeError, match="has no context-parallel hook table"):
        t3d.cp.enable()
    with pytest.raises(RuntimeError, match="has no context-parallel hook table"):
        torch_compat.set_cp_load_balance(False)


def test_cp_candidates_follow_the_version(monkeypatch):
    monkeypatch.setattr(torch_compat, "torch_version", lambda: "2.9.1")
    assert torch_compat._cp_candidates()[0][1] == "customized_ops"
    monkeypatch.setattr(torch_compat, "torch_version", lambda: "2.15.0")
    assert torch_compat._cp_candidates()[0][1] == "custom_ops"


def test_missing_private_pieces_raise_one_line(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    class NoFlatten:
        pass

    with pytest.raises(CompatError, match=rf"^t3d: torch {re.escape(torch.__version__)} has no DeviceMesh._flatten"):
        torch_compat.flatten_mesh(NoFlatten(), "x")
    assert hasattr(DeviceMesh, "_flatten")  # the real one is there

    class HalfFlat:  # a FlatParameter-like object without _fqns
        _numels_with_padding = (2,)
        _is_padding_mask = (False,)

    with pytest.raises(CompatError, match="FlatParameter lacks"):
        torch_compat.flat_param_layout(HalfFlat())
    assert torch_compat.flat_param_layout(torch.nn.Parameter(torch.zeros(2))) is None

    import torch.distributed as dist

    monkeypatch.delattr(dist.distributed_c10d, "_get_default_group")
    with pytest.raises(CompatError, match="has no distributed_c10d._get_default_group"):
        torch_compat.default_group()
    with pytest.raises(CompatError, match="ProcessGroup has no _get_backend"):
        torch_compat.group_backend(object(), torch.device("cpu"))


def test_backend_registered():
    import t3d  # noqa: F401  (registers the backend)

    assert torch_compat.backend_registered("t3d")
    assert not torch_compat.backend_registered("t3d_no_such_backend")


def test_dtensor_local_of_plain_tensor_like():
    class Fake:
        _local_tensor = torch.ones(1)

    assert torch_compat.dtensor_local(Fake()) is Fake._local_tensor


def _torch_world_checks(rank, ws):
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor.experimental import context_parallel

    import t3d

    assert torch_compat.default_group() is dist.group.WORLD
    assert "ucx" in t3d.transport()  # "ucx" or "shm+ucx"
    torch_compat.group_backend(torch_compat.default_group(), torch.device("cpu"))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    flat = torch_compat.flatten_mesh(mesh["a", "b"], "ab")
    assert flat.size() == 4 and flat.mesh.tolist() == [0, 1, 2, 3]

    # context_parallel + cp_unshard on the "b" sub-mesh: the buffer comes back whole.
    torch_compat.set_cp_load_balance(False)
    x = torch.arange(8.0).reshape(1, 8)
    with context_parallel(mesh["b"], buffers=[x], buffer_seq_dims=[1]):
        assert x.shape == (1, 4)
        full = torch_compat.cp_unshard(mesh["b"], [x.clone()], [1])[0]
    assert full.tolist() == [list(range(8))]
    torch_compat.set_cp_load_balance(True)

    # FSDP1 FlatParameter: the layout names every original parameter with its shape.
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), device_mesh=mesh["a"],
                 sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    layouts = [torch_compat.flat_param_layout(p) for p in model.parameters()]
    entries = [(n, numel, tuple(s)) for lay in layouts if lay for n, numel, s in lay if n is not None]
    assert entries == [("0.weight", 12, (4, 3)), ("0.bias", 4, (4,)), ("1.weight", 8, (2, 4)),
                       ("1.bias", 2, (2,))], entries

    # get_state_dict(model, optim) under FSDP1 on a sub-mesh: ranks 1 and 3 form a group without global rank 0
    # (torch 2.15 broadcasts "from rank 0" in it; the fix, installed when the t3d group was created, makes that the
    # group's rank 0). torch 2.9 passes no group and needs no fix.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from t3d._compat.torch_compat import fix_fsdp1_optim_state_dict

    assert fix_fsdp1_optim_state_dict() is (version_tuple(torch.__version__) >= (2, 15))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optim.step()
    _, osd = get_state_dict(model, optim)
    assert set(osd["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}, sorted(osd["state"])
    return True


@pytest.mark.timeout(200)
@pytest.mark.skipif(_dist.BACKEND != "t3d", reason="checks t3d's transport through the adapter")
def test_torch_adapters_in_a_world():
    assert all(_dist.run_world(_torch_world_checks, 4, timeout=150))


# --- transformers ---------------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def test_tp_api_matches_the_version():
    api = hf_compat.tp_api()
    assert api == ("v5" if version_tuple(transformers.__version__) >= (5, 0) else "v4")


def test_tp_api_missing_is_one_line_naming_transformers(monkeypatch):
    monkeypatch.setattr(hf_compat, "V4_PIECES", ("transformers.t3d_no_such_piece_v4",))
    monkeypatch.setattr(hf_compat, "V5_PIECES", ("transformers.t3d_no_such_piece_v5",))
    with pytest.raises(CompatError) as e:
        hf_compat.tp_api()
    msg = str(e.value)
    assert ONE_LINE.fullmatch(msg), msg
    assert msg.startswith(f"t3d.hf: transformers {transformers.__version__} has no tensor-parallel API t3d knows")
    assert "t3d_no_such_piece_v4" in msg and "t3d_no_such_piece_v5" in msg
    # The loading fix then declines quietly (t3d.hf is imported by every t3d group when transformers is loaded);
    # loading a TP model says the one line.
    assert hf_compat.install_mesh_loading_fix() is False


def test_strip_cpu_index():
    cpu1 = torch.device("cpu", 1)
    assert hf_compat._strip_cpu_index({"": cpu1}) == {"": torch.device("cpu")}
    assert hf_compat._strip_cpu_index(cpu1) == torch.device("cpu")
    same = {"": 0}
    assert hf_compat._strip_cpu_index(same) is same
    assert hf_compat._strip_cpu_index("auto") == "auto"


def test_install_mesh_loading_fix_is_idempotent():
    import t3d.hf

    assert hf_compat.install_mesh_loading_fix() is True
    assert t3d.hf.fix_cpu_tp_loading() is True
    if hf_compat.tp_api() == "v5":
        fp = transformers.PreTrainedModel.__dict__["from_pretrained"].__func__
        assert fp._t3d_mesh_fix and not getattr(fp.__wrapped__, "_t3d_mesh_fix", False)
    else:
        assert transformers.modeling_utils._load_state_dict_into_meta_model._t3d_mesh_fix


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def _hf_world_checks(rank, ws, path):
    """On a (2, 2, 1) mesh: every way t3d shards a model over the "tp" sub-mesh gives the single-process logits and
    loss, and its sharded weights are exactly this rank's slices."""
    import os

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("LOCAL_RANK", str(rank))
    mesh = DeviceMesh("cpu", torch.arange(ws).reshape(2, 2, 1), mesh_dim_names=("dp", "tp", "cp"))
    tp_mesh = mesh["tp"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want = ref(input_ids=ids, labels=ids)

    models = {
        "load_on_tp_mesh": hf_compat.load_on_tp_mesh(path, tp_mesh, torch.device("cpu"), log=lambda m: None),
        "apply_tp_plan": hf_compat.apply_tp_plan(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                                 tp_mesh),
    }
    if hf_compat.install_mesh_loading_fix():
        # What transformers' examples/3D_parallel.py calls: the 3-D mesh's "tp" dimension must be the one used.
        models["from_pretrained(device_mesh)"] = AutoModelForCausalLM.from_pretrained(
            path, device_mesh=tp_mesh, tp_plan="auto", dtype=torch.float32)
    tp_rank = tp_mesh.get_local_rank()
    for how, model in models.items():
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.device_mesh == tp_mesh, (how, type(q))
        rows = q.shape[0] // 2
        torch.testing.assert_close(q.to_local(), ref.model.layers[0].self_attn.q_proj.weight[
            tp_rank * rows:(tp_rank + 1) * rows], msg=lambda m: f"{how}: {m}")
        got = model(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5, msg=lambda m: f"{how}: {m}")
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"{how}: {m}")
    return sorted(models)


@pytest.mark.timeout(300)
@pytest.mark.skipif(_dist.BACKEND != "t3d", reason="TP on backend t3d")
def test_tp_adapters_shard_over_the_given_submesh(tmp_path):
    import importlib.util

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path)
    results = _dist.run_world(_hf_world_checks, 4, str(tmp_path), timeout=240)
    expect = {"load_on_tp_mesh", "apply_tp_plan"}
    if hf_compat.tp_api() == "v5" or importlib.util.find_spec("accelerate") is not None:
        expect.add("from_pretrained(device_mesh)")
    assert all(set(r) == expect for r in results), results
