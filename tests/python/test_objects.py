# Object collectives (pickled payloads over uint8 tensors, as DCP uses them) and batched P2P.
import pytest

import _dist


def _objs(rank, salt=0):
    """A per-rank object whose pickled size differs between ranks."""
    import torch
    return {"rank": rank, "salt": salt, "text": "x" * (37 * rank + 5), "list": list(range(rank + salt)),
            "tensor": torch.arange(rank * 3 + 1, dtype=torch.float64) * (salt + 1), "nested": ({"a": (rank,)},)}


def _same(a, b, what):
    import torch
    assert type(a) is type(b), f"{what}: type {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {a} != {b}"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def chk_broadcast_object_list(rank, ws):
    import torch.distributed as dist
    for src in sorted({0, ws - 1}):
        objs = [_objs(src, 1), "tail", 42] if rank == src else [None, None, None]
        dist.broadcast_object_list(objs, src=src)
        _same(objs, [_objs(src, 1), "tail", 42], f"broadcast_object_list src={src} on rank {rank}")


def chk_all_gather_object(rank, ws):
    import torch.distributed as dist
    out = [None] * ws
    dist.all_gather_object(out, _objs(rank, 2))
    _same(out, [_objs(r, 2) for r in range(ws)], f"all_gather_object on rank {rank}")


def chk_gather_object(rank, ws):
    import torch.distributed as dist
    for dst in sorted({0, ws - 1}):
        out = [None] * ws if rank == dst else None
        dist.gather_object(_objs(rank, 3), out, dst=dst)
        if rank == dst:
            _same(out, [_objs(r, 3) for r in range(ws)], f"gather_object dst={dst}")


def chk_scatter_object_list(rank, ws):
    import torch.distributed as dist
    for src in sorted({0, ws - 1}):
        out = [None]
        inp = [_objs(100 + p, 4) for p in range(ws)] if rank == src else None
        dist.scatter_object_list(out, inp, src=src)
        _same(out[0], _objs(100 + rank, 4), f"scatter_object_list src={src} on rank {rank}")


def chk_send_recv_object_list(rank, ws):
    import torch.distributed as dist
    if rank == 0:
        dist.send_object_list([_objs(0, 5), "meta"], dst=ws - 1)
    if rank == ws - 1:
        out = [None, None]
        dist.recv_object_list(out, src=0)
        _same(out, [_objs(0, 5), "meta"], "recv_object_list")


def chk_batch_ring(rank, ws):
    import torch
    import torch.distributed as dist
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    for n in (1, 10, 50000):
        send = torch.arange(n, dtype=torch.float32) + 1000 * rank
        recv = torch.empty(n)
        ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        exp = torch.arange(n, dtype=torch.float32) + 1000 * prv
        assert torch.equal(recv, exp), f"ring n={n}: rank {rank} got {recv[:4].tolist()}, expected from {prv}"
    # Both directions at once, recv posted first
    a, b = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, a, prv), dist.P2POp(dist.irecv, b, nxt),
           dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), nxt),
           dist.P2POp(dist.isend, torch.full((3,), 100 + rank, dtype=torch.int64), prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if ws == 2:   # both neighbours are the same peer: messages arrive in posting order per direction
        assert a.eq(prv).all() and b.eq(100 + nxt).all(), f"two-way exchange: {a.tolist()} {b.tolist()}"
    else:
        assert a.eq(prv).all(), f"from prev {prv}: {a.tolist()}"
        assert b.eq(100 + nxt).all(), f"from next {nxt}: {b.tolist()}"


def chk_batch_pairs(rank, ws):
    import torch
    import torch.distributed as dist
    peer = rank ^ 1
    if peer >= ws:
        return
    ops, bufs = [], []
    for i in range(4):   # several messages to the same peer, of different sizes and dtypes
        dt = [torch.float32, torch.int64, torch.bfloat16, torch.uint8][i]
        ops.append(dist.P2POp(dist.isend, (torch.arange(5 + i) + 10 * rank + i).to(dt), peer))
        bufs.append(torch.empty(5 + i, dtype=dt))
        ops.append(dist.P2POp(dist.irecv, bufs[-1], peer))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for i, b in enumerate(bufs):
        exp = (torch.arange(5 + i) + 10 * peer + i).to(b.dtype)
        assert torch.equal(b, exp), f"pair message {i}: rank {rank} got {b.tolist()} expected {exp.tolist()}"


CHECKS = [("broadcast_object_list", chk_broadcast_object_list, 1), ("all_gather_object", chk_all_gather_object, 1),
          ("gather_object", chk_gather_object, 1), ("scatter_object_list", chk_scatter_object_list, 1),
          ("send_recv_object_list", chk_send_recv_object_list, 2),
          ("batch_isend_irecv_ring", chk_batch_ring, 2), ("batch_isend_irecv_pairs", chk_batch_pairs, 2)]
SPEC = {ws: [(n, fn, (), None if ws >= m else f"needs {m} ranks") for n, fn, m in CHECKS] for ws in (3, 4)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ws,name", _dist.check_params(SPEC))
def test_objects(world_cache, ws, name):
    _dist.run_check_item(world_cache, "objects", SPEC, ws, name)
