# `t3d-bench collectives` end to end on 2 ranks (two small sizes only, 8 and 32 B: the numbers are not checked, the
# report is, and each of gloo's rows takes most of a second on 2 cores), and its tables (the floor, the best peer,
# the dispatch floors) rendered from synthetic rows.
import json
import os
import subprocess
import sys

import pytest

from t3d.bench import collectives as bc


@pytest.mark.timeout(240)
def test_bench_runs_t3d_and_gloo_side_by_side(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "t3d.bench", "collectives", "--nproc", "2", "--backends", "t3d,gloo,nosuch",
           "--ops", "all_reduce,all_to_all,send_recv", "--min", "8", "--max", "32", "--out", str(tmp_path),
           "--tag", "smoke", "--timeout", "200", "--repeat", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert set(data["results"]) >= {"t3d", "gloo"}
    assert "nosuch" in data["skipped"], "an unknown peer must be reported by name, not fail the run"
    for backend in ("t3d", "gloo"):
        rows = data["results"][backend]
        assert sorted((r["op"], r["bytes"]) for r in rows) == [
            (op, n) for op in ("all_reduce", "all_to_all", "send_recv") for n in (8, 32)], rows
        assert all(r["wrong"] == 0 and r["time_us"] > 0 and len(r["time_us_runs"]) == 2 for r in rows), rows
    md = (tmp_path / "smoke.md").read_text()
    assert "t3d at floor" in md and "best peer / t3d" in md and "t3d - dispatch floor (us)" in md
    assert "| ok |" in md and "WRONG" not in md
    assert data["results"]["_copy_all_cores"] > 0 and "B_all = " in md and data["results"]["_cores"] >= 1
    # the copy bandwidth is probed at the start and after each of the 2 x 2 backend runs
    probes = data["results"]["_copy_all_cores_runs"]
    assert len(probes) == 5 and data["results"]["_copy_all_cores"] == max(probes), probes
    assert set(data["results"]["_copy_beside"]) == {"t3d", "gloo"}, data["results"]["_copy_beside"]
    assert (tmp_path / "smoke.png").stat().st_size > 0


class _Peers:
    """A stand-in for torch.distributed as seen by one rank of 2: all_reduce adds the other rank's input (2.0 in a
    checked call, -0.0 in a timed one, which holds -0.0 on every rank), broadcast delivers the root's 7.0; calls are
    counted, `broken` makes every op a no-op, and `plus_zero` sums from +0.0 (right values, but a timed loop whose
    -0.0 turns into +0.0 would move all-zero bytes)."""

    class group:
        WORLD = object()

    def __init__(self, broken=False, plus_zero=False):
        self.broken, self.plus_zero, self.calls = broken, plus_zero, 0

    def all_reduce(self, x, group=None):
        import torch

        self.calls, self.last = self.calls + 1, x
        if self.broken:
            return
        other = -0.0 if bool(torch.signbit(x).all()) and not bool(x.any()) else 2.0
        if self.plus_zero:
            x.copy_(torch.zeros_like(x) + x + other)
        else:
            x.add_(other)

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


def test_all_reduce_times_nonzero_bytes_and_the_check_sees_them_kept():
    import torch

    peers = _Peers()
    run, check, _ = bc._make_op("all_reduce", 4096, 0, 2, peers, torch)
    run()
    assert check(), "a sum that keeps -0.0 passes"
    run()
    x = peers.last
    assert bool(torch.signbit(x).all()) and not bool(x.any()), "the timed data is -0.0 in every element"
    assert x.view(torch.int32).ne(0).all(), "whose bytes are not zero"
    run, check, _ = bc._make_op("all_reduce", 4096, 0, 2, _Peers(plus_zero=True), torch)
    run()
    assert not check(), "a timed loop whose data became +0.0 (all-zero bytes) must fail the row"


def _row(op, nbytes, us, **extra):
    return dict(op=op, bytes=nbytes, time_us=us, wrong=0, **extra)


def _table(md, op):
    """{size: {column: cell}} of one op's table in render()'s markdown."""
    lines = md.split(f"## {op}\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return {r[0]: dict(zip(head, r)) for r in rows}


def test_rows_are_set_against_the_floor_and_the_best_peer():
    mib64 = 64 << 20
    B_all = 10e9
    floor_us = 2 * 2 * mib64 / B_all * 1e6  # all_reduce, 2 ranks: 2n * S read + written at B_all
    # the 2 x 64 MiB of buffers are beyond one copy test (64 MiB), so beyond the caches
    res = {"_load": 0.0, "_copy_all_cores": B_all, "_cores": 1,
           "t3d": [_row("all_reduce", mib64, 2 * floor_us, floor_us=50.0), _row("all_reduce", 8, 5.0, floor_us=4.0)],
           "gloo": [_row("all_reduce", mib64, 8 * floor_us), _row("all_reduce", 8, 400.0)],
           "mpi": [_row("all_reduce", mib64, 2.7 * floor_us), _row("all_reduce", 8, 1.0)]}
    assert bc.fastest_possible_us("all_reduce", 2, mib64, B_all) == pytest.approx(floor_us)
    md = bc.render(res, 2, {})
    rows = _table(md, "all_reduce")
    big, small = rows["64 MiB"], rows["8 B"]
    assert big["floor (us)"] == f"{floor_us:.0f}" and big["t3d at floor"] == "50%"
    assert big["gloo / t3d"] == "4.00x" and big["mpi / t3d"] == "1.35x" and big["best peer / t3d"] == "1.35x (mpi)"
    assert small["floor (us)"] == "-" and small["t3d at floor"] == "-", "no floor where caches may hold the buffers"
    assert small["best peer / t3d"] == "0.20x (mpi)"
    assert small["torch dispatch floor (us)"] == "4.0" and small["t3d - dispatch floor (us)"] == "1.0"
    assert "B_all = 10.0 GB/s" in md
    assert not [ln for ln in md.splitlines() if "bound" in ln.lower() or "issue" in ln.lower()]
    # a saved run without the all-core copy bandwidth renders, without a floor
    del res["_copy_all_cores"], res["_cores"]
    md = bc.render(res, 2, {})
    assert _table(md, "all_reduce")["64 MiB"]["floor (us)"] == "-" and "did not measure" in md


def test_mpi_pages_are_named_only_where_the_run_recorded_them():
    res = {"_load": 0.0, "t3d": [_row("all_reduce", 8, 5.0)], "mpi": [_row("all_reduce", 8, 1.0)]}
    assert "ordinary pages" not in bc.render(res, 2, {}), "runs saved before the peer's plain pages say nothing"
    res["_mpi_pages"] = "plain"
    assert "mpi: Open MPI through mpi4py, on numpy buffers on ordinary pages" in bc.render(res, 2, {})


def test_each_backend_is_set_against_the_bandwidth_beside_its_own_runs():
    mib64 = 64 << 20
    floor_us = 2 * 2 * mib64 / 20e9 * 1e6  # all_reduce, 2 ranks, at the run's best probe (20 GB/s)
    res = {"_load": 0.0, "_copy_all_cores": 20e9, "_copy_all_cores_runs": [20e9, 10e9, 20e9], "_cores": 2,
           "_copy_beside": {"t3d": 10e9, "t3d-mem": 20e9},
           "t3d": [_row("all_reduce", mib64, 4 * floor_us)], "t3d-mem": [_row("all_reduce", mib64, 1.25 * floor_us)]}
    md = bc.render(res, 2, {})
    row = _table(md, "all_reduce")["64 MiB"]
    assert row["floor (us)"] == f"{floor_us:.0f}", "the floor column: the least time, at the best probe"
    # t3d ran while the machine copied at 10 GB/s: its floor then was twice as long, so 2 / 4 = 50%
    assert row["t3d at floor"] == "50%" and row["t3d-mem at floor"] == "80%", row
    assert "t3d 10.0, t3d-mem 20.0 GB/s" in md and "20.0, 10.0, 20.0 GB/s" in md, md


def test_each_run_is_set_against_the_bandwidth_beside_it():
    mib64 = 64 << 20

    def floor(B):  # all_reduce, 2 ranks
        return 2 * 2 * mib64 / B * 1e6

    # three runs of t3d; the probes (start, after each run) jump from 10 to 20 GB/s after the first run
    times = [floor(10e9) / 0.9, floor(20e9) / 0.5, floor(20e9) / 0.7]
    row = dict(_row("all_reduce", mib64, sorted(times)[1]), time_us_runs=times)
    res = {"_load": 0.0, "_copy_all_cores": 20e9, "_copy_all_cores_runs": [10e9, 10e9, 20e9, 20e9], "_cores": 2,
           "_repeat": 3, "_copy_beside": {"t3d": 20e9}, "t3d": [row]}
    assert bc.beside_runs(res) == {"t3d": [10e9, 20e9, 20e9]}, "rebuilt from the probes of a run saved without it"
    # each run against its own bandwidth: 90%, 50%, 70%, median 70% (the median time, twice the floor at 20 GB/s,
    # against the median bandwidth would give 50%)
    assert _table(bc.render(res, 2, {}), "all_reduce")["64 MiB"]["t3d at floor"] == "70%"
    res["_copy_beside_runs"] = {"t3d": [10e9, 10e9, 10e9]}  # 90%, 100%, 140%
    assert _table(bc.render(res, 2, {}), "all_reduce")["64 MiB"]["t3d at floor"] == "100%", "the saved list wins"
    res.pop("_copy_beside_runs")
    res["_copy_all_cores_runs"] = [10e9, 20e9]  # does not add up to the runs: the medians, as before
    assert _table(bc.render(res, 2, {}), "all_reduce")["64 MiB"]["t3d at floor"] == "50%"


def test_the_switch_floor_has_its_own_column():
    res = {"_load": 0.0, "t3d": [_row("all_reduce", 8, 150.0, floor_us=12.0, switch_floor_us=90.0)],
           "gloo": [_row("all_reduce", 8, 9000.0)]}
    row = _table(bc.render(res, 8, {}), "all_reduce")["8 B"]
    assert row["dispatch floor, one switch per call (us)"] == "90.0" and row["best peer / t3d"] == "60.00x (gloo)"


def test_a_floor_needs_buffers_beyond_the_caches():
    mib = 1 << 20
    # all_to_all 16 MiB, 8 ranks: at least 2n * S = 256 MiB read + written, 13.4 ms at 20 GB/s.
    assert bc.fastest_possible_us("all_to_all", 8, 16 * mib, 20e9) == pytest.approx(16 * 16 * mib / 20e3)
    # all_reduce 64 MiB, 2 ranks: 128 MiB of buffers (in place), beyond one copy test's 64 MiB: 4S at 20 GB/s.
    assert bc.fastest_possible_us("all_reduce", 2, 64 * mib, 20e9) == pytest.approx(4 * 64 * mib / 20e3)
    # 1 MiB: 16 MiB of buffers, less than one copy test's 64 MiB, where caches may beat its bandwidth.
    assert bc.fastest_possible_us("all_to_all", 8, mib, 20e9) is None


def test_repeated_runs_report_each_rows_median_and_any_wrong_result():
    runs = [[_row("all_reduce", 8, 10.0, floor_us=5.0), _row("broadcast", 8, 3.0)],
            [_row("all_reduce", 8, 90.0, floor_us=6.0), _row("broadcast", 8, 4.0)],
            [_row("all_reduce", 8, 12.0, floor_us=4.0), dict(_row("broadcast", 8, 5.0), wrong=1)]]
    ar, bc_row = bc.median_rows(runs)
    assert ar["time_us"] == 12.0 and ar["floor_us"] == 5.0, "one slow run moves one sample, not the row"
    assert ar["time_us_runs"] == [10.0, 90.0, 12.0] and ar["wrong"] == 0
    assert bc_row["time_us"] == 4.0 and bc_row["wrong"] == 1, "a wrong result in any run marks the row"
    assert bc.median_rows(runs[:1]) == runs[0]
    md = bc.render({"_load": 0.0, "_repeat": 3, "t3d": [ar, bc_row]}, 2, {})
    assert "ran 3 times" in md and "WRONG" in md


# --device cuda: where no GPU is, both benchmarks refuse in one line naming why; the CUDA tables render from rows.
def _no_gpu():
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_no_gpu(), reason="a GPU is present: the refusal is for machines without one")
@pytest.mark.parametrize("bench,stream", [("collectives", "stderr"), ("attention", "stdout")])
def test_cuda_mode_refuses_in_one_line_without_a_gpu(bench, stream):
    import torch

    proc = subprocess.run([sys.executable, "-m", "t3d.bench", bench, "--device", "cuda"], capture_output=True,
                          text=True, timeout=120)
    out = getattr(proc, stream).strip()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert out == (f"t3d-bench {bench}: --device cuda needs a CUDA device; torch {torch.__version__} sees none "
                   f"(torch.cuda.is_available() is False)"), out


def test_cuda_collectives_share_a_gpu_only_on_t3d(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bc.cuda_refusal(1, "t3d,nccl") is None
    assert bc.cuda_refusal(2, "t3d") is None  # t3d alone stages ranks that share the GPU
    assert bc.cuda_refusal(2, "t3d,nccl") == (
        "t3d-bench collectives: --device cuda with --nproc 2 on 1 GPU(s) puts ranks on a shared GPU, which nccl "
        "refuse(s); t3d stages such groups through host memory: --backends t3d")


def test_cuda_collective_rows_render_without_a_floor():
    rows = [{"op": "all_reduce", "bytes": 1 << 20, "time_us": 50.0, "wrong": 0}]
    md = bc.render({"_load": 0.1, "_cores": 16, "_device": "2 x NVIDIA H100", "t3d": rows,
                    "nccl": [dict(rows[0], time_us=40.0)]}, 2, {})
    assert "Device: CUDA tensors, one GPU per rank (2 x NVIDIA H100)" in md, md
    assert "| 1 MiB | 50.0 | 20.972 | 40.0 | 26.214 | 0.80x | 0.80x (nccl) | - | - | ok |" in md, md


def test_cuda_attention_table_and_peak():
    from t3d.bench import attention_cuda as ac

    assert ac.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and ac.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert ac.peak_tflops("NVIDIA H200") == 989.4 and ac.peak_tflops("Some GPU") is None
    cfgs = ac.configs(quick=True)
    assert {(c["dtype"], c["head_dim"], c["seq"]) for c in cfgs} == {
        (t, d, s) for t in ("bfloat16", "float16") for d, s in ((64, 1024), (128, 1024), (128, 4096))}
    row = dict(next(c for c in cfgs if c["head_dim"] == 128), results={"t3d": {"fwd_ms": 2.0, "fwdbwd_ms": 7.0, "fwd_tflops": 494.7, "fwdbwd_tflops": 400.0},
                                 "flash": {"fwd_ms": 1.0, "fwdbwd_ms": 3.5, "fwd_tflops": 989.4,
                                           "fwdbwd_tflops": 800.0},
                                 "efficient": {"error": "No available kernel"}, "max_abs_diff": 0.0039})
    md = ac.render({"gpu": "NVIDIA H200", "peak_tflops": 989.4, "torch": "2.11", "cuda": "13.0", "quick": True,
                    "date": "d"}, [row])
    assert "| bfloat16 | yes | 1024 | 4x16 | 128 | t3d | 2.00 | 494.70 (50%) | 7.00 | 400.00 |" in md, md
    assert "| bfloat16 | yes | 1024 | 4x16 | 128 | flash | 1.00 | 989.40 | 3.50 | 800.00 |" in md, md
    assert "| efficient | refused: No available kernel |" in md, md
    assert "t3d vs SDPA: max abs diff 3.9e-03" in md, md


def test_attention_plot_is_written_from_rows(tmp_path):
    from t3d.bench import attention as ba

    rows = [dict(dtype="float32", causal=True, seq=512, heads=4, kv_heads=4, head_dim=64, fwd_ratio=1.2,
                 fwdbwd_ratio=0.9),
            dict(dtype="bfloat16", causal=True, seq=1024, heads=4, kv_heads=1, head_dim=128, fwd_ratio=2.0,
                 fwdbwd_ratio=2.5)]
    path = ba._plot(rows, tmp_path / "attention.png")
    assert path == tmp_path / "attention.png" and path.stat().st_size > 1000
