# CUDA tensors on backend t3d (NCCL underneath, or staged through host memory where ranks share a GPU): every
# collective's values, stream order (results are ready on the caller's stream after wait(), also when the caller
# works on a side stream), futures, coalescing, DDP, FSDP1, FSDP2, tensor parallelism and context parallelism (torch's
# ring and t3d's CUDA kernels) against one process, and the errors of mixed devices. The GPU tests skip without a
# GPU; the NCCL ones with two ranks need two GPUs (NCCL refuses two ranks on one), the shared-GPU ones run 2 and 4
# (and, for some cases, 8) ranks on whatever GPUs there are. One check runs everywhere: what build_info says of CUDA and NCCL.
import pytest

import _dist

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NEEDS_GPU = pytest.mark.skipif(GPUS < 1, reason="no CUDA device on this machine")
NEEDS_2_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"{GPUS} CUDA device(s): NCCL needs one GPU per rank")


def test_build_info_reports_cuda_and_nccl():
    import t3d

    info = t3d.build_info()
    if torch.version.cuda is None:
        assert info["cuda"] is False
        return
    # A CUDA torch: the shim is built with CUDA support and finds the NCCL torch itself loaded.
    assert info["cuda"] is True
    assert info["nccl_version"] == ".".join(str(v) for v in torch.cuda.nccl.version()), info


# ---- on GPUs --------------------------------------------------------------------------------------------------


def _dev(rank):
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def _broadcast_gather_scatter(base, rank, ws):
    """broadcast, all_gather_into_tensor and reduce_scatter_tensor of tensors like base (on this rank's device)."""
    import torch.distributed as dist
    t = base + rank
    dist.broadcast(t, src=ws - 1)
    assert torch.equal(t, base + ws - 1), "broadcast"
    out = torch.empty(ws * base.numel(), device=base.device)
    dist.all_gather_into_tensor(out, base + rank)
    assert torch.equal(out, torch.cat([base + r for r in range(ws)])), "all_gather_into_tensor"
    inp = torch.cat([base + 10 * r + rank for r in range(ws)])
    out = torch.empty(base.numel(), device=base.device)
    dist.reduce_scatter_tensor(out, inp)
    assert torch.equal(out, ws * (base + 10 * rank) + sum(range(ws))), "reduce_scatter_tensor"


def _collectives(rank, ws):
    """Every collective on CUDA tensors, with values every rank can predict."""
    import torch.distributed as dist
    dev = _dev(rank)
    n = 1000
    base = torch.arange(n, dtype=torch.float32, device=dev)

    t = base + rank
    dist.all_reduce(t)
    assert torch.equal(t, base * ws + sum(range(ws))), "all_reduce SUM"
    for op, want in [(dist.ReduceOp.MAX, base + ws - 1), (dist.ReduceOp.MIN, base),
                     (dist.ReduceOp.AVG, base + (ws - 1) / 2)]:
        t = base + rank
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, want), f"all_reduce {op}"
    t = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=dev)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert torch.allclose(t.float(), torch.full((n,), 0.5 * sum(range(1, ws + 1)), device=dev)), "PREMUL_SUM bf16"
    b = torch.tensor([True, False, rank == 0], device=dev)
    dist.all_reduce(b)  # bool SUM is "any"
    assert b.tolist() == [True, False, True], "bool SUM"

    _broadcast_gather_scatter(base, rank, ws)
    outs = [torch.empty(r + 1, device=dev) for r in range(ws)]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank), device=dev))  # uneven sizes
    assert all(torch.equal(o, torch.full((r + 1,), float(r), device=dev)) for r, o in enumerate(outs)), "all_gather"

    # all_to_all_single with uneven and zero splits, as context parallelism uses it.
    send = [(r + rank) % 3 for r in range(ws)]
    recv = [(rank + r) % 3 for r in range(ws)]
    inp = torch.cat([torch.full((send[r], 2), float(100 * rank + r), device=dev) for r in range(ws)])
    out = torch.empty(sum(recv), 2, device=dev)
    dist.all_to_all_single(out, inp, recv, send)
    want = torch.cat([torch.full((recv[r], 2), float(100 * r + rank), device=dev) for r in range(ws)])
    assert torch.equal(out, want), "all_to_all_single"

    gathered = [torch.empty(3, device=dev) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.full((3,), float(rank), device=dev), gathered, dst=0)
    if rank == 0:
        assert all(torch.equal(g, torch.full((3,), float(r), device=dev)) for r, g in enumerate(gathered)), "gather"
    got = torch.empty(3, device=dev)
    dist.scatter(got, [torch.full((3,), float(r), device=dev) for r in range(ws)] if rank == 0 else None, src=0)
    assert torch.equal(got, torch.full((3,), float(rank), device=dev)), "scatter"
    t = base + rank
    dist.reduce(t, dst=0)
    if rank == 0:
        assert torch.equal(t, base * ws + sum(range(ws))), "reduce"
    dist.barrier()
    return True


