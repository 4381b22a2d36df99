"""The flight recorder (t3d.flight_recorder, shim/flight_recorder.cpp): the ring (wraps at its size, torch's fields,
states that go scheduled -> started -> completed), the dumps every rank writes when its group fails or it is sent a
signal, and torch's own analyser run over those dumps, which must name the rank and the operation that diverged.

Worlds of 4 ranks on one host: (a) rank 2 calls all_reduce where the others call broadcast #3 (the ranks find the
mismatch at once and every rank dumps); (b) rank 3 never joins all_reduce #3, the others time out after
T3D_TIMEOUT_MS=3000 and dump, and rank 0 then sends rank 3 SIGUSR1, on which its handler (dump_on_signal) dumps.
The analyser is the installed torch's (`python -m torch.distributed.flight_recorder.fr_trace`); the torch 2.9.1
wheel ships none, so there only the dumps are checked, unless T3D_TEST_FR_ANALYSER_PYTHON names the Python of an
environment whose torch has one (e.g. the newest test venv): then that one reads the older stack's dumps."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

import _dist

PREFIX = "t3d_trace_rank_"
WORLD = 4
pytestmark = pytest.mark.skipif(_dist.BACKEND != "t3d", reason="t3d's flight recorder")


ANALYSER_PYTHON = os.environ.get("T3D_TEST_FR_ANALYSER_PYTHON")


def _analyser_or_none():
    from t3d._compat.torch_compat import CompatError, flight_recorder_analyser

    if ANALYSER_PYTHON:
        return ANALYSER_PYTHON
    try:
        return flight_recorder_analyser()
    except CompatError:
        return None


def _load(d: str) -> dict[int, dict]:
    out = {}
    for f in os.listdir(d):
        if f.startswith(PREFIX):
            with open(os.path.join(d, f), "rb") as fh:
                out[int(f[len(PREFIX):])] = pickle.load(fh)
    return out


def _analyse(d: str) -> str:
    """The analyser's report (it logs to stderr), without its per-entry warning about the comm library name 't3d'
    that it does not know."""
    import t3d.flight_recorder as fr

    cmd = ([ANALYSER_PYTHON, "-m", "torch.distributed.flight_recorder.fr_trace", d, "-p", PREFIX] if ANALYSER_PYTHON
           else fr.analyser_command(d, PREFIX))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert res.returncode == 0, f"analyser failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    text = "\n".join(line for line in (res.stdout + res.stderr).splitlines()
                     if not line.startswith("unrecognized comm library 't3d'"))
    print(text)  # shown with -s, and on failure
    return text


def _first_rank(d: str) -> int:
    """The rank whose dump the analyser matches the others against (the first file its os.walk lists)."""
    files = next(os.walk(d))[2]
    return next(int(f[len(PREFIX):]) for f in files if f.startswith(PREFIX))


def _child_env(d: str) -> dict:
    return {"TORCH_FR_DUMP_TEMP_FILE": os.path.join(d, PREFIX), "T3D_TIMEOUT_MS": "3000", "OMP_NUM_THREADS": "1"}


def _init(rank: int, init: str, env: dict, world: int = WORLD):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401

    dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return torch, dist


def _report(q, rank, what, msg=""):
    q.put((rank, what, 0.0, msg))
    q.close()
    q.join_thread()
    os._exit(0)  # the group is broken: no destroy_process_group


# ---- (a) a rank calls another collective ---------------------------------------------------------------------------

def _desync_rank(rank: int, init: str, env: dict, q) -> None:
    torch, dist = _init(rank, init, env)
    x = torch.ones(8)
    dist.all_reduce(x)                          # collective #1
    dist.broadcast(torch.zeros(4, 2), src=0)    # #2
    try:
        if rank == 2:
            dist.all_reduce(x)                  # #3 here, broadcast #3 everywhere else
        else:
            dist.broadcast(torch.zeros(4, 2), src=0)
        dist.all_reduce(x)                      # the ranks whose broadcast went through fail here
        _report(q, rank, "no error")
    except Exception as exc:  # noqa: BLE001
        _report(q, rank, "raised", str(exc))


@pytest.fixture(scope="module")
def desync(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fr-desync"))
    got = _dist.spawn_reports(_desync_rank, WORLD, (_child_env(d),), want=set(range(WORLD)), seconds=90)
    return d, got


@pytest.mark.timeout(150)
def test_desync_every_rank_dumps(desync):
    d, got = desync
    assert set(got) == set(range(WORLD)), f"ranks did not report (hang?): {got}"
    for rank, (what, _, msg) in got.items():
        assert what == "raised", f"rank {rank}: {what}"
    dumps = _load(d)
    assert sorted(dumps) == list(range(WORLD)), sorted(os.listdir(d))
    for rank, dump in dumps.items():
        assert dump["version"] == "2.10"
        assert dump["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
        third = [e for e in dump["entries"] if e["collective_seq_id"] == 3]
        assert len(third) == 1, dump["entries"]
        e = third[0]
        assert e["profiling_name"] == ("t3d:all_reduce" if rank == 2 else "t3d:broadcast"), e
        assert e["process_group"] == ("0", "default_pg")
        assert e["input_sizes"] == ([[8]] if rank == 2 else [[4, 2]]) and e["input_dtypes"] == ["Float"]
    # Rank 2's own operation failed where it was issued: it started and never completed, with the error.
    e2 = [e for e in dumps[2]["entries"] if e["collective_seq_id"] == 3][0]
    assert e2["state"] == "started" and e2["retired"] and e2["time_discovered_completed_ns"] is None, e2
    assert e2["error"].startswith("t3d: allreduce #3 on rank 2 of group '0' failed: T3D_ERR_"), e2["error"]


@pytest.mark.timeout(150)
def test_desync_analyser_names_rank_and_collective(desync):
    d, got = desync
    if _analyser_or_none() is None:
        pytest.skip("this torch ships no flight recorder analyser (the torch 2.9.1 wheel does not)")
    assert sorted(_load(d)) == list(range(WORLD)), sorted(os.listdir(d))
    out = _analyse(d)
    assert "Collective sequence number: 3 has errors" in out, out
    first = _first_rank(d)
    if first != 2:
        # Matched against a rank that called broadcast #3: rank 2 is the culprit.
        assert "collective: t3d:broadcast" in out, out
        assert ("Culprit rank 2; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'broadcast' does not "
                "match found collective type: 'all_reduce'") in out, out
    else:
        # The analyser matches everyone against the first dump it read, rank 2's: each other rank differs from it.
        assert "collective: t3d:all_reduce" in out, out
        for r in (0, 1, 3):
            assert (f"Culprit rank {r}; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' "
                    f"does not match found collective type: 'broadcast'") in out, out


# ---- (b) a rank hangs ----------------------------------------------------------------------------------------------

def _hang_rank(rank: int, init: str, env: dict, q) -> None:
    torch, dist = _init(rank, init, env)
    import t3d.flight_recorder as fr

    d = os.path.dirname(env["TORCH_FR_DUMP_TEMP_FILE"])
    x = torch.ones(16)
    dist.all_reduce(x)                         # #1
    dist.broadcast(x, src=1)                   # #2
    if rank == 3:
        fr.dump_on_signal(signal.SIGUSR1)
        with open(os.path.join(d, "pid.3.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(d, "pid.3.tmp"), os.path.join(d, "pid.3"))
        mine = fr.default_path()
        t_end = time.monotonic() + 60
        while not os.path.exists(mine) and time.monotonic() < t_end:
            time.sleep(0.05)                   # "hung" in Python: never joins #3; the signal handler dumps
        _report(q, rank, "dumped" if os.path.exists(mine) else "no dump")
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)                     # #3: rank 3 never comes
        _report(q, rank, "no error")
    except Exception as exc:  # noqa: BLE001
        dt = time.monotonic() - t0
        if rank == 0:
            pid = int(open(os.path.join(d, "pid.3")).read())
            os.kill(pid, signal.SIGUSR1)       # what an operator does to the rank that hangs
        q.put((rank, "raised", dt, str(exc)))
        q.close()
        q.join_thread()
        os._exit(0)


@pytest.fixture(scope="module")
def hang(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fr-hang"))
    got = _dist.spawn_reports(_hang_rank, WORLD, (_child_env(d),), want=set(range(WORLD)), seconds=90)
    return d, got


@pytest.mark.timeout(150)
def test_hang_dumps_on_timeout_and_signal(hang):
    d, got = hang
    assert set(got) == set(range(WORLD)), f"ranks did not report (hang?): {got}"
    assert got[3][0] == "dumped", got[3]
    for rank in (0, 1, 2):
        what, dt, msg = got[rank]
        assert what == "raised", (rank, got[rank])
        assert dt < 20, f"rank {rank} failed after {dt:.1f} s (T3D_TIMEOUT_MS=3000)"
    dumps = _load(d)
    assert sorted(dumps) == list(range(WORLD)), sorted(os.listdir(d))
    assert [e["collective_seq_id"] for e in dumps[3]["entries"]] == [1, 2]
    assert all(e["state"] == "completed" for e in dumps[3]["entries"]), dumps[3]["entries"]
    for rank in (0, 1, 2):
        last = dumps[rank]["entries"][-1]
        assert (last["collective_seq_id"], last["profiling_name"], last["state"]) == (3, "t3d:all_reduce",
                                                                                       "started"), last
        assert last["timeout_ms"] == 3000 and last["retired"] and last["error"], last


@pytest.mark.timeout(150)
def test_hang_analyser_names_missing_rank(hang):
    d, got = hang
    if _analyser_or_none() is None:
        pytest.skip("this torch ships no flight recorder analyser (the torch 2.9.1 wheel does not)")
    assert sorted(_load(d)) == list(range(WORLD)), sorted(os.listdir(d))
    out = _analyse(d)
    block = re.search(r"Not all ranks joining collective, sequence number: 3\ninternal record id: 2\n"
                      r"group info: 0:default_pg\ncollective: t3d:all_reduce\nmissing ranks: \{3\}\n"
                      r"input sizes: \[\[16\]\]\noutput sizes: \[\[16\]\]\nworld size: 4\n"
                      r"expected ranks: \{0, 1, 2, 3\}\ncollective state: started\n", out)
    assert block, out


# ---- the ring -------------------------------------------------------------------------------------------------------

def _ring_checks(rank: int, world: int, d: str) -> dict:
    import torch
    import torch.distributed as dist

    import t3d.flight_recorder as fr

    assert fr.buffer_size() == 8
    # States: rank 1 joins late, so rank 0's first async all_reduce is running (started) and the second waits behind
    # it (scheduled); both complete once rank 1 is there.
    a, b = torch.ones(4), torch.ones(2, 3, dtype=torch.float64)
    if rank == 1:
        time.sleep(1.0)
    w1 = dist.all_reduce(a, async_op=True)
    w2 = dist.all_reduce(b, async_op=True)
    early = fr.get()["entries"][-2:]
    w1.wait()
    w2.wait()
    done = fr.get()["entries"][-2:]
    # Wrap: 10 more operations through a ring of 8.
    for _ in range(3):
        dist.broadcast(torch.zeros(5), src=0)
    out = torch.empty(world * 3, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.arange(3, dtype=torch.int32))
    if rank == 0:
        dist.send(torch.ones(7), dst=1)
    else:
        dist.recv(torch.empty(7), src=0)
    fr.set_stack_capture(True)
    def named_caller():
        dist.all_reduce(torch.ones(1))
    named_caller()
    fr.set_stack_capture(False)
    dist.barrier()
    for _ in range(3):
        dist.all_reduce(torch.ones(2))
    path = fr.dump()
    with open(path, "rb") as f:
        written = pickle.load(f)
    from t3d._compat.torch_compat import default_group, torch_fr_hook_attached

    return {"early": early, "done": done, "dump": fr.get(), "path": path, "written": written,
            "default": fr.default_path(), "torch_hook": torch_fr_hook_attached(default_group())}


@pytest.mark.timeout(150)
def test_ring_wraps_and_records_torch_fields(tmp_path, monkeypatch):
    d = str(tmp_path)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "8")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", os.path.join(d, PREFIX))
    res = _dist.run_world(_ring_checks, 2, d, timeout=90)
    for rank, r in enumerate(res):
        early, done, dump = r["early"], r["done"], r["dump"]
        if rank == 0:
            assert [e["state"] for e in early] == ["started", "scheduled"], early
            assert early[1]["time_discovered_started_ns"] is None
        assert [e["state"] for e in done] == ["completed", "completed"], done
        for e in done:
            assert e["time_created_ns"] <= e["time_discovered_started_ns"] <= e["time_discovered_completed_ns"]
            assert e["retired"] and e["duration_ms"] >= 0
        assert [e["input_sizes"] for e in done] == [[[4]], [[2, 3]]]
        assert [e["output_dtypes"] for e in done] == [["Float"], ["Double"]]
        # 2 + 3 + 1 + 1 + 1 + 1 + 3 = 12 operations through 8 slots: the oldest 4 are gone.
        entries = dump["entries"]
        assert [e["record_id"] for e in entries] == list(range(4, 12)), entries
        names = [e["profiling_name"] for e in entries]
        p2p = "t3d:send 0->1" if rank == 0 else "t3d:recv 1<-0"
        assert names == ["t3d:broadcast", "t3d:_all_gather_base", p2p, "t3d:all_reduce", "t3d:barrier",
                         "t3d:all_reduce", "t3d:all_reduce", "t3d:all_reduce"], names
        assert [e["collective_seq_id"] for e in entries] == [5, 6, 6, 7, 8, 9, 10, 11]
        assert [e["p2p_seq_id"] for e in entries] == [0, 0, 1, 1, 1, 1, 1, 1]
        assert [e["op_id"] for e in entries] == list(range(5, 13))
        assert [e["is_p2p"] for e in entries] == [False, False, True, False, False, False, False, False]
        assert all(e["state"] == "completed" and e["retired"] for e in entries), entries
        ag = entries[1]
        assert (ag["input_sizes"], ag["output_sizes"], ag["input_dtypes"]) == ([[3]], [[6]], ["Int"]), ag
        assert entries[2]["input_sizes"] == entries[2]["output_sizes"] == [[7]]
        assert entries[4]["input_sizes"] == [] and entries[4]["output_sizes"] == []
        frames = entries[3]["frames"]
        assert any(f["name"] == "all_reduce" and f["filename"].endswith("distributed_c10d.py") for f in frames), frames
        assert any(f["name"] == "named_caller" and f["filename"].endswith("test_flight_recorder.py") and f["line"] > 0
                   for f in frames), frames
        assert all(e["frames"] == [] for i, e in enumerate(entries) if i != 3)
        assert dump["version"] == "2.10" and dump["comm_lib_version"].startswith("t3d ")
        assert dump["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
        assert dump["pg_status"]["0"]["last_completed_collective"] == 11
        assert r["path"] == r["default"] == os.path.join(d, f"{PREFIX}{rank}")
        assert r["written"]["entries"] == entries
        # torch (2.15) records every group that has no recorder of its own; t3d's groups are not recorded twice.
        assert r["torch_hook"] is not True


def test_format_version_matches_installed_torch():
    """The dump's version is the one the installed torch's own recorder writes (FlightRecorder.hpp)."""
    import torch

    import t3d.flight_recorder as fr

    hdr = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "distributed", "c10d",
                       "FlightRecorder.hpp")
    if not os.path.exists(hdr):
        pytest.skip("this torch ships no C++ headers")
    m = re.search(r'DEFINE_CONSTANT\(version_val, "([\d.]+)"\)', open(hdr).read())
    assert m, hdr
    assert fr.FORMAT_VERSION == m[1]
    assert fr.get()["version"] == m[1]
