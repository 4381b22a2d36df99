# Registered memory from Python (t3d.mem): tensors in t3d memory, and the collectives that read and write the
# peers' tensors in place when every rank's are in it (README, "Registered memory"): results equal those of plain
# tensors for every op of that path, in place and not, and for send/recv; the path ran (the peers' allocations show up mapped in each
# rank); a rank with a plain tensor sends every rank through the shared segment with the same results; bfloat16
# (reduced through a float32 copy) and AVG; and the benchmark's t3d-mem rows and columns.
import pytest

import _dist

pytestmark = pytest.mark.skipif(_dist.is_gloo(), reason="t3d's own memory")

N = (1 << 18) + 37  # float32 elements: 1 MiB and a bit, past T3D_SHM_MAPPED_BYTES, not whole lines per rank


def test_tensors_in_t3d_memory():
    import torch

    import t3d.mem

    x = t3d.mem.empty(3, 5, dtype=torch.bfloat16)
    assert x.shape == (3, 5) and x.dtype == torch.bfloat16 and x.is_contiguous() and t3d.mem.is_registered(x)
    assert x.data_ptr() % 4096 == 0
    assert t3d.mem.is_registered(x[1:]) and t3d.mem.is_registered(x.view(-1)[3:7])
    z = t3d.mem.zeros((4, 4))
    assert z.dtype == torch.get_default_dtype() and torch.count_nonzero(z) == 0
    src = torch.arange(10.0)
    c = t3d.mem.copy_of(src)
    assert torch.equal(c, src) and t3d.mem.is_registered(c) and not t3d.mem.is_registered(src)
    assert t3d.mem.empty_like(src).shape == src.shape
    assert not t3d.mem.is_registered(torch.empty(0)) and not t3d.mem.is_registered(t3d.mem.empty(0))
    with pytest.raises(ValueError, match="negative"):
        t3d.mem.empty(2, -1)
    base = x.data_ptr()
    del x  # the storage's deleter frees the allocation
    assert not t3d._C._mem_owns(base, 1), "the allocation outlived its tensor"


def _mappings():
    with open("/proc/self/maps") as f:
        return sum("t3d-mem" in line for line in f)


