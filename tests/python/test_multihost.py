"""Groups across hosts, on hosts simulated with network namespaces (tests/python/_netns.py: own host name, IPC and
/dev/shm, a veth link, addresses only inside the namespaces; root only): results are right, and a rank that dies, a
host cut off the network, or ranks that call different collectives end every rank's wait within seconds, under a
group timeout of two minutes. The errors are asserted word for word."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest

import _dist
from t3d import netns as _netns

WHY = _netns.available()
pytestmark = [
    pytest.mark.skipif(_dist.BACKEND != "t3d", reason="exercises t3d's transports and failure reporting"),
    pytest.mark.skipif(bool(WHY), reason=f"simulated hosts: {WHY}"),
]

GROUP_TIMEOUT_S = 120.0  # far longer than any test allows: failures must be found another way


def _init(rank: int, world: int, timeout_s: float = GROUP_TIMEOUT_S):
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401

    dist.init_process_group("t3d", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return torch, dist


def _hard_exit(code: int = 0) -> None:
    os._exit(code)  # the group is broken (or the test is over): no destroy, no finalizers that could wait


# ---------- results across hosts ----------

def _collectives(rank: int, world: int, report) -> None:
    torch, dist = _init(rank, world)
    host_peers = [[0, 1], [2, 3]]
    local = [dist.new_group(g) for g in host_peers]  # ranks of one host: shared memory
    cross = dist.new_group([1, 2])  # one rank of each host
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((1000,), 10.0)), x[:4]
    y = torch.full((70000,), float(rank))
    dist.broadcast(y, src=3)
    assert torch.equal(y, torch.full((70000,), 3.0)), y[:4]
    out = [torch.empty(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    assert [float(t[0]) for t in out] == [0.0, 1.0, 2.0, 3.0]
    z = torch.full((5,), float(rank + 1))
    dist.all_reduce(z, group=local[rank // 2])
    assert torch.equal(z, torch.full((5,), 3.0 if rank < 2 else 7.0)), z
    if rank in (1, 2):
        w = torch.full((4,), float(rank))
        dist.all_reduce(w, group=cross)
        assert torch.equal(w, torch.full((4,), 3.0)), w
    dist.barrier()
    # Ranks leave one by one: a peer that shut down is never reported lost (the watch logs every loss it finds).
    time.sleep(0.3 * rank)
    dist.destroy_process_group()
    time.sleep(0.3 * (world - rank))
    report("done")


@pytest.mark.timeout(150)
def test_results_across_hosts_and_clean_shutdown(tmp_path):
    log = str(tmp_path / "t3d-log")
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_collectives, 2, env={"T3D_DEBUG": "INFO", "T3D_DEBUG_FILE": log}, seconds=120)
    for rank, events in got.items():
        assert [e["what"] for e in events] == ["done"], f"rank {rank}: {events}"
    logs = "".join(open(tmp_path / f).read() for f in os.listdir(tmp_path) if f.startswith("t3d-log"))
    assert "over ucx" in logs, "no group went over UCX: the hosts were not apart"
    assert "lost rank" not in logs and "broke the group" not in logs, logs[-3000:]


# ---------- a rank dies ----------

def _killed(rank: int, world: int, report) -> None:
    torch, dist = _init(rank, world)
    sub = dist.new_group([1, 3])  # across hosts, with the rank that dies
    x = torch.ones(4096)
    dist.all_reduce(x)
    report("ready")
    if rank == 3:  # dies at a random point, likely inside a collective
        def die():
            report("dying")
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.2 + (os.getpid() % 7) / 10, die).start()
    try:
        for _ in range(1_000_000):
            dist.all_reduce(x)
            if rank in (1, 3):
                dist.all_reduce(x, group=sub)
        report("done")
    except Exception as exc:  # noqa: BLE001
        report("raised", error=str(exc))
    _hard_exit()


# What a survivor says: found the loss itself (in its wait, or before a later collective started), or was told by
# the rank that found it.
def _lost_or_told(rank: int, world_or_sub: str, lost: str) -> str:
    op = r"allreduce #\d+ on group '\d+'"
    me = rf"\(rank \d of \d\)"
    return (rf"t3d: {op} {me} {lost}; still waiting for rank\(s\) [\d, ]+"
            rf"|t3d: {op} {me} failed: rank \d broke the group: t3d: {op} {me} "
            rf"|t3d: allreduce #\d+ on group '\d+' \(rank \d\) not run: the communicator is broken by an earlier "
            rf"error: ({lost}|failed: rank \d broke the group: t3d: {op} {me})"
            # in the two-level allreduce (shared memory in each host), while its host's part ran
            rf"|{op} {me} failed in its host's part, group '\d+/host', whose ranks 0\.\.1 are ranks \d, \d here: "
            rf"t3d: allreduce #\d+ on group '\d+/host' \(rank \d of 2\) (lost rank \d: its process \(pid \d+\) has "
            rf"exited|failed: rank \d broke the group)")


@pytest.mark.timeout(150)
def test_killed_rank_fails_every_rank_on_both_hosts():
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_killed, 2, seconds=90, want={0, 1, 2})
    died = [e["t"] for e in got[3] if e["what"] == "dying"]
    assert died, f"rank 3 never got to die: {got[3]}"
    # Found by the watch (its connection closed), or first by UCX (the rank's UCX connection reset).
    lost = r"lost rank [13]( \(pid \d+ on host 'host1'\): its connection closed without a goodbye \(the process " \
           r"died or was killed\)|: its UCX connection failed \(the process died or its host is unreachable\))"
    for rank in (0, 1, 2):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "raised", f"rank {rank} did not raise (hang?): {got[rank]}"
        dt = ends[0]["t"] - died[0]
        assert dt < 10, f"rank {rank} took {dt:.1f} s to fail (group timeout {GROUP_TIMEOUT_S} s)"
        msg = ends[0]["error"]
        assert re.search(_lost_or_told(rank, "", lost), msg), f"rank {rank}: unexpected error text: {msg!r}"
        assert "rank 3" in msg or "rank 1" in msg


# ---------- a host is cut off ----------

def _partitioned(rank: int, world: int, report) -> None:
    torch, dist = _init(rank, world)
    x = torch.ones(256)
    dist.all_reduce(x)
    report("ready")
    try:
        for _ in range(10_000_000):
            dist.all_reduce(x)
        report("done")
    except Exception as exc:  # noqa: BLE001
        report("raised", error=str(exc))
    _hard_exit()


@pytest.mark.timeout(150)
def test_partition_fails_every_rank_within_the_peer_timeout():
    cut = {}
    with _netns.NetnsHosts(2) as hosts:
        ready = set()

        def on_event(ev):
            if ev["what"] == "ready":
                ready.add(ev["rank"])
                if ready == {0, 1, 2, 3} and not cut:
                    time.sleep(0.5)  # collectives are running
                    hosts.cut(1)
                    cut["t"] = time.time()

        got = hosts.run(_partitioned, 2, seconds=90, on_event=on_event, env={"T3D_PEER_TIMEOUT_MS": "3000"})
    assert cut, f"the ranks never got ready: {got}"
    silent = r"lost rank \d \(pid \d+ on host 'host\d'\): nothing heard from it for 3000 ms \(T3D_PEER_TIMEOUT_MS\): " \
             r"its host is down or unreachable"
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "raised", f"rank {rank} did not raise (hang?): {got[rank]}"
        dt = ends[0]["t"] - cut["t"]
        assert dt < 3 + 7, f"rank {rank} took {dt:.1f} s after the cut to fail (peer timeout 3 s)"
        msg = ends[0]["error"]
        assert re.search(_lost_or_told(rank, "", silent), msg), f"rank {rank}: unexpected error text: {msg!r}"
        # Each side lost the other side's ranks.
        other = "host1" if rank < 2 else "host0"
        assert f"on host '{other}'" in msg, f"rank {rank}: {msg!r}"


# ---------- two levels: shared memory in each host, UCX between hosts ----------

def _two_level(rank: int, world: int, report) -> None:
    torch, dist = _init(rank, world)
    hosts = 2
    host = int(os.environ["T3D_TEST_HOST_OF"].split(",")[rank])
    bad = []
    for n in (1, 3, 4, 1000, 20001, 65537, 1 << 20):
        for dt in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
                if op == dist.ReduceOp.AVG and not dt.is_floating_point:
                    continue
                xs = [(torch.arange(n) % 97 * (p + 1) + p).to(dt) for p in range(world)]  # exact in every dtype
                x = xs[rank].clone()
                dist.all_reduce(x, op=op)
                ref = torch.stack([t.double() for t in xs])
                want = {dist.ReduceOp.SUM: ref.sum(0), dist.ReduceOp.MAX: ref.max(0).values,
                        dist.ReduceOp.AVG: ref.sum(0) / world}[op]
                tol = 0.01 * float(want.abs().max()) if dt == torch.bfloat16 else 0.0
                if not torch.allclose(x.double(), want, atol=tol, rtol=0):
                    bad.append(f"all_reduce n={n} {dt} {op}")
    # Random floats: every rank ends with the same bits (one owner per element at every level).
    g = torch.Generator().manual_seed(rank)
    r = torch.randn(300001, generator=g)
    dist.all_reduce(r)
    got = [torch.empty_like(r) for _ in range(world)]
    dist.all_gather(got, r)
    if not all(torch.equal(got[0], t) for t in got):
        bad.append("all_reduce results differ between ranks")
    for n in (1, 100, 70000, 3 << 20):
        for root in range(world):
            y = torch.full((n,), float(rank)) + (torch.arange(n) if rank == root else 0)
            dist.broadcast(y, src=root)
            if not torch.equal(y, torch.full((n,), float(root)) + torch.arange(n)):
                bad.append(f"broadcast n={n} root={root}")
    for n in (1, 1000, 300001):
        for dt in (torch.float32, torch.int64, torch.bfloat16):
            out = torch.empty(world * n, dtype=dt)
            dist.all_gather_into_tensor(out, (torch.arange(n) % 101 + 1000 * rank).to(dt))
            want = torch.cat([(torch.arange(n) % 101 + 1000 * p).to(dt) for p in range(world)])
            if not torch.equal(out, want):
                bad.append(f"all_gather_into_tensor n={n} {dt}")
            parts = [torch.empty(n, dtype=dt) for _ in range(world)]
            dist.all_gather(parts, torch.full((n,), rank + 1, dtype=dt))
            if not all(torch.equal(t, torch.full((n,), p + 1, dtype=dt)) for p, t in enumerate(parts)):
                bad.append(f"all_gather n={n} {dt}")
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
                if op == dist.ReduceOp.AVG and not dt.is_floating_point:
                    continue
                inp = [(torch.arange(world * n) % 89 * (p + 1) + p).to(dt) for p in range(world)]
                o = torch.empty(n, dtype=dt)
                dist.reduce_scatter_tensor(o, inp[rank], op=op)
                ref = torch.stack([t.double() for t in inp])
                full = {dist.ReduceOp.SUM: ref.sum(0), dist.ReduceOp.MAX: ref.max(0).values,
                        dist.ReduceOp.AVG: ref.sum(0) / world}[op]
                want = full[rank * n:(rank + 1) * n]
                tol = 0.01 * float(want.abs().max()) if dt == torch.bfloat16 else 0.0
                if not torch.allclose(o.double(), want, atol=tol, rtol=0):
                    bad.append(f"reduce_scatter_tensor n={n} {dt} {op}")
    report("done", bad=bad, host=host)
    dist.destroy_process_group()
    _hard_exit()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("interleaved", [False, True], ids=["hosts-contiguous", "hosts-interleaved"])
def test_two_level_collectives_across_hosts(tmp_path, interleaved):
    """2 hosts x 2 ranks: allreduce (every size, dtype and op the engine treats apart), broadcast (every root),
    allgather and reduce_scatter take the two levels, with ranks numbered host by host or round the hosts
    (reduce_scatter then goes over UCX between all ranks), and give the exact results. Round the hosts, allreduce
    also runs in pieces of 40000 bytes (T3D_HIER_CHUNK_BYTES: n=20001 leaves a one-element tail, which joins the
    last piece)."""
    log = str(tmp_path / "t3d.log")
    host_of = ",".join(str(p % 2 if interleaved else p // 2) for p in range(4))
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_two_level, 2, seconds=200, interleaved=interleaved,
                        env={"T3D_DEBUG": "INFO", "T3D_DEBUG_FILE": log, "T3D_TEST_HOST_OF": host_of,
                             "T3D_HIER_CHUNK_BYTES": "40000" if interleaved else "0"})
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "done", f"rank {rank}: {got[rank]}"
        assert ends[0]["bad"] == [], f"rank {rank}: wrong results: {ends[0]['bad'][:10]}"
    logs = "".join(open(os.path.join(tmp_path, f)).read() for f in os.listdir(tmp_path) if f.startswith("t3d.log"))
    assert len(re.findall(r"comm '0' rank \d: two-level collectives, 2 hosts x 2 ranks", logs)) == 4, logs[-3000:]


# ---------- ranks call different collectives ----------

def _desync(rank: int, world: int, report) -> None:
    torch, dist = _init(rank, world)
    x = torch.full((64,), float(rank + 1))
    dist.all_reduce(x)
    report("ready")
    # Every rank finishes the agreed allreduce before the disagreement: a rank that finds it at once (the two-level
    # path) breaks the group, and with it any earlier collective still running on a slower rank.
    time.sleep(0.5)
    try:
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, src=0)
        report("done", data=[float(v) for v in x[:2]])
    except Exception as exc:  # noqa: BLE001
        report("raised", error=str(exc))
    _hard_exit()


@pytest.mark.timeout(150)
def test_desync_across_hosts_raises_on_every_rank_within_seconds():
    """No debug switch, a two-minute group timeout: the ranks never take each other's messages (tags carry the
    operation); a rank whose wait lasts finds the other operation's message from a rank it awaits, says what each
    runs, and tells the others."""
    with _netns.NetnsHosts(2) as hosts:  # every rank over UCX (the two-level path: the next test)
        got = hosts.run(_desync, 2, seconds=90, env={"T3D_HIER": "0"})
    ready = max(e["t"] for r in got for e in got[r] if e["what"] == "ready")
    call = r"t3d: (allreduce|broadcast) #2 on group '0' \(rank \d of 4\): rank \d runs (allreduce|broadcast) #2 where " \
           r"this rank runs (allreduce|broadcast) \(ranks disagree on the operation\)"
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "raised", f"rank {rank} returned (wrong data?) or hung: {got[rank]}"
        assert ends[0]["t"] - ready < 10, f"rank {rank} took {ends[0]['t'] - ready:.1f} s to fail"
        op = "allreduce" if rank == 0 else "broadcast"
        own = rf"t3d: {op} #2 on group '0' \(rank {rank} of 4\): rank \d runs (allreduce|broadcast) #2 where this rank " \
              rf"runs {op} \(ranks disagree on the operation\)"
        told = rf"t3d: {op} #2 on group '0' \(rank {rank} of 4\) failed: rank \d broke the group: {call}"
        msg = ends[0]["error"]
        assert re.search(f"{own}|{told}", msg), f"rank {rank}: unexpected error text: {msg!r}"
    assert any(re.search(call, e["error"]) and "broke the group" not in e["error"]
               for r in got for e in got[r] if e["what"] == "raised"), "no rank found the desync itself"


@pytest.mark.timeout(150)
def test_desync_in_the_two_level_path_raises_on_every_rank_within_seconds():
    """The same desync where allreduce and broadcast go in two levels: the ranks of a host find it in their
    shared-memory part (its phases disagree), and tell the other host."""
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_desync, 2, seconds=90)
    ready = max(e["t"] for r in got for e in got[r] if e["what"] == "ready")
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "raised", f"rank {rank} returned (wrong data?) or hung: {got[rank]}"
        assert ends[0]["t"] - ready < 10, f"rank {rank} took {ends[0]['t'] - ready:.1f} s to fail"
        msg = ends[0]["error"]
        assert "(ranks disagree on the operation)" in msg, f"rank {rank}: unexpected error text: {msg!r}"
        assert re.search(r"failed in its host's part, group '0/host', whose ranks 0\.\.1 are ranks "
                         rf"{'0, 1' if rank < 2 else '2, 3'} here", msg) or "broke the group" in msg, msg


@pytest.mark.timeout(150)
def test_desync_across_hosts_under_torch_debug_detail_names_both_calls():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps the group and compares every collective's fingerprint first."""
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_desync, 2, seconds=90,
                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "GLOO_SOCKET_IFNAME": "eth0"})
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("raised", "done", "crashed")]
        assert ends and ends[0]["what"] == "raised", f"rank {rank} returned or hung: {got[rank]}"
        msg = ends[0]["error"]
        assert "Detected mismatch between collectives on ranks" in msg, f"rank {rank}: {msg!r}"
        assert "ALLREDUCE" in msg and "BROADCAST" in msg, f"rank {rank}: {msg!r}"


