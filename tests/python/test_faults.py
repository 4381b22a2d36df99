"""Faults: a rank killed (SIGKILL) at a random point of a random collective, over shared memory and over UCX; a rank
killed under point-to-point; a rank that never arrives (at a collective, or at init); ranks that call different
collectives (desync); a /dev/shm too small for the segment; a port already in use. Every survivor must raise within a
bounded time, never hang or crash, and the errors are asserted word for word: the call (torch's name and t3d's), its
sequence number, the group, the rank, and what went wrong. No test may leave a t3d segment in /dev/shm."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

import _dist
from _faults import shm_leak_check

pytestmark = pytest.mark.skipif(_dist.BACKEND != "t3d", reason="t3d's failure reporting")

HERE = os.path.dirname(os.path.abspath(__file__))
PG_TIMEOUT_S = 120.0  # far beyond what the tests allow: only t3d's own detection can explain a quick error
COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "reduce", "gather", "scatter", "barrier"]
# t3d.soak's kinds -> (torch's op name in the shim's prefix, t3d's collective in the C message)
NAMES = {"all_reduce": ("allreduce", "allreduce"), "broadcast": ("broadcast", "broadcast"),
         "all_gather": ("allgather", "allgather"), "all_gather_into_tensor": ("_allgather_base", "allgather"),
         "reduce_scatter_tensor": ("_reduce_scatter_base", "reduce_scatter"),
         "all_to_all_single": ("alltoall_base", "alltoall"), "reduce": ("reduce", "reduce"),
         "gather": ("gather", "gather"), "scatter": ("scatter", "scatter"), "barrier": ("barrier", "barrier")}


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    with shm_leak_check():
        yield


def _init(rank: int, init: str, world: int, env: dict | None = None, timeout_s: float = PG_TIMEOUT_S):
    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    import t3d  # noqa: F401
    torch.set_num_threads(1)
    dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return torch, dist


def _report(q, rank: int, what: str, dt: float, msg: str) -> None:
    q.put((rank, what, dt, msg))
    q.close()
    q.join_thread()
    os._exit(0)  # the group is broken: no destroy_process_group


# ---------------------------------------------------------------------------------------------------------------
# kill -9 at a random point of a random collective
# ---------------------------------------------------------------------------------------------------------------

def _kill_plan(seed: int, world: int):
    rng = random.Random(seed * 31 + 7)
    # delay None: dies as it is about to issue the call; else a timer kills it that long after (mid-call, or a
    # few calls later).
    return rng.randrange(world), rng.randint(3, 120), rng.choice([None, 0.0, 1e-4, 1e-3, 3e-3])


def _kill_rank(rank: int, init: str, world: int, seed: int, env: dict, q) -> None:
    from t3d import soak
    torch, dist = _init(rank, init, world, env)
    with open(f"{init}.pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    pg = dist.group.WORLD
    dist.barrier()  # collective #1: everyone is up
    victim, at, delay = _kill_plan(seed, world)
    cur = {}

    def on_call(spec):
        cur.update(spec=spec, seq=pg._get_sequence_number_for_group(), t=time.monotonic())
        if rank == victim and spec["i"] == at:
            if delay is None:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

    everyone = list(range(world))
    try:
        soak.run_calls(seed, rank, world, 1 << 30, [pg] * 3, [everyone] * 3, on_call=on_call, batches=False,
                       world_only=True, kinds=COLLECTIVES)
    except Exception as exc:  # noqa: BLE001
        c = exc.__cause__ or exc
        with open(f"{init}.pid{victim}") as f:
            vpid = int(f.read())
        _report(q, rank, "raised", time.monotonic() - cur["t"],
                json.dumps({"i": cur["spec"]["i"], "kind": cur["spec"]["kind"], "seq": cur["seq"], "vpid": vpid,
                            "type": type(c).__name__, "msg": str(c)}))
    _report(q, rank, "no error", 0.0, "")


def _check_kill(got: dict, world: int, seed: int, ucx: bool) -> None:
    victim, at, delay = _kill_plan(seed, world)
    survivors = set(range(world)) - {victim}
    assert set(got) == survivors, f"survivors that did not report (hung?): {sorted(survivors - set(got))}: {got}"
    reps = {}
    for r, (what, dt, payload) in got.items():
        assert what == "raised", f"rank {r}: {what}"
        reps[r] = json.loads(payload)
        assert dt < 10, f"rank {r} took {dt:.1f} s to fail (group timeout {PG_TIMEOUT_S:.0f} s)"
    own_c = {}
    for r, p in reps.items():
        shim_op, c_op = NAMES[p["kind"]]
        # Every call is a world collective after the barrier (#1): call i is #i+2 for torch and for t3d alike.
        seq = p["i"] + 2
        assert p["seq"] + 1 == seq, p
        assert p["i"] >= at, f"rank {r} failed at call {p['i']}, before the victim (rank {victim}) died at {at}"
        assert p["type"] == "DistBackendError", p
        head = re.escape(f"t3d: {shim_op} #{seq} on rank {r} of group '0' failed: T3D_ERR_PEER_LOST: ")
        c_head = re.escape(f"t3d: {c_op} #{seq} on group '0' (rank {r} of {world}) ")
        if ucx:  # found by the watch (base/watch.c), or first by UCX (the victim's connection reset)
            lost = (rf"lost rank {victim}( \(pid {p['vpid']} on host '[^']+'\): its connection closed without a goodbye "
                    rf"\(the process died or was killed\)|: its UCX connection failed \(the process died or its host "
                    rf"is unreachable\)); still waiting for rank\(s\) (?P<w>[\d, ]+)")
        else:
            lost = (rf"lost rank {victim}: its process \(pid {p['vpid']}\) has exited; still waiting for rank\(s\) "
                    rf"(?P<w>[\d, ]+) \(shared memory\)")
        m = re.fullmatch(head + f"(?P<c>{c_head}{lost})", p["msg"])
        if m:
            if not ucx:  # the watch fails every wait of the group, whoever it awaits
                assert str(victim) in m.group("w").split(", "), p["msg"]
            own_c[r] = m.group("c")
            continue
        m = re.fullmatch(head + c_head + r"failed: rank (?P<x>\d+) broke the group: (?P<q>.*)", p["msg"])
        assert m, f"rank {r}: unexpected error text: {p['msg']!r}"
        reps[r]["quotes"] = (int(m.group("x")), m.group("q"))
    for r, p in reps.items():
        if "quotes" in p:  # word for word what the rank that found the loss said
            x, quoted = p["quotes"]
            assert x in own_c, f"rank {r} quotes rank {x}, which did not find the loss itself: {p['msg']!r}"
            assert quoted == own_c[x], f"rank {r} quotes {quoted!r}, rank {x} said {own_c[x]!r}"
    assert own_c, "no survivor found the loss itself"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [1, 2])
def test_kill_random_rank_mid_collective_shm(seed):
    world = 4
    got = _dist.spawn_reports(_kill_rank, world, (world, seed, {}), want=set(range(world)) - {_kill_plan(seed, 4)[0]},
                              seconds=60)
    _check_kill(got, world, seed, ucx=False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [1, 2])
def test_kill_random_rank_mid_collective_ucx(seed):
    world = 4
    got = _dist.spawn_reports(_kill_rank, world, (world, seed, {"T3D_TRANSPORT": "ucx"}),
                              want=set(range(world)) - {_kill_plan(seed, 4)[0]}, seconds=60)
    _check_kill(got, world, seed, ucx=True)


def _p2p_rank(rank: int, init: str, n: int, q) -> None:
    torch, dist = _init(rank, init, 3)
    dist.barrier()
    if rank == 2:
        with open(f"{init}.victim", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    x = torch.ones(n)
    pg = dist.group.WORLD
    seq = pg._get_sequence_number_for_group()
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.recv(x, src=2)
        else:
            for _ in range(10000):  # small: until the ring to rank 2 is full; large: the first waits for its reader
                seq = pg._get_sequence_number_for_group()
                dist.send(x, dst=2)
        _report(q, rank, "no error", 0.0, "")
    except Exception as exc:  # noqa: BLE001
        with open(f"{init}.victim") as f:
            vpid = f.read()
        _report(q, rank, "raised", time.monotonic() - t0, json.dumps({"seq": seq, "vpid": vpid, "msg": str(exc)}))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [10, 100000], ids=["eager", "rendezvous"])
def test_kill_rank_under_point_to_point(n):
    got = _dist.spawn_reports(_p2p_rank, 3, (n,), want={0, 1}, seconds=40)
    assert set(got) == {0, 1}, f"a rank did not report (hung?): {got}"
    for r, (what, dt, payload) in got.items():
        assert what == "raised", f"rank {r}: {what}"
        assert dt < 10, f"rank {r} took {dt:.1f} s"
        p = json.loads(payload)
        op, dirn = ("recv", "recv from") if r == 0 else ("send", "send to")
        want = (f"t3d: {op} #{p['seq'] + 1} on rank {r} of group '0' failed: T3D_ERR_PEER_LOST: t3d: {dirn} rank 2 on "
                f"group '0' (rank {r}, tag 0) lost rank 2: its process (pid {p['vpid']}) has exited")
        assert p["msg"] == want, f"rank {r}"


# ---------------------------------------------------------------------------------------------------------------
# A rank that never arrives
# ---------------------------------------------------------------------------------------------------------------

def _absent_rank(rank: int, init: str, where: str, q) -> None:
    env = {"T3D_TIMEOUT_MS": "1500"}
    if where == "init" and rank == 2:
        q.put((rank, "idle", 0.0, ""))
        time.sleep(60)
        os._exit(0)
    os.environ.update(env)
    import t3d  # noqa: F401  (and torch: imported before the clock starts, which a loaded host slows, not t3d)
    t0 = time.monotonic()
    try:
        torch, dist = _init(rank, init, 3, env)
        x = torch.ones(10)
        dist.all_reduce(x)  # #1
        if rank == 2:
            q.put((rank, "idle", 0.0, ""))
            time.sleep(60)
            os._exit(0)
        t0 = time.monotonic()
        dist.all_reduce(x)  # #2: rank 2 never comes
        _report(q, rank, "no error", 0.0, "")
    except Exception as exc:  # noqa: BLE001
        # When the call started and when it failed, on the host's monotonic clock (one clock for all the ranks).
        _report(q, rank, "raised", (t0, time.monotonic()), f"{type(exc).__name__}: {exc}")


@pytest.mark.timeout(90)
def test_rank_never_calls_the_collective():
    got = _dist.spawn_reports(_absent_rank, 3, ("collective",), want={0, 1}, seconds=40)
    assert set(got) == {0, 1}, f"a rank did not report (hung?): {got}"
    timed_out = ("t3d: allreduce #2 on group '0' (rank {r} of 3) timed out (timeout 1500 ms); still waiting for "
                 "rank(s) 2 (shared memory)")
    assert all(what == "raised" for what, _, _ in got.values()), got
    first_start = min(start for _, (start, _), _ in got.values())
    for r, (what, (start, end), msg) in got.items():
        # No rank fails before the timeout has passed since the first rank called: a rank told by a peer that timed
        # out fails as much sooner (after its own start) as it called later, which a loaded host stretches.
        assert end - first_start >= 1.45, f"rank {r} raised {end - first_start:.2f} s after the first rank called"
        assert end - start < 6.5, f"rank {r} raised after {end - start:.2f} s (T3D_TIMEOUT_MS 1500)"
        head = f"DistBackendError: t3d: allreduce #2 on rank {r} of group '0' failed: T3D_ERR_TIMEOUT: "
        # Its own timeout, or the other waiting rank's, quoted (whichever fired first told the other).
        assert msg in (head + timed_out.format(r=r),
                       head + f"t3d: allreduce #2 on group '0' (rank {r} of 3) failed: rank {1 - r} broke the group: "
                       + timed_out.format(r=1 - r)), f"rank {r}: {msg!r}"


@pytest.mark.timeout(90)
def test_rank_never_calls_init():
    got = _dist.spawn_reports(_absent_rank, 3, ("init",), want={0, 1}, seconds=40)
    assert set(got) == {0, 1}, f"a rank did not report (hung?): {got}"
    for r, (what, times, msg) in got.items():
        assert what == "raised", f"rank {r}: {what}"
        assert times[1] - times[0] < 10, f"rank {r} raised after {times[1] - times[0]:.2f} s (T3D_TIMEOUT_MS 1500)"
        # The communicator's set-up waits for rank 2's address in the store; the error names the missing rank.
        assert msg == (f"DistBackendError: t3d: creating the communicator of group '0' on rank {r} of 3 failed: "
                       f"T3D_ERR_TIMEOUT: t3d: store get of 't3d/ucx/2' failed on rank {r} of group '0' after 1500 "
                       f"ms: T3D_ERR_TIMEOUT (rank 2 never published it: it has not reached the creation of this "
                       f"group, or has died)"), f"rank {r}: {msg!r}"


# ---------------------------------------------------------------------------------------------------------------
# Desync: ranks call different collectives
# ---------------------------------------------------------------------------------------------------------------

def _desync_rank(rank: int, init: str, case: str, q) -> None:
    torch, dist = _init(rank, init, 2, {"T3D_TIMEOUT_MS": "20000"})
    dist.barrier()  # #1
    t0 = time.monotonic()
    try:
        if case == "size":
            dist.all_reduce(torch.ones(16 if rank == 0 else 32))
        elif case == "size_large":
            dist.all_reduce(torch.ones(100000 if rank == 0 else 200000))
        elif case == "op":
            x = torch.ones(16)
            if rank == 0:
                dist.all_gather_into_tensor(torch.empty(32), x)
            else:
                dist.reduce_scatter_tensor(torch.empty(8), x)
        elif case == "dtype":
            dist.all_reduce(torch.ones(16, dtype=torch.float32 if rank == 0 else torch.int32))
        elif case == "redop":
            dist.all_reduce(torch.ones(16), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        elif case == "root":
            dist.broadcast(torch.full((16,), float(rank)), src=rank)
            # Each rank took itself for the root: one that came first had nobody to compare with and returned (its
            # own data, as its call asked); the second one finds the mismatch and reports it, so the first one's
            # next call fails.
            dist.barrier()
        _report(q, rank, "no error", time.monotonic() - t0, "")
    except Exception as exc:  # noqa: BLE001
        _report(q, rank, "raised", time.monotonic() - t0, str(exc))


# case: {rank: (torch's op, t3d's op, bytes, its fingerprint as t3d words it)}, and what the ranks disagree on
DESYNC = {
    "size": ({0: ("allreduce", "allreduce", 64, "float32, sum"), 1: ("allreduce", "allreduce", 128, "float32, sum")},
             "its size"),
    "size_large": ({0: ("allreduce", "allreduce", 400000, "float32, sum"),
                    1: ("allreduce", "allreduce", 800000, "float32, sum")}, "its size"),
    "op": ({0: ("_allgather_base", "allgather", 128, "float32"),
            1: ("_reduce_scatter_base", "reduce_scatter", 64, "float32, sum")}, "the operation"),
    "dtype": ({0: ("allreduce", "allreduce", 64, "float32, sum"), 1: ("allreduce", "allreduce", 64, "int32, sum")},
              "its dtype, reduce op or root"),
    "redop": ({0: ("allreduce", "allreduce", 64, "float32, sum"), 1: ("allreduce", "allreduce", 64, "float32, max")},
              "its dtype, reduce op or root"),
    "root": ({0: ("broadcast", "broadcast", 64, "float32, root 0"), 1: ("broadcast", "broadcast", 64,
                                                                         "float32, root 1")},
             "its dtype, reduce op or root"),
}
# Roots read no other rank's data: the one that comes second finds the other's line in the same step
# (t3d__shm_check_sole_writer); the first returns and is told in its next call.
TOLD_LATER = {"root"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DESYNC))
def test_desync_raises_on_every_rank_saying_what_each_called(case):
    got = _dist.spawn_reports(_desync_rank, 2, (case,), want={0, 1}, seconds=40)
    assert set(got) == {0, 1}, f"a rank did not report (hung?): {got}"
    calls, differ = DESYNC[case]
    for r, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {r}: {what} (the ranks called different collectives)"
        assert dt < 10, f"rank {r} took {dt:.1f} s"
        p = 1 - r
        shim, mine, nbytes, myfp = calls[r]
        _, theirs, pbytes, theirfp = calls[p]
        head = f"t3d: {shim} #2 on rank {r} of group '0' failed: T3D_ERR_MISMATCH: "
        ctx = f"t3d: {mine} #2 on group '0' (rank {r} of 2)"
        # Found here, or found by the peer and quoted (then in the peer's words).
        def said(who, other, op, nb, fp, oop, onb, ofp):  # rank `who`'s words about rank `other`
            peer_call = f"{oop} of {onb} bytes ({ofp})"
            return (f"t3d: {op} #2 on group '0' (rank {who} of 2): rank {other} runs {peer_call} where this rank runs "
                    f"{op} of {nb} bytes ({fp}) (ranks disagree on {differ})")
        found = said(r, p, mine, nbytes, myfp, theirs, pbytes, theirfp)
        told = f"{ctx} failed: rank {p} broke the group: " + said(p, r, theirs, pbytes, theirfp, mine, nbytes, myfp)
        if case in TOLD_LATER:  # the first rank is told in its next call, the barrier
            told = (f"t3d: barrier #3 on rank {r} of group '0' failed: T3D_ERR_MISMATCH: t3d: barrier #3 on group '0' "
                    f"(rank {r} of 2) failed: rank {p} broke the group: "
                    + said(p, r, theirs, pbytes, theirfp, mine, nbytes, myfp))
            assert msg in (head + found, told), f"rank {r}: {msg!r}"
            continue
        assert msg in (head + found, head + told), f"rank {r}: {msg!r}"


# ---------------------------------------------------------------------------------------------------------------
# /dev/shm too small (a private tmpfs in a mount namespace of its own)
# ---------------------------------------------------------------------------------------------------------------

def _small_shm_rank(rank: int, init: str, q) -> None:
    t0 = time.monotonic()
    try:
        torch, dist = _init(rank, init, 2)
        dist.all_reduce(torch.ones(10))
        _report(q, rank, "no error", time.monotonic() - t0, "")
    except Exception as exc:  # noqa: BLE001
        _report(q, rank, "raised", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")


def _can_unshare() -> bool:
    try:
        return os.geteuid() == 0 and subprocess.run(["unshare", "--mount", "true"], capture_output=True,
                                                    timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_small_shm(size: str, env: dict) -> dict:
    """Runs _small_shm_rank on 2 ranks with a tmpfs of `size` over /dev/shm; returns their reports."""
    code = ("import json, sys; sys.path.insert(0, %r); import _dist, test_faults; "
            "print('REPORT', json.dumps(_dist.spawn_reports(test_faults._small_shm_rank, 2, (), want={0, 1}, "
            "seconds=40)))" % HERE)
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    p = subprocess.run(["unshare", "--mount", "sh", "-c", script, code], capture_output=True, text=True, timeout=80,
                       env=dict(os.environ, **env), cwd=HERE)
    line = [x for x in p.stdout.splitlines() if x.startswith("REPORT ")]
    assert line, f"no report (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return {int(k): v for k, v in json.loads(line[0][7:]).items()}


SEGMENT_ERR = ("cannot reserve (\\d+) bytes in /dev/shm for the shared-memory segment of group '0' \\(2 ranks x 2097152 "
               "bytes; T3D_SHM_BYTES sets the bytes per rank\\): No space left on device; free space in /dev/shm "
               "\\(df -h /dev/shm\\), lower T3D_SHM_BYTES, set T3D_SHM_P2P_STAGE_BYTES=0 \\(drops (\\d+) bytes of "
               "point-to-point staging areas\\), or set T3D_TRANSPORT=ucx")


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --mount")
@pytest.mark.timeout(120)
def test_dev_shm_too_small_for_the_segment():
    # UCX kept off /dev/shm (its TCP transport): t3d's own segment is what does not fit.
    got = _in_small_shm("64k", {"UCX_TLS": "tcp,self"})
    assert set(got) == {0, 1}, f"a rank did not report (hung or crashed?): {got}"
    sizes = set()
    for r, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {r}: {what}"
        assert dt < 30, f"rank {r} took {dt:.1f} s"
        head = f"DistBackendError: t3d: creating the communicator of group '0' on rank {r} of 2 failed: "
        inner = (f"T3D_ERR_NO_MEMORY: t3d_comm_init: rank 0 of group '0': " if r == 0 else
                 f"T3D_ERR_SYSTEM: t3d_comm_init: rank 1 of group '0': rank 0 could not set up shared memory: ")
        m = re.fullmatch(re.escape(head + inner) + SEGMENT_ERR, msg)
        assert m, f"rank {r}: {msg!r}"
        sizes.add(int(m.group(1)))
        # two areas of a page and 2 MiB, and the padding to the page they start on
        assert 0 <= int(m.group(2)) - 2 * (4096 + (2 << 20)) < 4096, f"rank {r}: staging bytes {m.group(2)}"
    assert len(sizes) == 1 and sizes.pop() > 64 * 1024


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --mount")
@pytest.mark.timeout(120)
def test_dev_shm_too_small_default_transports():
    got = _in_small_shm("64k", {})
    assert set(got) == {0, 1}, f"a rank did not report (hung or crashed?): {got}"
    for r, (what, dt, msg) in got.items():
        assert what == "raised", f"rank {r}: {what}"
        assert dt < 30, f"rank {r} took {dt:.1f} s"
        assert msg.startswith(f"DistBackendError: t3d: creating the communicator of group '0' on rank {r} of 2 "
                              f"failed: "), msg
        # UCX's own shared memory does not fit before t3d's segment is tried: the error says where, and what to do.
        ucx = (rf"T3D_ERR_TRANSPORT: t3d: UCX call ucp_worker_create failed: [^(]+ \(rank {r}, group '0'\); UCX's "
               rf"shared-memory transports need room in /dev/shm \(\d+ KiB free here\): free some \(df -h /dev/shm\), "
               rf"or keep UCX off it with UCX_TLS=\^posix,sysv,cma \(or UCX_TLS=tcp\)")
        assert re.search(ucx, msg), f"rank {r}: {msg!r}"


# ---------------------------------------------------------------------------------------------------------------
# A port already in use
# ---------------------------------------------------------------------------------------------------------------

def _port_rank(rank: int, init: str, port: int, q) -> None:
    t0 = time.monotonic()
    try:
        import torch.distributed as dist

        import t3d  # noqa: F401
        dist.init_process_group("t3d", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=3))
        _report(q, rank, "no error", time.monotonic() - t0, "")
    except Exception as exc:  # noqa: BLE001
        _report(q, rank, "raised", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")


@pytest.mark.timeout(90)
def test_master_port_already_in_use():
    # t3d takes only ephemeral ports (its watch, UCX's TCP transport): the rendezvous port is torch's.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: the store's server cannot bind, its clients are refused
        port = s.getsockname()[1]
        got = _dist.spawn_reports(_port_rank, 2, (port,), want={0, 1}, seconds=60)
    assert set(got) == {0, 1}, f"a rank did not report (hung?): {got}"
    what, dt, msg = got[0]
    assert what == "raised" and dt < 30, got[0]
    assert msg == (f"DistNetworkError: The server socket has failed to listen on any local network address. port: "
                   f"{port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"), msg
    what, dt, msg = got[1]
    assert what == "raised" and dt < 40, got[1]  # refused until the 3 s timeout, then an error: not a hang
