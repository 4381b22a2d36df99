# The op spec `t3d-bench collectives` shares between its torch.distributed ranks and its Open MPI peer (opspec.py),
# and the peer itself (mpi_peer.py) without Open MPI: its arguments, its output line, its loop over ranks that are
# threads of this process on a fake communicator, the command collectives.run_mpi runs, and a run of the file by its
# path on a one-rank stand-in for mpi4py.
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from t3d.bench import collectives as bc
from t3d.bench import mpi_peer, opspec


def _simulate(op, n, nbytes):
    """Every rank's output of op from opspec's inputs, computed here with numpy: [rank] -> array."""
    n_in, n_out, _ = opspec.counts(op, nbytes, n)
    ins = [np.full(n_in, opspec.input_value(op, r, n), np.float32) for r in range(n)]
    if op == "all_reduce":
        return [np.sum(ins, axis=0, dtype=np.float32)] * n
    if op == "all_gather":
        return [np.concatenate(ins)] * n
    if op == "reduce_scatter":
        total = np.sum(ins, axis=0, dtype=np.float32)
        return [total[r * n_out:(r + 1) * n_out] for r in range(n)]
    if op == "all_to_all":
        per = n_in // n
        return [np.concatenate([ins[p][r * per:(r + 1) * per] for p in range(n)]) for r in range(n)]
    if op == "broadcast":
        return [ins[opspec.ROOT].copy() for _ in range(n)]
    return [ins[opspec.ring_peers(r, n)[1]].copy() for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("nbytes", [4, 8, 100, 4096])
def test_the_spec_expects_what_the_ops_make_of_its_inputs(n, nbytes):
    for op in opspec.OPS:
        if not opspec.runs_on(op, n):
            assert op == "send_recv" and n == 1
            continue
        n_in, n_out, size_b = opspec.counts(op, nbytes, n)
        assert n_in >= 1 and n_out >= 1 and size_b == 4 * max(n_in, n_out), op
        outs = _simulate(op, n, nbytes)
        for r in range(n):
            assert len(outs[r]) == n_out, (op, r)
            assert opspec.output_ok(op, r, n, outs[r]), (op, r)
            poisoned = np.full(n_out, opspec.POISON, np.float32)
            assert not opspec.output_ok(op, r, n, poisoned), f"{op}: an untouched output must fail the check"
            if n > 1:
                wrong = outs[r].copy()
                wrong[-1] += 1.0
                assert not opspec.output_ok(op, r, n, wrong), f"{op}: one wrong element must fail the check"


def test_the_spec_keeps_the_numbers_the_bench_reports():
    assert bc.OPS is opspec.OPS and bc.bus_factor is opspec.bus_factor and bc.ROW_BUDGET_S == 1.5
    assert opspec.counts("all_reduce", 64, 8) == (16, 16, 64)
    assert opspec.counts("all_gather", 64, 3) == (5, 15, 60)
    assert opspec.counts("reduce_scatter", 64, 3) == (15, 5, 60)
    assert opspec.counts("all_to_all", 8, 4) == (4, 4, 16), "never zero: one element per rank at least"
    assert opspec.bus_factor("all_reduce", 4) == 1.5 and opspec.bus_factor("all_to_all", 4) == 0.75
    assert opspec.bus_factor("broadcast", 4) == opspec.bus_factor("send_recv", 4) == 1.0
    assert opspec.iters_for(64 << 10) == (50, 1000) and opspec.iters_for(4 << 20) == (5, 40)
    assert opspec.iters_for((4 << 20) + 1) == (2, 8)
    assert opspec.budget_iters(1000, 0.01) == 150 and opspec.budget_iters(1000, 10.0) == 5
    assert opspec.budget_iters(40, 0.0) == 40
    assert opspec.row("all_to_all", 64, 2.5e-6, False) == {"op": "all_to_all", "bytes": 64, "time_us": 2.5,
                                                           "wrong": 1}
    with pytest.raises(ValueError):
        opspec.counts("all_reduce_coalesced", 8, 2)


def test_peer_arguments_and_output_line():
    ops, sizes, budget = mpi_peer.parse_args(['["all_reduce", "send_recv"]', "[8, 4096]", "1.5"])
    assert (ops, sizes, budget) == (["all_reduce", "send_recv"], [8, 4096], 1.5)
    for bad in (['["nosuch"]', "[8]", "1"], ['["all_reduce"]', "[0]", "1"], ['["all_reduce"]', "[8.5]", "1"],
                ['["all_reduce"]', "[8]"], ['"all_reduce"', "[8]", "1"]):
        with pytest.raises(ValueError):
            mpi_peer.parse_args(bad)
    assert mpi_peer.main(["[]"]) == 2
    rows = [opspec.row("broadcast", 8, 1e-5, True)]
    out = "some mpirun chatter\n" + mpi_peer.format_rows(rows) + "\nmore\n"
    assert mpi_peer.format_rows(rows).startswith("T3D_BENCH_ROWS ")
    assert mpi_peer.parse_output(out) == rows
    assert mpi_peer.parse_output("no rows here\n") is None


def test_collectives_runs_the_peer_file_under_mpirun(monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(cmd=cmd, env=kw["env"])
        return subprocess.CompletedProcess(cmd, 0, stdout=mpi_peer.format_rows([opspec.row("all_reduce", 8, 2e-6,
                                                                                               True)]), stderr="")

    monkeypatch.setattr(bc.subprocess, "run", fake_run)
    rows = bc.run_mpi(3, ["all_reduce"], [8], timeout=10)
    assert rows == [{"op": "all_reduce", "bytes": 8, "time_us": 2.0, "wrong": 0}]
    cmd = seen["cmd"]
    assert cmd[:6] == ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "3"]
    assert cmd[-5:] == [sys.executable, os.path.abspath(mpi_peer.__file__), '["all_reduce"]', "[8]", "1.5"]
    assert seen["env"]["OMPI_MCA_btl"] == "self,vader"
    monkeypatch.setattr(bc.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="no slots"))
    with pytest.raises(RuntimeError, match="no slots"):
        bc.run_mpi(3, ["all_reduce"], [8], timeout=10)


