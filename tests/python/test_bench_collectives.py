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
           "--tag", "smoke", "--timeout", "200", "--repeat", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert set(data["results"]) >= {"t3d", "gloo"}
    assert "nosuch" in data["skipped"], "an unknown peer must be reported by name, not fail the run"
    for backend in ("t3d", "gloo"):
        rows = data["results"][backend]
        assert {r["op"] for r in rows} == {"all_reduce", "all_to_all", "send_recv"}
        assert all(r["wrong"] == 0 and r["time_us"] > 0 and len(r["time_us_runs"]) == 2 for r in rows), rows
    md = (tmp_path / "smoke.md").read_text()
    assert "t3d % of bound" in md and "t3d - floor (us)" in md and "| ok |" in md and "WRONG" not in md
    assert data["results"]["_copy_all_cores"] > 0 and "Copy bandwidth with every core copying at once" in md
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


def _row(op, nbytes, us, **extra):
    return dict(op=op, bytes=nbytes, time_us=us, wrong=0, **extra)


def _verdicts(lines):
    """{target: (verdict, detail)} from the markdown rows targets() returns."""
    cells = [ln.strip("|").split(" | ") for ln in lines if ln.startswith("| ") and not ln.startswith("| target")]
    return {c[0].strip(): (c[1].strip(), c[2].strip()) for c in cells}


def test_targets_are_judged_from_the_rows_of_the_run():
    B = 10e9
    mib64 = 64 << 20
    # 2 ranks: time of a 64 MiB all_reduce at exactly 80% of its bound, then 60%.
    def at(pct):
        return mib64 * bc.bus_factor("all_reduce", 2) / (bc.bound("all_reduce", 2, B) * pct / 100) * 1e6

    res = {"t3d": [_row("all_reduce", mib64, at(80)), _row("all_reduce", 8, 7.0, floor_us=5.5)],
           "mpi": [_row("all_reduce", mib64, at(80) * 1.3), _row("all_reduce", 8, 9.0)]}
    v = _verdicts(bc.targets(res, 2, B, cores=2))
    assert v["all_reduce 64 MiB >= 70% of bound"] == ("met", "80%")
    assert v["all_reduce 64 MiB >= 1.2x the best peer"][0] == "met"
    assert v["all_reduce 8 B-4 KiB: t3d - torch's dispatch floor <= 5 us"][0] == "met"
    assert v["all_reduce 8 B-4 KiB faster than every peer"][0] == "met"
    res["t3d"][0]["time_us"] = at(60)
    res["t3d"][1]["floor_us"] = 1.0
    res["mpi"][1]["time_us"] = 1.5
    v = _verdicts(bc.targets(res, 2, B, cores=2))
    assert v["all_reduce 64 MiB >= 70% of bound"] == ("not met", "60%")
    assert v["all_reduce 64 MiB >= 1.2x the best peer"][0] == "not met"
    assert v["all_reduce 8 B-4 KiB: t3d - torch's dispatch floor <= 5 us"][0] == "not met"
    assert v["all_reduce 8 B-4 KiB faster than every peer"][0] == "not met"
    assert "8 ranks" not in " ".join(v), "the oversubscribed targets are not judged on 2 ranks of 2 cores"


def test_oversubscribed_targets_compare_with_gloo_and_with_the_two_rank_run():
    mib = 1 << 20
    res = {"t3d": [_row("all_reduce", mib, 100.0), _row("all_to_all", mib, 100.0), _row("all_reduce", 8, 50.0)],
           "gloo": [_row("all_reduce", mib, 600.0), _row("all_to_all", mib, 400.0), _row("all_reduce", 8, 900.0)],
           "mpi": [_row("all_reduce", mib, 200.0), _row("all_to_all", mib, 50.0), _row("all_reduce", 8, 30.0)]}
    two = {"t3d": [_row("all_reduce", 8, 4.0)], "mpi": [_row("all_reduce", 8, 2.0)]}
    v = _verdicts(bc.targets(res, 8, 10e9, cores=2, two_rank=two))
    verdict, detail = v["8 ranks on 2 cores: every op >= 5x gloo from 1 MiB"]
    assert verdict == "not met" and "all_to_all 1 MiB 4.00x" in detail and "all_reduce" not in detail
    verdict, detail = v["(yardstick) mpi on the same rows >= 5x gloo"]
    assert verdict == "not met" and "all_reduce 1 MiB 3.00x" in detail and "all_to_all" not in detail
    assert v["8 ranks: small sizes <= 10x the 2-rank time"] == ("not met", "1 of 1 rows miss: all_reduce 8 B 12.5x")
    assert v["(yardstick) mpi: 8 ranks: small sizes <= 10x the 2-rank time"][0] == "not met"
    res["t3d"][1]["time_us"] = 80.0
    res["t3d"][2]["time_us"] = 40.0
    v = _verdicts(bc.targets(res, 8, 10e9, cores=2, two_rank=two))
    assert v["8 ranks on 2 cores: every op >= 5x gloo from 1 MiB"][0] == "met"
    assert v["8 ranks: small sizes <= 10x the 2-rank time"][0] == "met"
    assert _verdicts(bc.targets(res, 8, 10e9, cores=2))["8 ranks: small sizes <= 10x the 2-rank time"][0] == \
        "not measured"


