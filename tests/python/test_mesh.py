# Subgroups (new_group, overlapping, unordered ranks) and a 3-D DeviceMesh (dp, tp, cp) on 8 ranks with slicing and
# flattening, each group's collectives checked by value against the group membership computed here.
import pytest

import _dist


def _group_checks(group, ranks, rank, tag):
    """Collectives on `group` whose members, in group-rank order, are `ranks` (global)."""
    import torch
    import torch.distributed as dist
    assert dist.get_process_group_ranks(group) == list(ranks), \
        f"{tag}: get_process_group_ranks {dist.get_process_group_ranks(group)} != {list(ranks)}"
    g = len(ranks)
    assert dist.get_world_size(group) == g, f"{tag}: get_world_size {dist.get_world_size(group)} != {g}"
    me = ranks.index(rank)
    assert dist.get_rank(group) == me, f"{tag}: get_rank {dist.get_rank(group)} != {me}"
    val = lambda r: torch.arange(6, dtype=torch.float32) + 100 * r   # noqa: E731
    t = val(rank)
    dist.all_reduce(t, group=group)
    exp = sum(val(r) for r in ranks)
    assert torch.equal(t, exp), f"{tag}: all_reduce {t.tolist()} != {exp.tolist()}"
    t = val(rank)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    assert torch.equal(t, val(max(ranks))), f"{tag}: all_reduce MAX {t.tolist()}"
    out = torch.empty(g * 6)
    dist.all_gather_into_tensor(out, val(rank), group=group)
    exp = torch.cat([val(r) for r in ranks])
    assert torch.equal(out, exp), f"{tag}: all_gather_into_tensor order {out[::6].tolist()} != {exp[::6].tolist()}"
    for src_g in sorted({0, g - 1}):
        b = val(rank)
        dist.broadcast(b, group=group, group_src=src_g)
        assert torch.equal(b, val(ranks[src_g])), f"{tag}: broadcast group_src={src_g} got {b.tolist()}"
    inp = torch.cat([val(rank) + 10 * j for j in range(g)])
    rs = torch.empty(6)
    dist.reduce_scatter_tensor(rs, inp, group=group)
    exp = sum(val(r) + 10 * me for r in ranks)
    assert torch.equal(rs, exp), f"{tag}: reduce_scatter_tensor {rs.tolist()} != {exp.tolist()}"
    a2a = torch.empty(g * 2)
    dist.all_to_all_single(a2a, torch.arange(g * 2, dtype=torch.float32) + 1000 * rank, group=group)
    exp = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 1000 * r for r in ranks])
    assert torch.equal(a2a, exp), f"{tag}: all_to_all_single {a2a.tolist()} != {exp.tolist()}"
    if g > 1:   # P2P inside the group, addressed by group rank
        nxt, prv = (me + 1) % g, (me - 1) % g
        recv = torch.empty(3)
        reqs = [dist.isend(torch.full((3,), float(rank)), group=group, group_dst=nxt),
                dist.irecv(recv, group=group, group_src=prv)]
        for w in reqs:
            w.wait()
        assert recv.eq(ranks[prv]).all(), f"{tag}: P2P from group rank {prv} got {recv.tolist()}"
    dist.barrier(group=group)


def chk_new_group(rank, ws):
    import torch.distributed as dist
    layouts = [[0, 1], [2, 3], [1, 2, 3], [3, 1], [0, 1, 2, 3]]   # disjoint, overlapping, unordered, all
    groups = [dist.new_group(ranks) for ranks in layouts]   # every rank creates every group, in the same order
    for ranks, g in zip(layouts, groups):
        if rank in ranks:
            # new_group keeps the ranks sorted: group rank i is the i-th smallest member
            _group_checks(g, sorted(ranks), rank, f"new_group({ranks})")
    # Interleaved use of overlapping groups, async
    import torch
    a, b = torch.ones(2) * (rank + 1), torch.ones(2) * (rank + 1)
    works = []
    if rank in (1, 2, 3):
        works.append(dist.all_reduce(a, group=groups[2], async_op=True))
    if rank in (0, 1):
        works.append(dist.all_reduce(b, group=groups[0], async_op=True))
    for w in works:
        w.wait()
    if rank in (1, 2, 3):
        assert a.eq(2 + 3 + 4).all(), f"overlapping async all_reduce on [1,2,3]: {a.tolist()}"
    if rank in (0, 1):
        assert b.eq(1 + 2).all(), f"overlapping async all_reduce on [0,1]: {b.tolist()}"


def chk_new_subgroups(rank, ws):
    import torch.distributed as dist
    cur, groups = dist.new_subgroups(group_size=2)
    mine = [2 * (rank // 2), 2 * (rank // 2) + 1]
    _group_checks(cur, mine, rank, "new_subgroups(group_size=2)")
    cur, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
    _group_checks(cur, [0, 3] if rank in (0, 3) else [1, 2], rank, "new_subgroups_by_enumeration")


def chk_mesh_3d(rank, ws):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "cp"))
    grid = torch.arange(8).view(2, 2, 2)
    d, t, c = [int(x) for x in (grid == rank).nonzero()[0]]
    expect = {
        "dp": grid[:, t, c].tolist(),
        "tp": grid[d, :, c].tolist(),
        "cp": grid[d, t, :].tolist(),
    }
    for dim, ranks in expect.items():
        sub = mesh[dim]
        assert sub.mesh.flatten().tolist() == ranks, f"mesh[{dim!r}].mesh {sub.mesh.tolist()} != {ranks}"
        _group_checks(sub.get_group(), ranks, rank, f"mesh[{dim!r}]")
        assert mesh.get_local_rank(dim) == ranks.index(rank), f"get_local_rank({dim!r})"
    dp_cp = mesh["dp", "cp"]
    assert dp_cp.mesh.tolist() == grid[:, t, :].tolist(), f"mesh['dp','cp'] {dp_cp.mesh.tolist()}"
    flat = dp_cp._flatten("dp_cp")
    ranks = grid[:, t, :].flatten().tolist()
    assert flat.mesh.flatten().tolist() == ranks, f"_flatten('dp_cp') {flat.mesh.tolist()} != {ranks}"
    _group_checks(flat.get_group(), ranks, rank, "dp_cp (flattened)")
    _group_checks(mesh["dp_cp"].get_group(), ranks, rank, "mesh['dp_cp'] after _flatten")
    tp_cp = mesh["tp", "cp"]
    for i, dim in enumerate(("tp", "cp")):
        _group_checks(tp_cp.get_group(i), expect[dim], rank, f"mesh['tp','cp'].get_group({i})")
    _group_checks(mesh.get_group("cp"), expect["cp"], rank, "mesh.get_group('cp')")


def chk_world8_basics(rank, ws):
    import torch
    import torch.distributed as dist
    _group_checks(dist.group.WORLD, list(range(ws)), rank, "WORLD of 8")
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    assert t.eq(40320).all(), f"PRODUCT over 8 ranks {t.tolist()}"


SPEC = {
    4: [("new_group", chk_new_group, (), None), ("new_subgroups", chk_new_subgroups, (), None)],
    8: [("world8_basics", chk_world8_basics, (), None), ("device_mesh_3d", chk_mesh_3d, (), None)],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ws,name", _dist.check_params(SPEC))
def test_mesh(world_cache, ws, name):
    _dist.run_check_item(world_cache, "mesh", SPEC, ws, name, idle=90.0)
