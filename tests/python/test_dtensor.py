# DTensor: redistribute between Shard(0), Shard(1), Replicate() and Partial() on 1-D and 2-D meshes (uneven shards
# included), checked through full_tensor() and the local shards; a tensor-parallel MLP (ColwiseParallel then
# RowwiseParallel) must match the plain MLP forward and backward.
import pytest

import _dist


def _global(shape, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=g).float()   # integers: sums are exact in any order


def _check_local(dt, full, what):
    """The local shard must be torch.chunk's piece for this rank, for each Shard placement."""
    import torch
    from torch.distributed.tensor import Shard
    exp = full
    for mesh_dim, pl in enumerate(dt.placements):
        if isinstance(pl, Shard):
            pieces = torch.chunk(exp, dt.device_mesh.size(mesh_dim), dim=pl.dim)
            idx = dt.device_mesh.get_local_rank(mesh_dim)
            exp = pieces[idx] if idx < len(pieces) else exp.narrow(pl.dim, 0, 0)
    loc = dt.to_local()
    assert loc.shape == exp.shape and torch.equal(loc, exp), \
        f"{what}: local shard {tuple(loc.shape)} differs from the expected slice {tuple(exp.shape)}"


def chk_redistribute_1d(rank, ws):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor
    mesh = init_device_mesh("cpu", (ws,))
    full = _global((6, 10), 7)   # 6 and 10 do not divide by 4: uneven shards
    places = [Shard(0), Shard(1), Replicate()]
    for a in places:
        for b in places:
            d = distribute_tensor(full, mesh, [a])
            _check_local(d, full, f"distribute {a}")
            r = d.redistribute(mesh, [b])
            _check_local(r, full, f"{a} -> {b}")
            assert torch.equal(r.full_tensor(), full), f"{a} -> {b}: full_tensor differs"
    # Partial: each rank holds a different addend; the sum is known here without any collective
    parts = [_global((6, 10), 100 + r) for r in range(ws)]
    total = torch.stack(parts).sum(0)
    for b in [Replicate(), Shard(0), Shard(1)]:
        p = DTensor.from_local(parts[rank], mesh, [Partial()])
        r = p.redistribute(mesh, [b])
        _check_local(r, total, f"Partial(sum) -> {b}")
        assert torch.equal(r.full_tensor(), total), f"Partial(sum) -> {b}: full_tensor differs"
    p = DTensor.from_local(parts[rank], mesh, [Partial("max")])
    assert torch.equal(p.full_tensor(), torch.stack(parts).amax(0)), "Partial(max).full_tensor differs"


def chk_partial_avg(rank, ws):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    mesh = init_device_mesh("cpu", (ws,))
    parts = [_global((4, 5), 200 + r) for r in range(ws)]
    p = DTensor.from_local(parts[rank], mesh, [Partial("avg")])
    got = p.redistribute(mesh, [Replicate()]).to_local()
    torch.testing.assert_close(got, torch.stack(parts).mean(0), msg=lambda m: f"Partial(avg): {m}")


def chk_redistribute_2d(rank, ws):
    import itertools
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    full = _global((6, 7), 11)
    places = [Shard(0), Shard(1), Replicate()]
    combos = list(itertools.product(places, places))
    for src in combos:
        d = distribute_tensor(full, mesh, list(src))
        for dst in combos[::2]:
            r = d.redistribute(mesh, list(dst))
            _check_local(r, full, f"{src} -> {dst}")
        assert torch.equal(d.full_tensor(), full), f"{src}: full_tensor differs"
    parts = [_global((6, 7), 300 + r) for r in range(ws)]
    p = DTensor.from_local(parts[rank], mesh, [Partial(), Partial()])
    total = torch.stack(parts).sum(0)
    for dst in [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate())]:
        r = p.redistribute(mesh, list(dst))
        assert torch.equal(r.full_tensor(), total), f"(Partial, Partial) -> {dst}: full_tensor differs"


def _mlp():
    import torch
    from torch import nn
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(10, 24), nn.GELU(), nn.Linear(24, 6)).double()


def chk_tp_mlp(rank, ws):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (ws,))
    ref = _mlp()
    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y_ref = ref(x)
    y = tp(x)
    assert not hasattr(y, "full_tensor"), "RowwiseParallel output should be a plain (replicated) tensor"
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=0, msg=lambda m: f"TP forward: {m}")
    w = torch.randn(5, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    for (n, p), (_, q) in zip(tp.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, q.grad, atol=1e-10, rtol=0, msg=lambda m: f"TP grad of {n}: {m}")
    # One optimizer step on the sharded parameters, then a second forward, still matching
    for m in (tp, ref):
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    torch.testing.assert_close(tp(x), ref(x), atol=1e-10, rtol=0, msg=lambda m: f"TP forward after step: {m}")


SPEC = {
    3: [("redistribute_1d", chk_redistribute_1d, (), None), ("tp_mlp", chk_tp_mlp, (), None),
        ("partial_avg", chk_partial_avg, (), None)],
    4: [("redistribute_1d", chk_redistribute_1d, (), None), ("redistribute_2d", chk_redistribute_2d, (), None),
        ("tp_mlp", chk_tp_mlp, (), None), ("partial_avg", chk_partial_avg, (), None)],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ws,name", _dist.check_params(SPEC))
def test_dtensor(world_cache, ws, name):
    _dist.run_check_item(world_cache, "dtensor", SPEC, ws, name)