# ---------- the 3D workflow across hosts that share no filesystem ----------

def _train(rank: int, world: int, report) -> None:
    from t3d.train.cli import main

    out = os.environ["T3D_TEST_OUT"]
    rc = main(["--dp", "2", "--tp", "2", "--cp", "1", "--steps", "3", "--global-batch", "8", "--seq-len", "64",
               "--no-progress", "--no-save", "--no-plot", "--ckpt-dir", os.path.join(out, f"rank{rank}"),
               "--metrics-json", os.path.join(out, "metrics.json")])
    cache = os.environ["T3D_MODEL_CACHE"]
    report("done", rc=rc, cache=sorted(os.listdir(cache)))
    _hard_exit()


@pytest.mark.timeout(240)
def test_train_across_hosts_without_a_shared_filesystem(tmp_path):
    """Each host's first rank writes the tiny model into that host's own cache (a tmpfs per host), and dp2 x tp2
    across the two hosts gives the loss curve of one process (its first loss, 5.5364, as tests/python/test_train.py
    pins for every layout)."""
    cache = tmp_path / "model-cache"
    cache.mkdir()
    with _netns.NetnsHosts(2) as hosts:
        got = hosts.run(_train, 2, seconds=200, private=[str(cache)],
                        env={"T3D_MODEL_CACHE": str(cache), "T3D_TEST_OUT": str(tmp_path)})
    for rank in range(4):
        ends = [e for e in got[rank] if e["what"] in ("done", "raised", "crashed")]
        assert ends and ends[0]["what"] == "done" and ends[0]["rc"] == 0, f"rank {rank}: {got[rank]}"
        assert any(name.startswith("tiny-llama-") for name in ends[0]["cache"]), f"rank {rank}: {ends[0]}"
    assert os.listdir(cache) == [], "the hosts' caches were not private (the model landed in the shared folder)"
    import json

    with open(tmp_path / "metrics.json") as f:
        losses = json.load(f)["losses"]
    assert len(losses) == 3 and abs(losses[0] - 5.5364) < 1e-3 and losses[-1] < losses[0], losses


# ---------- the benchmark's multi-host mode ----------

@pytest.mark.timeout(240)
def test_bench_collectives_on_simulated_hosts(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "t3d.bench", "collectives", "--hosts", "2", "--nproc", "2", "--ops",
           "all_reduce,all_gather", "--min", "4K", "--max", "64K", "--backends", "t3d,t3d-flat,gloo", "--out",
           str(tmp_path), "--timeout", "150"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = open(tmp_path / "collectives-2hosts-2ranks.md").read()
    assert md.startswith("# t3d-bench collectives on 2 simulated hosts x 2 ranks"), md
    rows = [l for l in md.splitlines() if l.startswith("| all_")]
    assert [(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows] == [
        (op, str(n)) for op in ("all_reduce", "all_gather") for n in (4096, 16384, 65536)], md
    assert "WRONG" not in md and " - |" not in md.split("| op |")[1].split("\n", 2)[2], md
    assert re.search(r"^Link: \d+\.\d\d GB/s one way \(ucx_perftest.*; \d+\.\d\d GB/s each way when both directions "
                     r"carry at once", md, re.M), md
    assert "| t3d-flat time (us) |" in md and "| t3d-flat / t3d | gloo / t3d | link floor / t3d |" in md, md
