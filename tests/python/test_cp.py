# torch.distributed.tensor.experimental.context_parallel on CPU tensors with t3d.cp enabled (backend t3d): a small
# attention model calling F.scaled_dot_product_attention gives the non-parallel output and parameter gradients,
# causal and not, with torch's load balancing on and off, on 2 and 4 ranks.
import re

import pytest
import torch

import _dist


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, causal):
        b, s, e = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, e))


def _cp_checks(rank, ws):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import t3d.cp
    from t3d._compat.torch_compat import cp_unshard as context_parallel_unshard

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("cp",))
    done = []
    for load_balance in (True, False):
        t3d.cp.set_load_balance(load_balance)
        for causal in (True, False):
            torch.manual_seed(0)
            model = TinyAttention()
            x = torch.randn(2, 8 * ws, 32)
            w = torch.randn(2, 8 * ws, 32)
            ref_model = copy.deepcopy(model)
            ref_out = ref_model(x, causal)
            (ref_out * w).sum().backward()

            xc, wc = x.clone(), w.clone()
            with context_parallel(mesh, buffers=[xc, wc], buffer_seq_dims=[1, 1]):
                out = model(xc, causal)
                (out * wc).sum().backward()
                full = context_parallel_unshard(mesh, [out.detach()], [1])[0]
            torch.testing.assert_close(full, ref_out.detach(), atol=2e-5, rtol=2e-5)
            # Each rank's loss covers its part of the sequence: the sum over ranks is the full gradient.
            for (name, p), rp in zip(model.named_parameters(), ref_model.parameters()):
                g = p.grad.clone()
                dist.all_reduce(g, group=mesh.get_group())
                torch.testing.assert_close(g, rp.grad, atol=5e-5, rtol=5e-5,
                                           msg=lambda m: f"{name} lb={load_balance} causal={causal}: {m}")
            done.append((load_balance, causal))
    t3d.cp.set_load_balance(True)
    return done


