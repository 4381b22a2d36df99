"""A rank killed mid-run: the survivors' collective raises within the group timeout (never hangs), and the error
names the collective, its sequence number, the group, the rank and the rank that did not arrive."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from datetime import timedelta

import pytest

import _dist

TIMEOUT_S = 4.0


def _rank(rank: int, world: int, init: str, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401

    dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(1000)
    dist.all_reduce(x)  # everyone is up and connected
    q.put((rank, "ready", 0.0, ""))
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(3):  # one of these must fail; none may hang
            dist.all_reduce(x)
        q.put((rank, "no error", time.monotonic() - t0, ""))
    except Exception as exc:  # noqa: BLE001
        q.put((rank, "raised", time.monotonic() - t0, f"{type(exc).__name__}: {exc}"))
    q.close()
    q.join_thread()  # flush the report before the hard exit
    os._exit(0)  # the group is broken; skip destroy_process_group


@pytest.mark.skipif(_dist.BACKEND != "t3d", reason="exercises t3d's failure reporting")
@pytest.mark.timeout(120)
def test_killed_rank_makes_survivors_raise():
    world = 3
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "init"), q)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 90
        try:
            while len(got) < world - 1 and time.monotonic() < deadline:
                try:
                    rank, what, dt, msg = q.get(timeout=1)
                except Exception:  # noqa: BLE001
                    continue
                if what != "ready":
                    got[rank] = (what, dt, msg)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert set(got) == {0, 1}, f"survivors did not report (hang?): {got}"
    for rank, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {rank}: {what}"
        assert dt < 2 * TIMEOUT_S + 2, f"rank {rank} took {dt:.1f} s to fail (timeout {TIMEOUT_S} s)"
        # Word for word: the collective, its sequence number (#1 was the warm-up), the group, the rank, the
        # timeout, and the rank that never came.
        want = (f"t3d: allreduce #2 on group '0' (rank {rank} of 3) timed out (timeout {int(TIMEOUT_S * 1000)} ms); "
                f"still waiting for rank(s) 2")
        assert want in msg, f"rank {rank}: expected {want!r} in {msg!r}"
