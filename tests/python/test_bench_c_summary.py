"""scripts/bench_c_summary.py: medians over runs of the C benches, and --same-placement keeps, per operation, only
the runs in which t3d and Open MPI had the same placement (synthetic bench files; the benches themselves run in
ctest: bench_c_check, bench_c_placement)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bcs():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    spec = importlib.util.spec_from_file_location("bench_c_summary", os.path.join(ROOT, "scripts", "bench_c_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _file(path, column, placement_ns, us):
    """A bench's allreduce section (8 B and 1 KiB rows), as both benches print it."""
    lines = ["# allreduce, 2 ranks, float32 sum; time = slowest rank's mean per call"]
    if placement_ns is not None:
        lines.append(f"# placement: a cache line's round trip between ranks 0 and 1 takes {placement_ns} ns")
    lines.append(f"#      size(B)        count   type redop | {column}   time(us)    algbw    busbw #wrong")
    for size, t in zip((8, 1024), us):
        lines.append(f"  {size:12d} {size // 4:12d}  float   sum | {column:<4} {t:10.2f}    0.100    0.100      0")
    path.write_text("\n".join(lines) + "\n")


def _run(tmp_path, name, t3d_ns, mpi_ns, t3d_us, mpi_us):
    d = tmp_path / name
    d.mkdir()
    _file(d / "collectives-c-2ranks.txt", "auto", t3d_ns, t3d_us)
    _file(d / "collectives-c-mpi-2ranks.txt", "mpi", mpi_ns, mpi_us)
    return str(d)


def test_same_placement_compares_like_with_like(bcs, tmp_path):
    runs = [_run(tmp_path, "a", 90, 95, (0.2, 1.0), (0.3, 1.5)),      # both near: t3d faster
            _run(tmp_path, "b", 340, 85, (0.6, 3.0), (0.3, 1.5)),     # t3d far, Open MPI near: left out
            _run(tmp_path, "c", 330, 350, (0.4, 2.0), (0.5, 2.5)),    # both far: t3d faster
            _run(tmp_path, "d", 2500, 2400, (9.0, 9.0), (0.1, 0.1))]  # disturbed on both sides: left out
    assert [bcs.placement_class(ns) for ns in (None, 90, 330, 2500, -1)] == [None, "near", "far", "?", "?"]
    every = bcs.ratios(2, runs)["allreduce"]
    assert every == [(8, 0.5, 0.3), (1024, 2.5, 1.5)], "medians of the four runs"
    same = bcs.ratios(2, runs, same=True)["allreduce"]
    assert same == [(8, pytest.approx(0.3), 0.4), (1024, 1.5, 2.0)], "runs a and c only"
    text = bcs.summary(2, runs, same=True)
    assert "| allreduce | 2 (near 1, far 1) | 1.33-1.33 | nowhere |" in text, text
    assert "- b: allreduce 340 / 85 ns" in text, text
    assert bcs.ratios(2, runs, same="near")["allreduce"] == [(8, 0.2, 0.3), (1024, 1.0, 1.5)], "run a only"
    assert bcs.ratios(2, runs, same="far")["allreduce"] == [(8, 0.4, 0.5), (1024, 2.0, 2.5)], "run c only"
    assert "| allreduce | 1 (far 1) |" in bcs.summary(2, runs, same="far")
    # files from before the benches printed placement count as alike
    old = [_run(tmp_path, "e", None, None, (0.2, 1.0), (0.3, 1.5))]
    assert bcs.ratios(2, old, same=True)["allreduce"] == [(8, 0.2, 0.3), (1024, 1.0, 1.5)]
