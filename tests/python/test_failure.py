"""Failures on one host end every rank's wait at once, whatever the timeout: a rank killed mid-run (the survivors
find its process gone within T3D_SHM_LIVENESS_MS), and two ranks that call different collectives (the one that sees
the mismatch tells the other through the segment). The errors are asserted word for word: the collective, its
sequence number, the group, the rank, and what went wrong."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta

import pytest

import _dist

TIMEOUT_S = 120.0  # far longer than the test allows: the failures must be found another way


def _rank(rank: int, init: str, world: int, q) -> None:
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
    got = _dist.spawn_reports(_rank, world, (world,), want={0, 1})
    assert set(got) == {0, 1}, f"survivors did not report (hang?): {got}"
    for rank, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {rank}: {what}"
        assert dt < 10, f"rank {rank} took {dt:.1f} s to fail (the group timeout is {TIMEOUT_S} s)"
        # Word for word: the collective, its sequence number (#1 was the warm-up), the group, this rank, and the
        # rank whose process is gone; found by this rank, or by the other survivor, who then told this one. A rank
        # may find it before the other survivor has come (then it waits for that one as well).
        own = re.search(rf"t3d: allreduce #2 on group '0' \(rank {rank} of 3\) lost rank 2: its process \(pid \d+\) "
                        rf"has exited; still waiting for rank\(s\) ({1 - rank}, )?2 \(shared memory\)", msg)
        told = re.search(rf"t3d: allreduce #2 on group '0' \(rank {rank} of 3\) failed: rank {1 - rank} broke the "
                         rf"group: t3d: allreduce #2 on group '0' \(rank {1 - rank} of 3\) lost rank 2: its process", msg)
        assert own or told, f"rank {rank}: unexpected error text: {msg!r}"


def _desync_rank(rank: int, init: str, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401

    dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(16)
    dist.all_reduce(x)  # collective #1
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, src=0)
        q.put((rank, "no error", time.monotonic() - t0, ""))
    except Exception as exc:  # noqa: BLE001
        q.put((rank, "raised", time.monotonic() - t0, str(exc)))
    q.close()
    q.join_thread()
    os._exit(0)


@pytest.mark.skipif(_dist.BACKEND != "t3d", reason="exercises t3d's failure reporting")
@pytest.mark.timeout(120)
def test_desynchronised_collectives_raise_on_every_rank():
    got = _dist.spawn_reports(_desync_rank, 2, (), want={0, 1}, seconds=60)
    assert set(got) == {0, 1}, f"a rank did not report (hang?): {got}"
    calls = {0: "allreduce", 1: "broadcast"}
    # What each side called, as the rank that found the mismatch words it: "rank P runs X #2 (or X of N bytes) where
    # this rank runs Y of N bytes"; the other rank's error quotes it.
    mismatch = re.compile(r"t3d: (allreduce|broadcast) #2 on group '0' \(rank (\d) of 2\): rank (\d) runs "
                          r"(allreduce|broadcast)(?: #2| of 64 bytes \(float32, (?:sum|root 0)\)) where this rank runs "
                          r"(allreduce|broadcast) of 64 bytes(?: \(float32, (?:sum|root 0)\))? \(ranks disagree on the "
                          r"operation")
    for rank, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {rank}: {what}"
        assert dt < 10, f"rank {rank} took {dt:.1f} s to fail (the group timeout is {TIMEOUT_S} s)"
        assert f"t3d: {calls[rank]} #2 on group '0' (rank {rank} of 2)" in msg, f"rank {rank}: {msg!r}"
        m = mismatch.search(msg)
        assert m, f"rank {rank}: the error does not say what each side called: {msg!r}"
        finder, peer = int(m.group(2)), int(m.group(3))
        assert m.group(1) == calls[finder] and m.group(5) == calls[finder] and m.group(4) == calls[peer], msg