class _MPI:
    SUM, MAX = "sum", "max"


class _Comm:
    """mpi4py's COMM_WORLD as mpi_peer uses it, for n threads of this process; `broken` names calls that do nothing."""

    def __init__(self, world, rank, broken=()):
        self.world, self.rank, self.broken = world, rank, broken

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.world["n"]

    def _exchange(self, value):
        w = self.world
        w["slots"][self.rank] = value
        w["barrier"].wait()
        got = list(w["slots"])
        w["barrier"].wait()
        return got

    def Barrier(self):
        self._exchange(None)

    def allreduce(self, value, op):
        got = self._exchange(value)
        return max(got) if op == _MPI.MAX else sum(got)

    def Allreduce(self, x, out, op):
        got = self._exchange(x.copy())
        if "Allreduce" not in self.broken:
            out[:] = np.sum(got, axis=0) if op == _MPI.SUM else np.max(got, axis=0)

    def Allgather(self, x, out):
        out[:] = np.concatenate(self._exchange(x.copy()))

    def Reduce_scatter_block(self, x, out, op):
        total = np.sum(self._exchange(x.copy()), axis=0)
        out[:] = total[self.rank * len(out):(self.rank + 1) * len(out)]

    def Alltoall(self, x, out):
        got, per = self._exchange(x.copy()), len(out) // self.world["n"]
        out[:] = np.concatenate([g[self.rank * per:(self.rank + 1) * per] for g in got])

    def Bcast(self, x, root=0):
        x[:] = self._exchange(x.copy())[root]

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
        got = self._exchange((dest, sendbuf.copy()))
        to, data = got[source]
        assert to == self.rank and sendtag == recvtag == 0
        if "Sendrecv" not in self.broken:
            recvbuf[:] = data


def _run_world(n, ops, sizes, broken=()):
    world = {"n": n, "slots": [None] * n, "barrier": threading.Barrier(n, timeout=60)}
    results, errors = [None] * n, []

    def rank_main(r):
        try:
            results[r] = mpi_peer.run_rows(_Comm(world, r, broken), _MPI, np, ops, sizes, budget_s=1e-3)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            world["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("n", [1, 3])
def test_peer_rows_on_a_fake_communicator(n):
    sizes = [8, 100]
    results = _run_world(n, list(opspec.OPS), sizes)
    assert all(r == results[0] for r in results), "every rank ends with the same rows (the slowest rank's)"
    rows = results[0]
    expect = [(op, s) for op in opspec.OPS if opspec.runs_on(op, n) for s in sizes]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, opspec.counts(op, s, n)[2]) for op, s in expect]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), rows