def test_the_switch_floor_is_shown_beside_the_ten_times_target():
    res = {"_load": 0.0, "t3d": [_row("all_reduce", 8, 150.0, floor_us=12.0, switch_floor_us=90.0)],
           "gloo": [_row("all_reduce", 8, 9000.0)]}
    two = {"t3d": [_row("all_reduce", 8, 6.0)]}
    v = _verdicts(bc.targets(res, 8, 10e9, cores=2, two_rank=two))
    verdict, detail = v["8 ranks: small sizes <= 10x the 2-rank time"]
    assert verdict == "not met" and "one switch per call alone takes 15.0-15.0x" in detail
    md = bc.render(res, 8, 10e9, {}, two)
    assert "floor, one switch per call (us)" in md and "| 90.0 |" in md


def test_a_miss_is_set_against_the_fastest_any_implementation_could_be():
    mib = 1 << 20
    res = {"_copy_all_cores": 20e9,
           "t3d": [_row("all_to_all", mib, 100.0), _row("all_to_all", 16 * mib, 12000.0),
                   _row("send_recv", 16 * mib, 25000.0)],
           "gloo": [_row("all_to_all", mib, 400.0), _row("all_to_all", 16 * mib, 37000.0),
                    _row("send_recv", 16 * mib, 100000.0)]}
    # all_to_all 16 MiB, 8 ranks: at least 2n * S = 256 MiB read + written, 13.4 ms at 20 GB/s: gloo / 5 is 7.4 ms.
    assert bc.fastest_possible_us("all_to_all", 8, 16 * mib, 20e9, cores=2) == pytest.approx(16 * 16 * mib / 20e3)
    # 1 MiB: 16 MiB of buffers, less than the copy test's 256 MiB on 2 cores, where caches may beat its bandwidth.
    assert bc.fastest_possible_us("all_to_all", 8, mib, 20e9, cores=2) is None
    verdict, detail = _verdicts(bc.targets(res, 8, 10e9, cores=2))["8 ranks on 2 cores: every op >= 5x gloo from 1 MiB"]
    assert verdict == "not met"
    missed, beyond = detail.split("Beyond any implementation")
    assert "all_to_all 1 MiB 4.00x" in missed and "send_recv 16 MiB 4.00x" in missed
    assert "all_to_all 16 MiB (gloo 37000 us" in beyond and "at most 2.76x" in beyond
    assert "1 MiB" not in beyond, "no floor where caches may hold the buffers"
    assert "send_recv" not in beyond, "send_recv 16 MiB could reach 5x gloo here: 7.45x at most"
    del res["_copy_all_cores"]
    assert "Beyond" not in _verdicts(bc.targets(res, 8, 10e9, cores=2))[
        "8 ranks on 2 cores: every op >= 5x gloo from 1 MiB"][1], "runs without the measurement make no such claim"



def test_repeated_runs_report_each_rows_median_and_any_wrong_result():
    runs = [[_row("all_reduce", 8, 10.0, floor_us=5.0), _row("broadcast", 8, 3.0)],
            [_row("all_reduce", 8, 90.0, floor_us=6.0), _row("broadcast", 8, 4.0)],
            [_row("all_reduce", 8, 12.0, floor_us=4.0), dict(_row("broadcast", 8, 5.0), wrong=1)]]
    ar, bc_row = bc.median_rows(runs)
    assert ar["time_us"] == 12.0 and ar["floor_us"] == 5.0, "one slow run moves one sample, not the row"
    assert ar["time_us_runs"] == [10.0, 90.0, 12.0] and ar["wrong"] == 0
    assert bc_row["time_us"] == 4.0 and bc_row["wrong"] == 1, "a wrong result in any run marks the row"
    assert bc.median_rows(runs[:1]) == runs[0]
    md = bc.render({"_load": 0.0, "_repeat": 3, "t3d": [ar, bc_row]}, 2, 10e9, {})
    assert "ran 3 times" in md and "WRONG" in md
