# batch_isend_irecv on host tensors. t3d's backend says it supports coalescing only where the process sees a CUDA
# device (NCCL needs the bracket for device tensors); without one, torch issues each operation on its own, as for
# gloo, which costs less Python per batch. Either way the messages must arrive, in order per pair, and an explicit
# coalescing block of point-to-point must still work.
import _dist


def _batches(rank, ws):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    devices = torch.cuda.is_available() and torch.cuda.device_count() > 0
    assert be.supports_coalescing == devices, (
        f"rank {rank}: supports_coalescing {be.supports_coalescing}, CUDA devices present {devices}")
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    # Four messages each way per peer, mixed sizes (eager, rendezvous, and from 4 MiB through the pair's staging
    # area), receives posted before sends; every element differs, so a chunk out of place shows.
    sizes = (3, 5000, 300_000, 1_100_003)

    def message(src, i, n):
        return torch.arange(n, dtype=torch.float64) + float(10_000_000 * i + 1_000_000 * src)  # exact

    recvs = [torch.empty(n, dtype=torch.float64) for n in sizes]
    ops = [dist.P2POp(dist.irecv, r, prv) for r in recvs]
    ops += [dist.P2POp(dist.isend, message(rank, i, n), nxt) for i, n in enumerate(sizes)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == (1 if devices else len(ops)), f"rank {rank}: {len(works)} works for {len(ops)} operations"
    for w in works:
        w.wait()
    for i, r in enumerate(recvs):
        want = message(prv, i, sizes[i])
        assert torch.equal(r, want), (f"rank {rank}: message {i} from {prv}: first difference at "
                                      f"{int((r != want).nonzero()[0])}")
    # An explicit coalescing block of point-to-point (startCoalescing/endCoalescing) on host tensors.
    got = torch.empty(7)
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.isend(torch.full((7,), float(rank)), nxt)
        dist.irecv(got, prv)
    cm.wait()
    assert torch.all(got == prv), f"rank {rank}: coalesced block got {got.tolist()} from {prv}"
    return len(works)


def test_batch_isend_irecv_host_tensors():
    for ws in (2, 3):
        counts = _dist.run_world(_batches, ws)
        assert len(set(counts)) == 1, counts