def test_peer_buffers_are_private_pages_nobody_advised_huge():
    """numpy would ask for transparent huge pages for a large array; the peer's buffers are private anonymous pages,
    as torch's CPU tensors are by default (on huge pages large copies ran up to 1.8x faster)."""
    import numpy as np

    a = mpi_peer.plain_array(np, 3 << 20)
    assert a.dtype == np.float32 and a.shape == (3 << 20,) and a.flags.writeable
    a.fill(2.5)
    assert float(a.sum()) == 2.5 * (3 << 20)
    assert mpi_peer.plain_array(np, 0).shape == (0,)
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_always = "[always]" in f.read()
    except OSError:
        thp_always = False
    # Every mapping that holds part of the buffer (advising a range splits a mapping at its ends).
    lo_buf, hi_buf = a.ctypes.data, a.ctypes.data + a.nbytes
    with open("/proc/self/smaps") as f:
        entries = f.read().split("\n")
    seen = []
    for i, line in enumerate(entries):
        head = line.split(" ", 1)[0]
        if "-" not in head or not all(c in "0123456789abcdef-" for c in head):
            continue
        lo, hi = (int(v, 16) for v in head.split("-"))
        if hi <= lo_buf or lo >= hi_buf:
            continue
        fields = {}
        for x in entries[i + 1:]:
            key = x.split(":", 1)[0]
            if " " in key or ":" not in x:
                break
            fields[key] = x.split(":", 1)[1].strip()
        seen.append(line)
        assert line.split()[1].endswith("p"), f"the buffer's mapping is shared: {line}"
        if not thp_always:  # where the kernel gives huge pages unasked, torch's tensors get them too
            assert fields.get("AnonHugePages") == "0 kB", (line, fields)
        assert " hg" not in " " + fields.get("VmFlags", ""), f"the buffer was advised huge: {line} {fields}"
    assert seen, "the buffer's mappings are not in /proc/self/smaps"


def test_peer_check_catches_an_op_that_does_nothing():
    rows = _run_world(2, ["all_reduce", "send_recv", "broadcast"], [64], broken=("Allreduce", "Sendrecv"))[0]
    assert {r["op"]: r["wrong"] for r in rows} == {"all_reduce": 1, "send_recv": 1, "broadcast": 0}


_FAKE_MPI4PY = '''
import atexit, os, sys
import numpy as np


class _Comm:  # one rank: every collective copies its input
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Barrier(self):
        pass

    def allreduce(self, value, op):
        return value

    def Allreduce(self, x, out, op):
        out[:] = x

    def Allgather(self, x, out):
        out[:] = x

    def Reduce_scatter_block(self, x, out, op):
        out[:] = x

    def Alltoall(self, x, out):
        out[:] = x

    def Bcast(self, x, root=0):
        pass


SUM, MAX = "sum", "max"
COMM_WORLD = _Comm()
atexit.register(lambda: open(os.environ["FAKE_MPI_REPORT"], "w").write(
    " ".join(m for m in ("torch", "t3d", "t3d.bench") if m in sys.modules)))
'''


def test_peer_file_runs_by_path_without_torch(tmp_path):
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("")
    (tmp_path / "mpi4py" / "MPI.py").write_text(_FAKE_MPI4PY)
    report = tmp_path / "loaded"
    cmd = mpi_peer.command(1, ["all_reduce", "broadcast", "send_recv"], [8, 64], 1e-3)
    assert cmd[-4] == os.path.abspath(mpi_peer.__file__)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), FAKE_MPI_REPORT=str(report))
    res = subprocess.run(cmd[cmd.index(sys.executable):], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    rows = mpi_peer.parse_output(res.stdout)
    assert [(r["op"], r["bytes"], r["wrong"]) for r in rows] == [("all_reduce", 8, 0), ("all_reduce", 64, 0),
                                                                  ("broadcast", 8, 0), ("broadcast", 64, 0)]
    assert report.read_text() == "", "the peer loads numpy and mpi4py only, not torch or the t3d package"
    assert json.loads(res.stdout.split("T3D_BENCH_ROWS ", 1)[1]) == rows
