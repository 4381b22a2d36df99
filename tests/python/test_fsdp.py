# FSDP1 (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD with device_id=cpu) and FSDP2 fully_shard on CPU: a few optimizer steps
# on per-rank shards must match one process training on the concatenated batch. World 3 shards unevenly.
import pytest

import _dist

STEPS, PER_RANK, LR = 3, 4, 0.05


def _mlp(seed=0):
    import torch
    from torch import nn
    torch.manual_seed(seed)
    # 13 and 7 are odd on purpose: 3 ranks cannot split these evenly, so padding paths run
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 7), nn.ReLU(), nn.Linear(7, 4))


def _data(ws):
    import torch
    g = torch.Generator().manual_seed(99)
    return (torch.randn(STEPS, ws * PER_RANK, 8, generator=g), torch.randn(STEPS, ws * PER_RANK, 4, generator=g))


def _opt(params):
    import torch
    return torch.optim.Adam(params, lr=LR)


def _reference(ws):
    import torch
    model = _mlp()
    opt = _opt(model.parameters())
    x, y = _data(ws)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s]), y[s])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def _train(rank, ws, model):
    import torch
    import torch.distributed as dist
    opt = _opt(model.parameters())
    x, y = _data(ws)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s][sl]), y[s][sl])
        loss.backward()
        opt.step()
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / ws)
    return losses


def _compare(got, ref, losses, ref_losses, what, atol=1e-5):
    import torch
    assert got.keys() == ref.keys(), f"{what}: parameter names {sorted(got)} != {sorted(ref)}"
    for n in ref:
        err = (got[n] - ref[n]).abs().max().item()
        assert got[n].shape == ref[n].shape and torch.allclose(got[n], ref[n], atol=atol, rtol=0), \
            f"{what}: {n} differs by {err:.3g}"
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) < 1e-5, f"{what}: step {s} mean loss {a} != single-process {b}"


def chk_fsdp1(rank, ws, strategy):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    # sync_module_states=True is refused for CPU modules even with device_id=cpu, so every rank starts equal
    model = FSDP(_mlp(), device_id=torch.device("cpu"),
                 sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=True)
    losses = _train(rank, ws, model)
    with FSDP.summon_full_params(model):
        got = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    ref, ref_losses = _reference(ws)
    _compare(got, ref, losses, ref_losses, f"FSDP1 {strategy} rank {rank}")


def chk_fsdp1_nested(rank, ws):
    """Each Linear its own FSDP unit (several all_gather / reduce_scatter rounds per step)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    model = FSDP(_mlp(), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 use_orig_params=True)
    losses = _train(rank, ws, model)
    with FSDP.summon_full_params(model):
        got = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    ref, ref_losses = _reference(ws)
    _compare(got, ref, losses, ref_losses, f"FSDP1 nested FULL_SHARD rank {rank}")


def chk_fsdp2(rank, ws, reshard):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (ws,))
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    for n, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", f"{n} is {type(p)} after fully_shard"
    losses = _train(rank, ws, model)
    got = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    ref, ref_losses = _reference(ws)
    _compare(got, ref, losses, ref_losses, f"FSDP2 reshard_after_forward={reshard} rank {rank}")


CHECKS = [("fsdp1_no_shard", chk_fsdp1, ("NO_SHARD",)), ("fsdp1_shard_grad_op", chk_fsdp1, ("SHARD_GRAD_OP",)),
          ("fsdp1_full_shard", chk_fsdp1, ("FULL_SHARD",)), ("fsdp1_nested", chk_fsdp1_nested, ()),
          ("fsdp2_fully_shard", chk_fsdp2, (True,)), ("fsdp2_no_reshard", chk_fsdp2, (False,))]
SPEC = {ws: [(n, fn, a, None) for n, fn, a in CHECKS] for ws in (2, 3)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ws,name", _dist.check_params(SPEC))
def test_fsdp(world_cache, ws, name):
    _dist.run_check_item(world_cache, "fsdp", SPEC, ws, name)