def _cuda_op_handlers(rank, ws):
    """t3d's handlers of the CUDA SDPA ops (flash, efficient; opt-in on CUDA, T3D_CP_CUDA=1), called directly with
    CPU DTensors: the ring they run is device-generic, so their arguments, their outputs (the op schemas' tuples) and
    their values are checked here; the GPU check compares them with torch's own on a GPU (test_cuda.py)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import t3d.cp

    aten = torch.ops.aten
    mesh = init_device_mesh("cpu", (ws,))
    t3d.cp.set_load_balance(False)  # contiguous chunks, as distribute_tensor shards the sequence
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8 * ws, 16, requires_grad=True) for _ in range(3))
    checked = []
    for causal in (True, False):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        g = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), g)
        qd, kd, vd, gd = (distribute_tensor(x.detach(), mesh, [Shard(2)]) for x in (q, k, v, g))

        res = t3d.cp._handler(aten._scaled_dot_product_flash_attention.default, (qd, kd, vd, 0.0, causal), {})
        assert len(res) == 9 and res[2] is None and res[3] is None and (res[4], res[5]) == (8, 8), res
        assert all(isinstance(t, DTensor) for t in (res[0], res[1], res[6], res[7], res[8]))
        torch.testing.assert_close(res[0].full_tensor(), ref.detach(), atol=2e-5, rtol=2e-5)
        grads = t3d.cp._handler(aten._scaled_dot_product_flash_attention_backward.default,
                                (gd, qd, kd, vd, res[0], res[1], *res[2:6], 0.0, causal, res[6], res[7]),
                                {"scale": None})
        for got, w, name in zip(grads, want, "qkv"):
            torch.testing.assert_close(got.full_tensor(), w, atol=5e-5, rtol=5e-5, msg=lambda m: f"flash d{name}: {m}")

        res = t3d.cp._handler(aten._scaled_dot_product_efficient_attention.default,
                              (qd, kd, vd, None, True, 0.0, causal), {})
        assert len(res) == 4 and all(isinstance(t, DTensor) for t in res), res
        torch.testing.assert_close(res[0].full_tensor(), ref.detach(), atol=2e-5, rtol=2e-5)
        grads = t3d.cp._handler(aten._scaled_dot_product_efficient_attention_backward.default,
                                (gd, qd, kd, vd, None, res[0], res[1], res[2], res[3], 0.0, [True, True, True, False],
                                 causal), {})
        assert len(grads) == 4 and grads[3] is None
        for got, w, name in zip(grads, want, "qkv"):
            torch.testing.assert_close(got.full_tensor(), w, atol=5e-5, rtol=5e-5,
                                       msg=lambda m: f"efficient d{name}: {m}")
        checked.append(causal)
    t3d.cp.set_load_balance(True)
    return checked


@pytest.mark.timeout(150)
def test_cuda_op_handlers_on_cpu_tensors():
    assert _dist.run_world(_cuda_op_handlers, 2, timeout=120) == [[True, False]] * 2


def test_cuda_handlers_are_opt_in_and_give_torchs_back():
    import t3d.cp

    aten = torch.ops.aten
    _, table = t3d.cp._hook_table()
    ops = (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention_backward.default)
    before = {op: table.get(op) for op in ops}
    try:
        t3d.cp.enable()  # T3D_CP_CUDA unset: torch's own handlers stay
        assert not t3d.cp.cuda_enabled() and all(table.get(op) is before[op] for op in ops)
        t3d.cp.enable(cuda=True)
        assert t3d.cp.cuda_enabled() and all(table[op] is t3d.cp._handler for op in ops)
        t3d.cp.enable(cuda=False)
        assert not t3d.cp.cuda_enabled() and all(table.get(op) is before[op] for op in ops)
        t3d.cp.enable(cuda=True)
        t3d.cp.disable()
        assert all(table.get(op) is before[op] for op in ops)
    finally:
        t3d.cp.enable(cuda=False)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ws", [2, 4])
def test_context_parallel_cpu_matches_single_process(ws):
    results = _dist.run_world(_cp_checks, ws, timeout=120)
    assert all(len(r) == 4 for r in results)


def test_missing_hooks_name_the_torch_version(monkeypatch):
    import t3d.cp
    from t3d._compat import torch_compat

    monkeypatch.setattr(torch_compat, "CP_TABLE_LOCATIONS", (("t3d_no_such_module_for_test", "custom_ops"),))
    monkeypatch.setattr(torch_compat, "_cp_candidates", lambda: torch_compat.CP_TABLE_LOCATIONS)
    with pytest.raises(RuntimeError, match=re.escape(f"t3d.cp: torch {torch.__version__} has no context-parallel "
                                                     f"hook table")):
        t3d.cp.enable()


def test_enable_disable_registers_cpu_ops():
    import t3d.cp
    from t3d._compat import torch_compat

    table = torch_compat.cp_hooks().table
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    t3d.cp.disable()
    assert op not in table
    t3d.cp.enable()
    assert op in table and t3d.cp.is_enabled()


def _cp_without_import(rank, ws):
    import sys

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    # The script never imported t3d: creating the t3d group enabled the CPU handlers.
    assert "t3d.cp" in sys.modules
    from t3d._compat.torch_compat import cp_hooks
    from t3d._compat.torch_compat import cp_unshard as context_parallel_unshard

    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in cp_hooks().table
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(1, 8 * ws, 32)
    ref = model(x, True).detach()
    xc = x.clone()
    with context_parallel(mesh, buffers=[xc], buffer_seq_dims=[1]):
        out = model(xc, True)
        full = context_parallel_unshard(mesh, [out.detach()], [1])[0]
    torch.testing.assert_close(full, ref, atol=2e-5, rtol=2e-5)
    return True


@pytest.mark.timeout(150)
def test_context_parallel_cpu_works_for_a_script_that_only_changed_the_backend():
    assert all(_dist.run_world(_cp_without_import, 2, timeout=120, import_t3d=False))