def _stream_order(rank, ws):
    """The caller works on a side stream: inputs written there are what the collective reads, and after wait() the
    result is what later work on that stream sees; async_op with a future, too."""
    import torch.distributed as dist
    dev = _dev(rank)
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        for i in range(20):
            t = torch.full((1 << 20,), float(rank + i), device=dev)
            t.mul_(2)  # queued on `side` right before the collective
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            t.add_(1)
            assert t[0].item() == 2 * sum(rank_ + i for rank_ in range(ws)) + 1, f"iteration {i}"
        t = torch.ones(1000, device=dev)
        fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
        assert torch.equal(fut.wait(), torch.full((1000,), 3.0 * ws, device=dev)), "future"
    torch.cuda.synchronize(dev)
    return True


def _coalesced_and_objects(rank, ws):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager
    dev = _dev(rank)
    ins = [torch.full((4,), float(rank + i), device=dev) for i in range(3)]
    outs = [torch.empty(4 * ws, device=dev) for _ in range(3)]
    with _coalescing_manager(device=dev, async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.cat([torch.full((4,), float(r + k), device=dev) for r in range(ws)]))
    objs = [None] * ws
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(ws)]
    return True


def _mixed_devices_rejected(rank, ws):
    import torch.distributed as dist
    dev = _dev(rank)
    with pytest.raises(RuntimeError, match="the tensors of one call share a device"):
        dist.all_gather_into_tensor(torch.empty(4 * ws, device=dev), torch.empty(4))
    # The group goes on: CPU and CUDA collectives interleave on one t3d group.
    c, g = torch.ones(8), torch.ones(8, device=dev)
    dist.all_reduce(c)
    dist.all_reduce(g)
    assert c.sum().item() == 8 * ws and g.sum().item() == 8 * ws
    return True


def _ddp_matches_one_process(rank, ws):
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dev = _dev(rank)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev), device_ids=[dev.index])
    model.module.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ws * 8, 16, generator=g).to(dev), torch.randn(ws * 8, 4, generator=g).to(dev)
    nn.functional.mse_loss(ref(x), y).backward()
    nn.functional.mse_loss(model(x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, atol=1e-5), "DDP gradient"
    dist.barrier()
    return True


def _p2p(rank, ws):
    import torch.distributed as dist
    dev = _dev(rank)
    # Standalone send/recv between two ranks (a two-rank NCCL communicator), then a batched ring.
    if rank < 2:
        t = torch.full((5,), float(rank), device=dev)
        if rank == 0:
            dist.send(t, dst=1)
        else:
            dist.recv(t, src=0)
            assert torch.equal(t, torch.zeros(5, device=dev)), "recv"
    send = torch.full((7,), float(rank), device=dev)
    recv = torch.empty(7, device=dev)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % ws), dist.P2POp(dist.irecv, recv, (rank - 1) % ws)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv, torch.full((7,), float((rank - 1) % ws), device=dev)), "ring"
    return True


