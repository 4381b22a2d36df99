# torch's synchronous calls (opts.asyncOp false, as dist.all_reduce(t) sets it) reach t3d with T3D_FLAG_BLOCKING:
# the collective runs on the calling thread, so the work the backend returns is complete already. Asynchronous ones
# still go to the progress thread: their work is still running when the call returns. That is checked on rank 0
# with rank 1 arriving late (LATE seconds after rank 0), so that rank 0's asynchronous call cannot have finished yet
# however the machine schedules the progress thread (a 12 MiB allreduce alone sometimes finished in time).
import time

import _dist

BIG = 3 << 20  # float32 elements: 12 MiB, past the inline start and a half of the segment
LATE = 0.5


def _calls(rank, ws):
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions

    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    seen = {}

    def late():  # the peers of rank 0 join its asynchronous calls late
        if async_op and rank != 0:
            time.sleep(LATE)

    def record(what, work):
        if not async_op or rank == 0:
            seen[what] = work.is_completed()

    for async_op in (False, True):
        x = torch.full((BIG,), float(rank + 1))
        o = dist.AllreduceOptions()
        o.asyncOp = async_op
        late()
        w = be.allreduce([x], o)
        record(f"allreduce async_op={async_op}", w)
        w.wait()
        assert torch.all(x == ws * (ws + 1) / 2), f"allreduce async_op={async_op}: {x[:4]}"
        b = torch.full((BIG,), float(rank))
        o = dist.BroadcastOptions()
        o.rootRank = ws - 1
        o.asyncOp = async_op
        late()
        w = be.broadcast([b], o)
        if rank == 0:  # a reader: it copies all 12 MiB itself
            record(f"broadcast async_op={async_op}", w)
        w.wait()
        assert torch.all(b == ws - 1), f"broadcast async_op={async_op}"
        g = torch.empty(ws * BIG)
        o = AllgatherOptions()
        o.asyncOp = async_op
        late()
        w = be._allgather_base(g, torch.full((BIG,), float(rank)), o)
        record(f"all_gather_into_tensor async_op={async_op}", w)
        w.wait()
        assert all(torch.all(g[p * BIG:(p + 1) * BIG] == p) for p in range(ws)), "allgather"
    # Through the Python API: dist.all_reduce without async_op is the blocking call.
    y = torch.ones(BIG)
    dist.all_reduce(y)
    assert torch.all(y == ws)
    return seen


def test_synchronous_calls_finish_in_the_call():
    results = _dist.run_world(_calls, 2)
    assert sum("async_op=True" in what for what in results[0]) == 3, results[0]
    for rank, seen in enumerate(results):
        for what, done in seen.items():
            assert done == ("async_op=False" in what), f"rank {rank}: {what}: completed when the call returned: {done}"