def _ops(rank, ws, plain_rank):
    import torch
    import torch.distributed as dist

    import t3d.mem

    def buf(k, dtype=torch.float32):  # t3d memory, except on plain_rank
        return torch.empty(k, dtype=dtype) if rank == plain_rank else t3d.mem.empty(k, dtype=dtype)

    got, want = {}, {}
    x, y, h, g, r, a = buf(N), buf(N), buf(N, torch.bfloat16), buf(N * ws), buf(N * ws), buf(N * ws)
    own = _mappings()  # this rank's allocations; the peers' appear once mapped
    x.copy_(torch.arange(N, dtype=torch.float32) % 11 + rank)
    ref = sum(torch.arange(N, dtype=torch.float32) % 11 + p for p in range(ws))
    dist.all_reduce(x)  # in place
    got["all_reduce in place"], want["all_reduce in place"] = x.clone(), ref
    x.copy_(torch.arange(N, dtype=torch.float32) % 11 + rank)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    got["all_reduce max"], want["all_reduce max"] = x.clone(), torch.arange(N, dtype=torch.float32) % 11 + ws - 1
    x.copy_(torch.arange(N, dtype=torch.float32) % 11 + rank)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    got["all_reduce avg"], want["all_reduce avg"] = x.clone(), ref / ws
    h.fill_(rank + 1)
    dist.all_reduce(h)  # half types go through a float32 copy: not t3d memory, the segment for all
    got["all_reduce bfloat16"], want["all_reduce bfloat16"] = h.float(), torch.full((N,), ws * (ws + 1) / 2)
    y.fill_(rank)
    dist.all_gather_into_tensor(g, y)
    got["all_gather"], want["all_gather"] = g.clone(), torch.arange(ws, dtype=torch.float32).repeat_interleave(N)
    g.view(ws, N)[rank].fill_(rank + 100)
    dist.all_gather_into_tensor(g, g.view(ws, N)[rank])  # in place: the input is the own block of the output
    got["all_gather in place"] = g.clone()
    want["all_gather in place"] = torch.arange(100, 100 + ws, dtype=torch.float32).repeat_interleave(N)
    r.copy_(torch.arange(N * ws, dtype=torch.float32) % 13 * (rank + 1))
    dist.reduce_scatter_tensor(y, r)
    got["reduce_scatter"] = y.clone()
    want["reduce_scatter"] = (torch.arange(N * ws, dtype=torch.float32) % 13).view(ws, N)[rank] * sum(
        range(1, ws + 1))
    a.copy_((torch.arange(ws, dtype=torch.float32) * 10 + rank).repeat_interleave(N))
    dist.all_to_all_single(g, a)
    got["all_to_all"] = g.clone()
    want["all_to_all"] = (torch.arange(ws, dtype=torch.float32) + rank * 10).repeat_interleave(N)
    y.fill_(rank)
    dist.broadcast(y, src=ws - 1)
    got["broadcast"], want["broadcast"] = y.clone(), torch.full((N,), float(ws - 1))
    if plain_rank < 0:  # a ring shift: each receiver maps its sender's tensor (one rendezvous message each)
        y.fill_(rank)
        ops = [dist.P2POp(dist.isend, y, (rank + 1) % ws), dist.P2POp(dist.irecv, x, (rank - 1) % ws)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        got["send/recv"], want["send/recv"] = x.clone(), torch.full((N,), float((rank - 1) % ws))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    return bad, _mappings() - own


@pytest.mark.parametrize("ws", [2, 3])
def test_collectives_on_t3d_memory(ws):
    for rank, (bad, mapped) in enumerate(_dist.run_world(_ops, ws, -1)):
        assert not bad, f"rank {rank}: wrong results of {bad}"
        assert mapped > 0, f"rank {rank} mapped none of its peers' tensors: the collectives took the segment"


def test_a_plain_tensor_on_one_rank_sends_all_through_the_segment():
    for rank, (bad, mapped) in enumerate(_dist.run_world(_ops, 3, 1)):
        assert not bad, f"rank {rank}: wrong results of {bad}"
        assert mapped == 0, f"rank {rank} mapped a peer's tensor although rank 1's are plain"


def test_bench_sets_t3d_memory_rows_apart_from_the_peers():
    from t3d.bench import collectives as bc

    mib64 = 64 << 20
    B_all = 10e9
    floor_us = 2 * 2 * mib64 / B_all * 1e6
    row = lambda us: dict(op="all_reduce", bytes=mib64, time_us=us, wrong=0)  # noqa: E731
    md = bc.render({"_load": 0.0, "_copy_all_cores": B_all, "_cores": 2, "t3d": [row(2 * floor_us)],
                    "t3d-mem": [row(1.25 * floor_us)], "gloo": [row(10 * floor_us)]}, 2, {})
    lines = md.split("## all_reduce\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = dict(zip(head, [c.strip() for c in lines[2].strip("|").split("|")]))
    assert cells["t3d at floor"] == "50%" and cells["t3d-mem at floor"] == "80%"
    assert cells["best peer / t3d"] == "5.00x (gloo)", "t3d-mem is t3d's own variant, no peer"
    assert cells["best peer / t3d-mem"] == "8.00x (gloo)"
    assert "t3d-mem / t3d" not in head and "t3d memory" in md


def _allocator(rank, ws):
    import torch
    import torch.distributed as dist

    import t3d.mem

    small = torch.empty(100)
    before = t3d.mem.allocator_stats()
    t3d.mem.enable_allocator(min_bytes=1 << 20, cache_bytes=64 << 20)
    try:
        x = torch.full((N,), float(rank + 1))  # plain torch: 1 MiB and more, so in t3d memory
        tiny = torch.ones(1000)
        assert t3d.mem.is_registered(x) and not t3d.mem.is_registered(tiny) and not t3d.mem.is_registered(small)
        own = _mappings()
        dist.all_reduce(x)
        assert torch.all(x == ws * (ws + 1) / 2), x[:4]
        mapped = _mappings() - own
        ptr = x.data_ptr()
        del x
        stats = t3d.mem.allocator_stats()
        assert stats["cached_bytes"] >= N * 4 and stats["enabled"], stats
        y = torch.empty(N)  # the freed block again: its pages and the peers' mappings still good
        reused = y.data_ptr() == ptr
        dist.all_reduce(y.fill_(1.0))
        assert torch.all(y == ws)
    finally:
        t3d.mem.disable_allocator()
    z = torch.empty(N)
    assert not t3d.mem.is_registered(z), "disable_allocator() gives torch its allocator back"
    assert t3d.mem.is_registered(y) and torch.all(y == ws), "tensors allocated meanwhile stay valid"
    del y
    t3d.mem.empty_allocator_cache()
    stats = t3d.mem.allocator_stats()
    assert not before["enabled"] and stats["cached_bytes"] == 0 and not stats["enabled"], (before, stats)
    return mapped, reused


def test_allocator_puts_large_plain_tensors_in_t3d_memory():
    for rank, (mapped, reused) in enumerate(_dist.run_world(_allocator, 2)):
        assert mapped > 0, f"rank {rank}: the all_reduce of a plain tensor did not map the peer's"
        assert reused, f"rank {rank}: a freed block of the same size was not reused"


def test_allocator_arguments_are_checked():
    import t3d.mem

    with pytest.raises(ValueError, match="min_bytes"):
        t3d.mem.enable_allocator(min_bytes=0)
    with pytest.raises(ValueError, match="cache_bytes"):
        t3d.mem.enable_allocator(cache_bytes=-1)
    assert not t3d.mem.allocator_stats()["enabled"]


def test_the_environment_turns_the_allocator_on_at_import():
    import os
    import subprocess
    import sys

    code = ("import torch, t3d.mem; x = torch.empty(1 << 20); "
            "print(t3d.mem.is_registered(x), t3d.mem.is_registered(torch.empty(10)))")
    for env, want in (({"T3D_CPU_ALLOCATOR": "1"}, "True False"), ({"T3D_CPU_ALLOCATOR": "0"}, "False False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, **env))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[-2] == want, (env, out.stdout, out.stderr[-1000:])


_FORKED_LOADER = r"""
import torch, t3d.mem
from torch.utils.data import DataLoader, Dataset

table = torch.ones(1 << 20)  # 4 MiB: in t3d memory with the allocator on
assert t3d.mem.is_registered(table)


class InPlace(Dataset):
    # Each item is made in place in the table the worker inherited, as a dataset that normalises a cached tensor
    # would: the worker's own copy, which must not be the parent's.
    def __len__(self):
        return 4

    def __getitem__(self, i):
        table.mul_(3.0)
        return table[:4].clone()


items = list(DataLoader(InPlace(), batch_size=None, num_workers=2, multiprocessing_context="fork"))
print("items", sorted({round(float(x[0])) for x in items}))
print("parent", float(table.min()), float(table.max()), t3d.mem.is_registered(table))
"""


def test_forked_dataloader_workers_write_their_own_copy_of_t3d_memory():
    """torch's DataLoader forks its workers (Linux's default): a worker that writes into a tensor it inherited
    must write its own copy, as with ordinary memory, not the parent's t3d memory (a shared file's pages)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FORKED_LOADER], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, T3D_CPU_ALLOCATOR="1", OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    # Each worker multiplies its own copy: items 3, 9 (two per worker), never 27 or 81 from a shared table.
    assert lines["items"] == "[3, 9]", out.stdout
    assert lines["parent"] == "1.0 1.0 True", out.stdout
