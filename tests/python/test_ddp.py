# DistributedDataParallel on a small MLP: a few SGD steps on per-rank shards must match one process training on the
# concatenated batch; also DDP's initial broadcast, small buckets, no_sync, and communication hooks with futures.
import pytest

import _dist

STEPS, PER_RANK, LR = 3, 4, 0.1


def _mlp(seed):
    import torch
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).double()


def _data(ws):
    import torch
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, ws * PER_RANK, 8, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, ws * PER_RANK, 4, generator=g, dtype=torch.float64)
    return x, y


def _reference(ws, grad_scale=1.0):
    """One process, the whole batch per step."""
    import torch
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data(ws)
    for s in range(STEPS):
        opt.zero_grad()
        (torch.nn.functional.mse_loss(model(x[s]), y[s]) * grad_scale).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _compare(params, ref, atol, what):
    import torch
    for i, (p, r) in enumerate(zip(params, ref)):
        err = (p.detach() - r).abs().max().item()
        assert torch.allclose(p.detach(), r, atol=atol, rtol=0), f"{what}: parameter {i} differs by {err:.3g}"


def _train(rank, ws, ddp, micro=1):
    import torch
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    x, y = _data(ws)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for s in range(STEPS):
        opt.zero_grad()
        xs, ys = x[s][sl].chunk(micro), y[s][sl].chunk(micro)
        for m in range(micro):
            if m < micro - 1:
                with ddp.no_sync():
                    torch.nn.functional.mse_loss(ddp(xs[m]), ys[m]).backward()
            else:
                torch.nn.functional.mse_loss(ddp(xs[m]), ys[m]).backward()
        opt.step()


def chk_ddp_default(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(_mlp(seed=rank))   # different start on every rank: DDP must broadcast rank 0's parameters
    _compare(ddp.module.parameters(), [p.detach() for p in _mlp(0).parameters()], 0.0, "after DDP() broadcast")
    _train(rank, ws, ddp)
    _compare(ddp.module.parameters(), _reference(ws), 1e-5, f"DDP on rank {rank}")


def chk_ddp_small_buckets(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(_mlp(0), bucket_cap_mb=0.0005, gradient_as_bucket_view=True)   # ~one parameter per bucket
    _train(rank, ws, ddp)
    _compare(ddp.module.parameters(), _reference(ws), 1e-5, f"DDP small buckets on rank {rank}")


def chk_ddp_no_sync(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(_mlp(0))
    _train(rank, ws, ddp, micro=2)
    # Two micro-batch means summed: twice the gradient of the full-batch mean
    _compare(ddp.module.parameters(), _reference(ws, grad_scale=2.0), 1e-5, f"DDP no_sync on rank {rank}")


def _future_hook(state, bucket):
    import torch.distributed as dist
    ws = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(ws))


def chk_ddp_future_hook(rank, ws):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(_mlp(0), bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, _future_hook)
    _train(rank, ws, ddp)
    _compare(ddp.module.parameters(), _reference(ws), 1e-5, f"DDP custom future hook on rank {rank}")


def chk_ddp_builtin_hooks(rank, ws):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(_mlp(0))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    _train(rank, ws, ddp)
    _compare(ddp.module.parameters(), _reference(ws), 1e-5, f"DDP allreduce_hook on rank {rank}")
    ddp = DDP(_mlp(0))
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)   # all_reduce in float16
    _train(rank, ws, ddp)
    _compare(ddp.module.parameters(), _reference(ws), 5e-3, f"DDP fp16_compress_hook on rank {rank}")


CHECKS = [("ddp_default", chk_ddp_default), ("ddp_small_buckets", chk_ddp_small_buckets),
          ("ddp_no_sync", chk_ddp_no_sync), ("ddp_future_hook", chk_ddp_future_hook),
          ("ddp_builtin_hooks", chk_ddp_builtin_hooks)]
SPEC = {ws: [(n, fn, (), None) for n, fn in CHECKS] for ws in (2, 3)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ws,name", _dist.check_params(SPEC))
def test_ddp(world_cache, ws, name):
    _dist.run_check_item(world_cache, "ddp", SPEC, ws, name)
