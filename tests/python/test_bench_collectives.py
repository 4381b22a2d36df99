# `t3d-bench collectives` end to end on 2 ranks (small sizes only: the numbers are not checked, the report is), and
# the bounds it prints against the values derived in docs/benchmarks/README.md.
import json
import os
import subprocess
import sys

import pytest

from t3d.bench import collectives as bc


@pytest.mark.parametrize("n,expect", [
    (2, {"all_reduce": 7, "all_gather": 12, "reduce_scatter": 10, "all_to_all": 12, "broadcast": 4, "send_recv": 8}),
    (8, {"all_reduce": 25 / 1.75, "all_gather": 18 / 0.875, "reduce_scatter": 23 / 0.875, "all_to_all": 30 / 0.875,
         "broadcast": 16, "send_recv": 32}),
])
def test_bounds_match_the_documented_derivation(n, expect):
    B = 1.0
    for op, k in expect.items():
        assert bc.bound(op, n, B) == pytest.approx(1.0 / k), op
    assert bc.allreduce_bound(n, B) == pytest.approx(2 * (n - 1) / n / (3 * n + 1))


@pytest.mark.timeout(240)
def test_bench_runs_t3d_and_gloo_side_by_side(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "t3d.bench", "collectives", "--nproc", "2", "--backends", "t3d,gloo,nosuch",
           "--ops", "all_reduce,all_to_all,send_recv", "--min", "8", "--max", "2K", "--out", str(tmp_path),
           "--tag", "smoke", "--timeout", "200"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert set(data["results"]) >= {"t3d", "gloo"}
    assert "nosuch" in data["skipped"], "an unknown peer must be reported by name, not fail the run"
    for backend in ("t3d", "gloo"):
        rows = data["results"][backend]
        assert {r["op"] for r in rows} == {"all_reduce", "all_to_all", "send_recv"}
        assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), rows
    md = (tmp_path / "smoke.md").read_text()
    assert "t3d % of bound" in md and "t3d - floor (us)" in md and "| ok |" in md and "WRONG" not in md
    assert (tmp_path / "smoke.png").stat().st_size > 0


class _Peers:
    """A stand-in for torch.distributed as seen by one rank of 2: all_reduce adds the other rank's 2.0, broadcast
    delivers the root's 7.0; calls are counted, and `broken` makes every op a no-op."""

    class group:
        WORLD = object()

    def __init__(self, broken=False):
        self.broken, self.calls = broken, 0

    def all_reduce(self, x, group=None):
        self.calls += 1
        if not self.broken:
            x.add_(2.0)

    def broadcast(self, x, src=0):
        self.calls += 1
        if not self.broken:
            x.fill_(7.0)


@pytest.mark.parametrize("op,rank", [("all_reduce", 0), ("broadcast", 1)])
def test_timed_call_only_communicates_and_the_check_catches_a_broken_op(op, rank):
    import torch

    peers = _Peers()
    run, check, size = bc._make_op(op, 64, rank, 2, peers, torch)
    assert size == 64
    assert check(), "a correct op must pass its check"
    calls = peers.calls
    run()
    assert peers.calls == calls + 1, "the timed callable is one call of the op, nothing else"
    _, broken_check, _ = bc._make_op(op, 64, rank, 2, _Peers(broken=True), torch)
    assert not broken_check(), f"a {op} that does nothing must fail the check"