def _fsdp2_and_tp(rank, ws):
    """FSDP2 (each rank a share of the batch) and DTensor tensor parallelism (the whole batch) give the gradients
    of one process."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    dev = _dev(rank)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(dev)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(ws * 4, 16, generator=g).to(dev)
    ref = make()
    ref(x).square().mean().backward()
    mesh = init_device_mesh("cuda", (ws,))
    sharded = make()
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded[2], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded(x[rank * 4:(rank + 1) * 4]).square().mean().backward()
    for p, r in zip(sharded.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-5), "FSDP2 gradient"
    tp = parallelize_module(make(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out = tp(x)
    with torch.no_grad():
        assert torch.allclose(out, ref(x), atol=1e-5), "TP output"
    out.square().mean().backward()
    for p, r in zip(tp.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-5), "TP gradient"
    return True


def _fsdp1(rank, ws):
    """FSDP1 (FullyShardedDataParallel: FULL_SHARD, SHARD_GRAD_OP, each Linear its own unit), each rank a share of
    the batch: after two SGD steps the full parameters are one process's."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    dev = _dev(rank)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(dev)

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(ws * 4, 16, generator=g).to(dev) for _ in range(2)]
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    for strategy, policy in [(ShardingStrategy.FULL_SHARD, None), (ShardingStrategy.SHARD_GRAD_OP, None),
                             (ShardingStrategy.FULL_SHARD, ModuleWrapPolicy({nn.Linear}))]:
        model = FSDP(make(), device_id=dev, sharding_strategy=strategy, auto_wrap_policy=policy, use_orig_params=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in xs:
            opt.zero_grad()
            model(x[rank * 4:(rank + 1) * 4]).square().mean().backward()
            opt.step()
        with FSDP.summon_full_params(model):
            for p, r in zip(model.parameters(), ref.parameters()):
                assert torch.allclose(p, r, atol=1e-5), f"FSDP1 {strategy} {policy}: {(p - r).abs().max().item()}"
    return True


def _cp_t3d_against_torch(rank, ws):
    """Context parallelism on CUDA tensors: torch's own ring (its flash / efficient kernels) and t3d's (its CUDA
    attention kernels, t3d.cp.enable(cuda=True)) on the same layout, each against one process's SDPA."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import t3d.cp
    from t3d._compat.torch_compat import cp_unshard

    dev = _dev(rank)
    mesh = init_device_mesh("cuda", (ws,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64 * ws, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        for who in ("torch", "t3d"):
            t3d.cp.enable(cuda=who == "t3d")
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                # Buffers are sharded and restored in place (resize_), which torch refuses for tensors that require
                # grad: they require it only between the two, as in torch's own context-parallel tests.
                qc, kc, vc = (x.clone() for x in (q, k, v))
                with sdpa_kernel([backend]), context_parallel(mesh, buffers=[qc, kc, vc], buffer_seq_dims=[2, 2, 2]):
                    for x in (qc, kc, vc):
                        x.requires_grad_()
                    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
                    out.float().square().mean().backward()
                    full = cp_unshard(mesh, [out.detach()], [2])[0]
                    for x in (qc, kc, vc):
                        assert x.grad is not None and x.grad.shape == x.shape, f"{who} {backend}: no gradient"
                        x.requires_grad_(False)
                torch.testing.assert_close(full.float(), ref.float(), atol=2e-2, rtol=2e-2,
                                           msg=lambda m: f"{who} {backend}: {m}")
    finally:
        t3d.cp.enable(cuda=False)
    return True


GPU_CASES = [_collectives, _stream_order, _coalesced_and_objects, _mixed_devices_rejected, _ddp_matches_one_process]


@NEEDS_GPU
@pytest.mark.parametrize("fn", GPU_CASES, ids=lambda f: f.__name__.strip("_"))
def test_one_rank_on_gpu(fn):
    assert _dist.run_world(fn, 1, timeout=180) == [True]


@NEEDS_2_GPUS
@pytest.mark.parametrize("fn", GPU_CASES + [_p2p], ids=lambda f: f.__name__.strip("_"))
def test_two_ranks_on_gpus(fn):
    assert _dist.run_world(fn, 2, timeout=180) == [True, True]


SHARED_CASES = GPU_CASES + [_p2p, _fsdp1, _fsdp2_and_tp, _cp_t3d_against_torch]


@NEEDS_GPU
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("fn", SHARED_CASES, ids=lambda f: f.__name__.strip("_"))
def test_ranks_sharing_a_gpu(fn, ws):
    """More ranks than GPUs (rank r on GPU r % count): NCCL refuses such a group, so t3d moves its CUDA tensors
    itself (c_src/cudev/), in stream order: with the default T3D_CUDA_PATH=auto these cases' tensors, all under
    T3D_CUDA_IPC_MIN_BYTES, are staged through host memory."""
    assert _dist.run_world(fn, ws, timeout=300) == [True] * ws


# Each case once at 4 ranks (2 ran on an H200 first), the heaviest again at 8: the GPU check's time is short.
IPC_CASES = [(f, 4) for f in (_collectives, _stream_order, _coalesced_and_objects, _ddp_matches_one_process,
                              _fsdp2_and_tp)] + [(_collectives, 8), (_fsdp2_and_tp, 8)]


@NEEDS_GPU
@pytest.mark.parametrize("fn,ws", IPC_CASES, ids=[f"{f.__name__.strip('_')}-{w}" for f, w in IPC_CASES])
def test_ranks_sharing_a_gpu_device_path(fn, ws, monkeypatch):
    """T3D_CUDA_PATH=ipc: the same cases with the collectives run by the device (c_src/cudev/ipc.c: buffers mapped
    through CUDA IPC, copies and t3d._C_cuda's reduction in stream order) instead of staged through host memory;
    T3D_CUDA_IPC_MIN_BYTES=0 so that the small tensors of these cases take it too."""
    monkeypatch.setenv("T3D_CUDA_PATH", "ipc")
    monkeypatch.setenv("T3D_CUDA_IPC_MIN_BYTES", "0")
    assert _dist.run_world(fn, ws, timeout=300) == [True] * ws


def _large_collectives(rank, ws):
    """Collectives of 4 MiB and more, which the default T3D_CUDA_PATH=auto runs on the device path when ranks
    share a GPU, each followed on the same stream by work that reads the result."""
    import torch.distributed as dist
    dev = _dev(rank)
    n = 1 << 20  # float32: 4 MiB
    base = torch.arange(n, dtype=torch.float32, device=dev) % 1000
    for _ in range(3):  # back to back: each reuses the buffers the last one's peers read
        t = base + rank
        dist.all_reduce(t)
        assert torch.equal(t, base * ws + sum(range(ws))), "all_reduce SUM"
    t = (base + rank).bfloat16()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t.float(), (base + ws - 1).bfloat16().float()), "all_reduce MAX bf16"
    _broadcast_gather_scatter(base, rank, ws)
    inp = torch.cat([torch.full((n // ws,), float(100 * rank + r), device=dev) for r in range(ws)])
    out = torch.empty(n // ws * ws, device=dev)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.full((n // ws,), float(100 * r + rank), device=dev) for r in range(ws)])
    assert torch.equal(out, want), "all_to_all_single"
    return True


@NEEDS_GPU
@pytest.mark.parametrize("ws", [2, 8])
def test_ranks_sharing_a_gpu_default_path_large_tensors(ws):
    """The default path (T3D_CUDA_PATH=auto) with tensors past T3D_CUDA_IPC_MIN_BYTES: the device path."""
    assert _dist.run_world(_large_collectives, ws, timeout=300) == [True] * ws


@NEEDS_GPU
@pytest.mark.parametrize("fn", [_collectives, _p2p, _fsdp1, _fsdp2_and_tp, _cp_t3d_against_torch],
                         ids=lambda f: f.__name__.strip("_"))
def test_eight_ranks_sharing_a_gpu(fn):
    """The 3D workflow's world size, 8 ranks on whatever GPUs there are."""
    assert _dist.run_world(fn, 8, timeout=400) == [True] * 8
