"""Which timeout an operation gets under torch, and what its error says, exactly.

Precedence (README.md, "Timeouts"): a timeout given to one call (the c10d options' `timeout`) > T3D_TIMEOUT_MS when
set > the group timeout torch hands over (init_process_group's `timeout`, 30 minutes by default). Each case runs two
ranks where rank 1 never joins the second all_reduce, and checks that rank 0's error comes after the expected
timeout (not much later) and reads, word for word,
`t3d: allreduce #<seq> on group '<group>' (rank 0 of 2) timed out (timeout <ms> ms); still waiting for rank(s) 1`.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import pytest

import _dist

ERROR = re.compile(r"t3d: allreduce #(\d+) on group '([^']+)' \(rank 0 of 2\) timed out \(timeout (\d+) ms\); "
                   r"still waiting for rank\(s\) 1(?:\s|$)")


def _rank(rank: int, init: str, env: dict, group_timeout_s: float | None, call_timeout_ms: int | None,
          q) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401

    kw = {} if group_timeout_s is None else {"timeout": timedelta(seconds=group_timeout_s)}
    dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=2, **kw)
    x = torch.ones(16)
    dist.all_reduce(x)  # both up: collective #1
    if rank == 1:
        q.put((rank, "idle", 0.0, ""))
        time.sleep(60)  # never joins #2; the parent ends this process
        os._exit(0)
    t0 = time.monotonic()
    try:
        if call_timeout_ms is None:
            dist.all_reduce(x)
        else:
            opts = dist.AllreduceOptions()
            opts.timeout = timedelta(milliseconds=call_timeout_ms)
            dist.group.WORLD.allreduce([x], opts).wait()
        q.put((rank, "no error", time.monotonic() - t0, ""))
    except Exception as exc:  # noqa: BLE001
        q.put((rank, "raised", time.monotonic() - t0, str(exc)))
    q.close()
    q.join_thread()
    os._exit(0)


def _run(env: dict, group_timeout_s: float | None, call_timeout_ms: int | None) -> tuple[str, float, str]:
    got = _dist.spawn_reports(_rank, 2, (env, group_timeout_s, call_timeout_ms), want={0})
    assert 0 in got, "rank 0 did not report within 90 s (a hang?)"
    return got[0]


CASES = {
    # name: (T3D_TIMEOUT_MS or None, group timeout in s or None (torch's default), per-call ms or None, expected ms)
    "group timeout": (None, 2.0, None, 2000),
    "T3D_TIMEOUT_MS over torch's default": ("1500", None, None, 1500),
    "T3D_TIMEOUT_MS over an explicit group timeout": ("1500", 600.0, None, 1500),
    "per-call timeout over both": ("5000", 600.0, 700, 700),
}


@pytest.mark.skipif(_dist.BACKEND != "t3d", reason="t3d's timeouts")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(CASES))
def test_timeout_precedence_and_message(case):
    env_ms, group_s, call_ms, want_ms = CASES[case]
    env = {} if env_ms is None else {"T3D_TIMEOUT_MS": env_ms}
    what, dt, msg = _run(env, group_s, call_ms)
    assert what == "raised", f"{case}: {what}"
    m = ERROR.search(msg)
    assert m, f"{case}: unexpected error text: {msg!r}"
    seq, group, ms = int(m.group(1)), m.group(2), int(m.group(3))
    assert seq == 2, f"{case}: the second collective of the group is #2, not #{seq}: {msg}"
    assert group == "0", f"{case}: the default group's name is '0', not '{group}': {msg}"
    assert ms == want_ms, f"{case}: timeout {ms} ms, expected {want_ms} ms: {msg}"
    assert want_ms / 1000 - 0.05 <= dt < want_ms / 1000 + 5, f"{case}: raised after {dt:.2f} s (timeout {want_ms} ms)"
