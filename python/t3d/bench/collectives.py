"""`t3d-bench collectives`: nccl-tests style collective benchmark through torch.distributed, backends side by side.

For each backend (t3d, gloo, and Open MPI through mpi4py when installed) N CPU processes run each op over a range of
sizes and report time, algbw and busbw with nccl-tests' formulas, plus a correctness check. Every row is set against
the best peer in the same run and against its floor: the op's least traffic (every input byte read once, every
output byte written once) at B_all, the copy bandwidth of every core copying at once, measured in the same run
(docs/benchmarks/README.md; no floor where the row's buffers fit in the caches). all_reduce rows also get torch's
dispatch floor: the same loop on a "fake" process group, which does no communication, timed in the same processes
between t3d's batches.

    t3d-bench collectives --nproc 2 [--backends t3d,gloo,mpi] [--ops all_reduce,...] [--min 8] [--max 256M]
    t3d-bench collectives --render docs/benchmarks/collectives-8ranks.json   (re-render a saved run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from . import mpi_peer
# The op spec (which ops, buffer sizes, inputs, expected outputs, bus factors, calls per row), shared with the MPI
# peer; OPS, bus_factor, iters_for and ROW_BUDGET_S stay importable from here.
from .opspec import (OPS, POISON, ROOT, ROW_BUDGET_S, WARMUP_CALLS, budget_iters, bus_factor, counts, input_value,
                     iters_for, output_ok, ring_peers, row, runs_on)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            text, mult = text[:-1], m
    return int(float(text) * mult)


def sizes_between(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if s < (1 << 20) else 2
    return out


# ---------------------------------------------------------------- one rank, torch.distributed backends

def _check_output(run, out, ok):
    """A check for an op whose inputs never change: poison the output, run once, test it with ok()."""
    def check():
        out.fill_(POISON)
        run()
        return bool(ok())
    return check


# all_reduce's timed data: negative zero, whose sum in place stays negative zero, 0x80000000 in every element.
TIMED_ALL_REDUCE_VALUE = -0.0


def _make_op(op: str, nbytes: int, rank: int, n: int, dist, torch, group=None, device=None, mem=False):
    """Buffers, a callable that runs the op once, a check, and the message size S in bytes. `group` (all_reduce
    only, for the dispatch floor): run on that group instead of the world. Sizes, inputs and expected outputs are
    opspec's, as for the MPI peer.

    As in nccl-tests, the timed callable only communicates: it does not re-initialise its buffers (the fill would
    be timed too, and at 8 ranks on 2 cores filling 16 MiB costs a quarter of the all_reduce). The check sets known
    inputs, runs the op once more, compares every element with the value it must have, and leaves the buffers as
    the timed loop expects them (all_reduce: -0.0, TIMED_ALL_REDUCE_VALUE)."""
    n_in, n_out, size_b = counts(op, nbytes, n)
    value = input_value(op, rank, n)
    dev = {"device": device}
    if mem:  # t3d-mem: the buffers in t3d memory (t3d.mem), which the ranks map from each other
        import t3d.mem

        zeros, empty = t3d.mem.zeros, t3d.mem.empty
    else:
        zeros, empty = (lambda k: torch.zeros(k, **dev)), (lambda k: torch.empty(k, **dev))
    if op == "all_reduce":
        # Timed in place on -0.0, which a sum leaves as it is (repeating never overflows) and whose bytes are not
        # zero: this host writes all-zero lines 1.5-4x faster than any others (docs/benchmarks/README.md).
        x = empty(n_in).fill_(TIMED_ALL_REDUCE_VALUE)
        group = dist.group.WORLD if group is None else group  # passed explicitly either way: the same call

        def check():
            # The warm-up calls (the timed loop's body, just before) left -0.0 as it was, not +0.0; then the check.
            ok = bool(torch.signbit(x).all()) and not bool(x.any())
            x.fill_(value)
            dist.all_reduce(x, group=group)
            ok = output_ok(op, rank, n, x) and ok
            x.fill_(TIMED_ALL_REDUCE_VALUE)
            return ok
        return (lambda: dist.all_reduce(x, group=group)), check, size_b
    if op == "broadcast":
        x = zeros(n_in)

        def run():
            dist.broadcast(x, src=ROOT)

        def check():
            x.fill_(value)
            run()
            return output_ok(op, rank, n, x)
        return run, check, size_b
    x = empty(n_in).fill_(value)
    out = empty(n_out)
    if op == "all_gather":
        run = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
    elif op == "reduce_scatter":
        run = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
    elif op == "all_to_all":
        run = lambda: dist.all_to_all_single(out, x)  # noqa: E731
    else:
        to, frm = ring_peers(rank, n)

        def run():  # ring shift: everyone sends and receives once
            ops = [dist.P2POp(dist.isend, x, to), dist.P2POp(dist.irecv, out, frm)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
    return run, _check_output(run, out, lambda: output_ok(op, rank, n, out)), size_b


def _budget_iters(iters: int, warm_call_s: float, max_over_ranks) -> int:
    return budget_iters(iters, max_over_ranks(warm_call_s))


def _max_over_ranks(x: float, dist, torch, device=None) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# An all_reduce row's timed iterations are split into up to this many batches. Before each batch the same loop body
# runs on a no-op "fake" process group in the same processes: the dispatch floor, measured under the same conditions
# (this machine's speed drifts by tens of percent over seconds, and 8 processes share 2 cores). Other rows run their
# calls back to back after one barrier, as the MPI peer and nccl-tests do.
BATCHES = 5
# Each batch starts at a barrier, which the ranks leave at different times (with 8 processes on 2 cores, up to a
# time slice apart): a batch has at least this many calls, so that the skew is not charged to one call alone.
MIN_BATCH_CALLS = 4
SMALL_MAX = 4 << 10  # all_reduce rows up to this size, with more ranks than cores, also time one switch per call


def _timed(run, iters: int, sync=None) -> float:
    """Seconds for iters calls; with sync (a CUDA device's synchronize), until the device has finished them."""
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def _rank_main(rank: int, n: int, backend: str, init: str, ops: list[str], sizes: list[int], out_q,
               device_type: str = "cpu") -> None:
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    mem = backend == "t3d-mem"  # t3d on buffers in t3d memory
    if mem:
        backend = "t3d"
    if backend == "t3d":
        import t3d  # noqa: F401
    torch.set_num_threads(1)
    device, sync = None, None
    if device_type == "cuda":  # rank r on GPU r % count (run() has refused peers that cannot share one)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
    dist.init_process_group(backend, init_method=f"file://{init}" if init else "env://", rank=rank, world_size=n,
                            timeout=timedelta(seconds=300))
    # The dispatch floor (a no-op "fake" group) is a CPU-side measure: CUDA rows go without it.
    fake = dist.new_group(backend="fake") if "all_reduce" in ops and device is None else None
    # A fresh process runs its first calls slowly (lazy binding, first-touch page faults, cold caches): warm the whole
    # call path up once before the first row, which would otherwise carry it alone.
    for group in (None, fake) if fake is not None else (None,):
        warm_run = _make_op("all_reduce", 8, rank, n, dist, torch, group=group, device=device)[0]
        for _ in range(WARMUP_CALLS):
            warm_run()
    dist.barrier()
    rows = []
    try:
        for op in ops:
            if not runs_on(op, n):
                continue
            for nbytes in sizes:
                run, check, size_b = _make_op(op, nbytes, rank, n, dist, torch, device=device, mem=mem)
                floor_run = (_make_op(op, nbytes, rank, n, dist, torch, group=fake)[0]
                             if op == "all_reduce" and fake is not None else None)
                # With more ranks than cores, a call that needs every rank's input waits for ranks that are not
                # running, so each rank gives up its core about once per call: the same no-op loop with one yield
                # per call shows what that alone costs (its caches and TLB are cold when it runs again).
                switch_run = None
                if floor_run is not None and n > (os.cpu_count() or 1) and nbytes <= SMALL_MAX:
                    def switch_run(f=floor_run):
                        f()
                        os.sched_yield()
                warm, iters = iters_for(nbytes)
                t0 = time.perf_counter()
                for _ in range(warm):
                    run()
                    if floor_run is not None:
                        floor_run()
                if sync is not None:
                    sync()
                iters = _budget_iters(iters, (time.perf_counter() - t0) / warm,
                                      lambda t: _max_over_ranks(t, dist, torch, device))
                ok = check()
                batches = max(1, min(BATCHES if floor_run is not None else 1, iters // MIN_BATCH_CALLS))
                per = max(1, iters // batches)
                spent = floor_spent = switch_spent = 0.0
                for _ in range(batches):
                    if floor_run is not None:  # all ranks at once, as in the timed batch
                        dist.barrier()
                        floor_spent += _timed(floor_run, per)
                    if switch_run is not None:
                        dist.barrier()
                        switch_spent += _timed(switch_run, per)
                    dist.barrier()
                    spent += _timed(run, per, sync)
                # the slowest rank's time is the op's time, as in nccl-tests
                calls = per * batches
                stat = torch.tensor([spent / calls, floor_spent / calls, 0.0 if ok else 1.0, switch_spent / calls],
                                    dtype=torch.float64, device=device)
                dist.all_reduce(stat, op=dist.ReduceOp.MAX)
                r = row(op, size_b, stat[0].item(), stat[2].item() == 0)
                if floor_run is not None:
                    r["floor_us"] = stat[1].item() * 1e6
                if switch_run is not None:
                    r["switch_floor_us"] = stat[3].item() * 1e6
                rows.append(r)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out_q.put(rows)


def run_torch_backend(backend: str, n: int, ops: list[str], sizes: list[int], timeout: float,
                      device_type: str = "cpu") -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, n, backend, os.path.join(tmp, "init"), ops, sizes, q,
                                                      device_type)) for r in range(n)]
        for p in procs:
            p.start()
        try:
            rows = q.get(timeout=timeout)
        except Exception as exc:
            raise RuntimeError(f"backend {backend}: no result within {timeout:.0f} s "
                               f"(exit codes {[p.exitcode for p in procs]})") from exc
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return rows


# ---------------------------------------------------------------- Open MPI through mpi4py

MPI_HINT = ("install it with ./scripts/install-mpi-peer.sh: Debian's openmpi-bin + libopenmpi-dev and PyPI's "
            "mpi4py==4.1.2 into the project venv")


def mpi_available() -> str | None:
    """None when Open MPI + mpi4py can run here, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return f"mpi4py is not installed ({MPI_HINT})"
    if shutil.which("mpirun") is None:
        return f"mpirun is not on PATH ({MPI_HINT})"
    return None


def run_mpi(n: int, ops: list[str], sizes: list[int], timeout: float) -> list[dict]:
    """The rows of mpi_peer.py run under mpirun on n ranks (each rank's loop mirrors _rank_main's)."""
    env = dict(os.environ, OMPI_MCA_btl="self,vader", OMP_NUM_THREADS="1")
    res = subprocess.run(mpi_peer.command(n, ops, sizes, ROW_BUDGET_S), capture_output=True, text=True,
                         timeout=timeout, env=env)
    rows = mpi_peer.parse_output(res.stdout)
    if rows is None:
        raise RuntimeError(f"mpirun failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    return rows


# ---------------------------------------------------------------- reference: copy bandwidth

COPY_TEST_BYTES = 64 << 20  # each copy's source (well beyond the caches); its destination is as large


def _stream_copier():
    """libt3d's copy with non-temporal stores (t3d_copy_stream) as a callable on numpy arrays, or None. ctypes
    releases the GIL for the call, so threads copy at once."""
    import ctypes

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        lib = ctypes.CDLL(os.path.join(here, "libt3d.so.0"))
        fn = lib.t3d_copy_stream
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lambda dst, src: fn(dst.ctypes.data, src.ctypes.data, dst.nbytes)


def copy_bandwidth(threads: int = 1) -> float:
    """Read+write bytes per second of `threads` copies of 64 MiB, one per thread, all started at once; best of 7
    rounds of each of three copies: np.copyto (a plain memcpy, without the GIL), libt3d's copy with non-temporal
    stores (which skip reading the destination first) and the same copy rewriting its source in place (on the
    development machine, a virtual one, reading and writing the same lines moves bytes faster than writing other
    ones). t3d's collectives use such stores on large buffers, and all_reduce runs in place, so a floor must count
    the fastest of them."""
    import threading

    import numpy as np

    pairs = [(np.ones(COPY_TEST_BYTES, dtype=np.uint8), np.zeros(COPY_TEST_BYTES, dtype=np.uint8))
             for _ in range(threads)]
    stream = _stream_copier()
    copies = [lambda d, s: np.copyto(d, s)]
    if stream is not None:
        copies += [stream, lambda d, s: stream(s, s)]
    start = threading.Barrier(threads)
    rounds = 7
    spans = [[None] * threads for _ in range(rounds * len(copies))]  # per round and thread: (start, end)

    def copier(i, src, dst):
        k = 0
        for copy in copies:
            for _ in range(rounds):
                start.wait()
                t0 = time.perf_counter()
                copy(dst, src)
                spans[k][i] = (t0, time.perf_counter())
                k += 1

    workers = [threading.Thread(target=copier, args=(i, *pair), daemon=True) for i, pair in enumerate(pairs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    # A round lasts from its first copy's start to its last copy's end (each thread times its own copy: a thread
    # that waits for the GIL after the barrier would otherwise start the clock late).
    best = min(max(e for _, e in r) - min(b for b, _ in r) for r in spans)
    return 2 * COPY_TEST_BYTES * threads / best


def copy_bandwidth_all_cores() -> float:
    """The whole machine's copy bandwidth: one copy per core at once. The ceiling of any scheme's copying."""
    return copy_bandwidth(os.cpu_count() or 1)


# ---------------------------------------------------------------- report

def human(nbytes: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= m:
            return f"{nbytes / m:g} {unit}"
    return f"{nbytes} B"


def least_traffic_factor(op: str, n: int) -> float:
    """Bytes read plus bytes written, over S, that no scheme can go below, single copy from the owner's buffer
    included: every input byte is read once and every output byte written once (the destination of a copy from
    another process's buffer must be written too). all_reduce: n inputs read, n results written; all_gather (S the
    whole output): the blocks read once, n outputs written; reduce_scatter (S the whole input): n inputs read, S of
    results; all_to_all: n send buffers read, n receive buffers written; broadcast: the root's S read, n-1 copies
    written; send/recv ring shift: n messages read and written."""
    return {"all_reduce": 2 * n, "all_gather": n + 1, "reduce_scatter": n + 1, "all_to_all": 2 * n,
            "broadcast": n, "send_recv": 2 * n}[op]


def working_set_factor(op: str, n: int) -> float:
    """Bytes of user buffers of all ranks together, over S: the least traffic's, since it reads every input byte and
    writes every output byte once, except for all_reduce, whose n results overwrite its n inputs in place."""
    return n if op == "all_reduce" else least_traffic_factor(op, n)


def fastest_possible_us(op: str, n: int, size: int, B_all: float) -> float | None:
    """A floor on any implementation's time for this row: its least traffic at the whole machine's copy bandwidth.
    None where all ranks' buffers together are smaller than one copy of the copy test (64 MiB): those may be served
    from the caches faster than B_all, so it is no floor for them."""
    if working_set_factor(op, n) * size < COPY_TEST_BYTES:
        return None
    return least_traffic_factor(op, n) * size / B_all * 1e6


def _header(results: dict, n: int, cores: int, skipped: dict) -> list[str]:
    """The lines above the tables: the machine, the floor, the dispatch floors, how the loops are timed."""
    lines = [f"# t3d-bench collectives: {n} ranks",
             "",
             f"Machine: {platform.processor() or platform.machine()}, {cores} cores; "
             f"load average at start {results['_load']:.1f}."]
    if results.get("_device"):
        lines.append(f"Device: CUDA tensors, {results.get('_gpu_layout', 'one GPU per rank')} ({results['_device']}); "
                     "timed loops end with a device synchronisation; no floor (the host's copy bandwidth bounds "
                     "nothing on a GPU).")
    B_all = results.get("_copy_all_cores")
    if results.get("_device"):
        pass
    elif B_all:
        lines.append("Floor: the row's least traffic (every input byte read once, every output byte written once) "
                     f"at B_all = {B_all / 1e9:.1f} GB/s, the copy bandwidth of every core copying at once, measured "
                     "in this run (the best of plain, non-temporal and in-place copies"
                     + (", the best of its probes at the start and after each backend's run: "
                        + ", ".join(f"{b / 1e9:.1f}" for b in results["_copy_all_cores_runs"])
                        + " GB/s" if results.get("_copy_all_cores_runs") else "")
                     + "); the floor column is at B_all. 'X at floor' is X's floor over X's time, the floor taken at "
                     + ("the bandwidth measured beside each of X's runs (per run the faster of the probes before and "
                        "after it; medians " + ", ".join(
                         f"{b} {v / 1e9:.1f}" for b, v in results["_copy_beside"].items()) + " GB/s), since this "
                        "shared machine's bandwidth moves within a run: each run's floor over that run's time, the "
                        "median over the runs" if results.get("_copy_beside") else "B_all")
                     + ". No floor where the row's buffers fit in the caches (docs/benchmarks/README.md).")
    else:
        lines.append("Floor: this run did not measure the all-core copy bandwidth B_all, so no row has one.")
    t3d_rows = results.get("t3d", [])
    if any("floor_us" in r for r in t3d_rows):
        lines.append("torch dispatch floor (all_reduce rows): the same loop body (dist.all_reduce) on a no-op "
                     "'fake' process group, timed in the same rank processes in batches interleaved with t3d's "
                     "(slowest rank). 't3d - dispatch floor' is what t3d adds to it.")
    if any("switch_floor_us" in r for r in t3d_rows):
        lines.append("With more ranks than cores, 'dispatch floor, one switch per call' runs that no-op loop with one "
                     "os.sched_yield() after each call: a collective that needs every rank's input waits for ranks "
                     "that are not running, so each rank gives up its core about once per call, and this is what "
                     "that alone costs.")
    lines.append("Timed loops only communicate (as in nccl-tests): buffers are not re-initialised inside them; the "
                 "check sets known inputs and runs the op once more. Their data is never all-zero bytes (all_reduce "
                 "sums -0.0 in place), which this kind of host writes faster than any other. They run back to back "
                 f"after a barrier (all_reduce rows in up to {BATCHES} batches of at least {MIN_BATCH_CALLS} calls, "
                 "between the dispatch floor's).")
    if results.get("_repeat", 1) > 1:
        lines.append(f"Every backend ran {results['_repeat']} times, the backends taking turns; each time below is "
                     "the median of its runs (the JSON has every run's).")
    for name, why in skipped.items():
        lines.append(f"Skipped {name}: {why}")
    return lines


def beside_runs(results: dict) -> dict:
    """{backend: [the copy bandwidth beside each of its runs]}: the run's own list, or, for a run saved before it
    kept one, rebuilt from its probes (one at the start, one after each backend's run, the backends taking turns in
    the order the results list them); {} where the probes do not add up (a backend skipped midway)."""
    if results.get("_copy_beside_runs"):
        return results["_copy_beside_runs"]
    probes, backends = results.get("_copy_all_cores_runs") or [], [b for b in results if not b.startswith("_")]
    repeat = results.get("_repeat", 1)
    if not backends or len(probes) != 1 + repeat * len(backends):
        return {}
    return {b: [max(probes[k * len(backends) + i], probes[k * len(backends) + i + 1]) for k in range(repeat)]
            for i, b in enumerate(backends)}


def _at_floor(op: str, n: int, size: int, B: float, row: dict | None, B_runs: list | None = None) -> str:
    """The row's share of its floor's speed, as a cell: with each run's bandwidth (B_runs, measured beside that run),
    the median over the runs of that run's floor over that run's time; else the floor at B over the row's time."""
    if not row:
        return "-"
    times = row.get("time_us_runs")
    if B_runs and times and len(times) == len(B_runs):
        return f"{100 * statistics.median(fastest_possible_us(op, n, size, b) / t for b, t in zip(B_runs, times)):.0f}%"
    return f"{100 * fastest_possible_us(op, n, size, B) / row['time_us']:.0f}%"


def _op_table(results: dict, op: str, n: int) -> list[str]:
    """One op's table: each backend's time and busbw, each peer's and the best peer's time over t3d's, the floor and
    t3d's share of its speed, the all_reduce dispatch floors, the check."""
    backends = [b for b in results if not b.startswith("_")]
    # t3d's own variants (t3d-mem: its buffers in t3d memory) are no peers: they get their own floor and best-peer
    # columns
    variants = [b for b in backends if b.startswith("t3d-")]
    peers = [b for b in backends if b != "t3d" and b not in variants] if "t3d" in backends else []
    B_all = results.get("_copy_all_cores")
    beside, per_run = results.get("_copy_beside") or {}, beside_runs(results)
    t3d_rows = results.get("t3d", [])
    with_dispatch = op == "all_reduce" and any("floor_us" in r for r in t3d_rows)
    with_switch = op == "all_reduce" and any("switch_floor_us" in r for r in t3d_rows)
    head = ["size"] + [f"{b} {what}" for b in backends for what in ("time (us)", "busbw (GB/s)")]
    head += [f"{p} / t3d" for p in peers] + (["best peer / t3d"] if peers else []) + ["floor (us)"]
    head += ["t3d at floor"] if "t3d" in backends else []
    for v in variants:
        head += [f"{v} at floor"] + ([f"best peer / {v}"] if peers else [])
    head += ["torch dispatch floor (us)", "t3d - dispatch floor (us)"] if with_dispatch else []
    head += ["dispatch floor, one switch per call (us)"] if with_switch else []
    head += ["check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {b: {r["bytes"]: r for r in results[b] if r["op"] == op} for b in backends}
    for size in sorted({s for b in backends for s in by[b]}):
        cells, wrong = [human(size)], 0
        for b in backends:
            r = by[b].get(size)
            if r is None:
                cells += ["-", "-"]
                continue
            cells += [f"{r['time_us']:.1f}", f"{size / (r['time_us'] * 1e-6) * bus_factor(op, n) / 1e9:.3f}"]
            wrong += r["wrong"]
        a = by.get("t3d", {}).get(size)
        ratios = {p: by[p][size]["time_us"] / a["time_us"] for p in peers if a and size in by[p]}
        cells += [f"{ratios[p]:.2f}x" if p in ratios else "-" for p in peers]
        if peers:
            best = min(ratios, key=ratios.get, default=None)
            cells.append(f"{ratios[best]:.2f}x ({best})" if best is not None else "-")
        floor = fastest_possible_us(op, n, size, B_all) if B_all else None
        cells.append(f"{floor:.0f}" if floor is not None else "-")
        if "t3d" in backends:
            cells.append(_at_floor(op, n, size, beside.get("t3d", B_all), a, per_run.get("t3d"))
                         if floor is not None else "-")
        for v in variants:
            rv = by[v].get(size)
            cells.append(_at_floor(op, n, size, beside.get(v, B_all), rv, per_run.get(v)) if floor is not None else "-")
            if peers:
                pv = {p: by[p][size]["time_us"] / rv["time_us"] for p in peers if rv and size in by[p]}
                bv = min(pv, key=pv.get, default=None)
                cells.append(f"{pv[bv]:.2f}x ({bv})" if bv is not None else "-")
        if with_dispatch:
            cells += [f"{a['floor_us']:.1f}", f"{a['time_us'] - a['floor_us']:.1f}"] if a else ["-", "-"]
        if with_switch:
            cells.append(f"{a['switch_floor_us']:.1f}" if a and "switch_floor_us" in a else "-")
        cells.append("ok" if wrong == 0 else "WRONG")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(results: dict, n: int, skipped: dict) -> str:
    """The run's markdown: the header, then one table per op. results["_cores"]: the measuring machine's cores (this
    machine's where a saved run lacks it)."""
    cores = results.get("_cores") or os.cpu_count() or 1
    lines = _header(results, n, cores, skipped)
    backends = [b for b in results if not b.startswith("_")]
    for op in sorted({r["op"] for b in backends for r in results[b]}, key=OPS.index):
        lines += ["", f"## {op}", ""] + _op_table(results, op, n)
    if "t3d" in backends and len(backends) > 1:
        lines += ["", "X / t3d is X's time over t3d's: above 1 means t3d is faster. best peer / t3d: the fastest "
                      "peer's time over t3d's, with that peer's name."]
    if "t3d-mem" in backends:
        lines += ["", "t3d-mem: t3d with every buffer in t3d memory (`t3d.mem.empty`), which the ranks map from each "
                      "other: collectives of equal blocks from T3D_SHM_MAPPED_BYTES (1 MiB) copy each byte once, in "
                      "place, instead of twice through the shared segment (README, \"Registered memory\")."]
    if "mpi" in backends and results.get("_mpi_pages") == "plain":
        lines += ["", "mpi: Open MPI through mpi4py, on numpy buffers on ordinary pages, as torch's tensors are (numpy "
                      "alone would ask the kernel for transparent huge pages, on which large copies ran up to 1.8x "
                      "faster here: docs/benchmarks/thp-2ranks.txt)."]
    return "\n".join(lines) + "\n"


def plot(results: dict, n: int, path: str, ranks: str | None = None) -> None:
    """busbw against size, one panel per op, one line per backend. ranks: the panels' words for the group
    (default "<n> ranks")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b in results if not b.startswith("_")]
    ops = sorted({r["op"] for b in backends for r in results[b]}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for b in backends:
            rows = sorted((r for r in results[b] if r["op"] == op), key=lambda r: r["bytes"])
            xs = [r["bytes"] for r in rows]
            ys = [r["bytes"] / (r["time_us"] * 1e-6) * bus_factor(op, n) / 1e9 for r in rows]
            ax.plot(xs, ys, marker="o", ms=3, label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op} ({ranks or f'{n} ranks'})")
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw GB/s")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("collectives", help="nccl-tests style collective benchmark, backends side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu tensors, or cuda tensors (rank r on GPU r %% count; backends t3d, nccl, gloo; more "
                        "ranks than GPUs: t3d only, staged through host memory; refuses in one line without a GPU) "
                        "[cpu]")
    p.add_argument("--backends", default=None,
                   help="comma list among t3d, t3d-mem (t3d on buffers in t3d memory, t3d.mem), gloo, mpi, and nccl with "
                        "--device cuda (--hosts: t3d, t3d-flat, "
                        "gloo) [t3d,gloo,mpi; --device cuda: t3d,nccl]")
    p.add_argument("--ops", default=",".join(OPS), help="comma list among " + ", ".join(OPS))
    p.add_argument("--min", default="8", help="smallest message (bytes; K/M/G suffixes)")
    p.add_argument("--max", default="256M", help="largest message")
    p.add_argument("--out", default=None, help="directory for JSON/markdown/PNG (default docs/benchmarks)")
    p.add_argument("--tag", default=None, help="file name stem (default collectives-<n>ranks)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per backend")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every backend this many times, alternating, and report each row's median")
    p.add_argument("--hosts", type=int, default=0,
                   help="run on this many simulated hosts (network namespaces joined by veth links; root only), "
                        "--nproc ranks each: t3d and gloo over the same link, and ucx_perftest's bandwidth on it")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="run nothing: rewrite the markdown (and PNG) of a saved run's JSON beside it")


def _rerender(path: str) -> int:
    with open(path) as f:
        data = json.load(f)
    n, stem = data["nproc"], os.path.splitext(path)[0]
    if data.get("hosts"):
        from . import multihost

        md = multihost.render(data["results"], n * data["hosts"], data["hosts"], data.get("link_bytes_per_s"),
                              data.get("link_both_ways_bytes_per_s"))
        multihost.plot(data, stem + ".png")
    else:
        md = render(data["results"], n, data.get("skipped", {}))
        plot(data["results"], n, stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"rewrote {stem}.md, .png from {path}")
    return 0


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """One row per (op, size) from several runs of a backend: the median of each time (a run's slow spell moves
    one sample, not the row), any run's wrong result, and every run's time under time_us_runs."""
    if len(runs) == 1:
        return runs[0]

    out = []
    for i, first in enumerate(runs[0]):
        same = [rows[i] for rows in runs]
        assert all(r["op"] == first["op"] and r["bytes"] == first["bytes"] for r in same), "runs disagree on rows"
        row = dict(first, wrong=max(r["wrong"] for r in same), time_us_runs=[r["time_us"] for r in same])
        for key in ("time_us", "floor_us", "switch_floor_us"):
            if key in first:
                row[key] = statistics.median(r[key] for r in same)
        out.append(row)
    return out


def cuda_refusal(n: int, backends: str = "t3d") -> str | None:
    """Why --device cuda cannot run n ranks of these backends here (one line), or None. More ranks than GPUs share
    them (rank r on GPU r % count): t3d stages such groups through host memory, NCCL and gloo refuse them."""
    import torch

    if not torch.cuda.is_available():
        return (f"t3d-bench collectives: --device cuda needs a CUDA device; torch {torch.__version__} sees none "
                f"(torch.cuda.is_available() is False)")
    have = torch.cuda.device_count()
    peers = [b for b in backends.split(",") if b and b != "t3d"]
    if n > have and peers:
        return (f"t3d-bench collectives: --device cuda with --nproc {n} on {have} GPU(s) puts ranks on a shared GPU, "
                f"which {', '.join(peers)} refuse(s); t3d stages such groups through host memory: --backends t3d")
    return None


def run(args) -> int:
    if args.render:
        return _rerender(args.render)
    device = getattr(args, "device", "cpu")
    if args.backends is None:
        args.backends = "t3d,nccl" if device == "cuda" else "t3d,gloo,mpi"
    if args.hosts:
        if device != "cpu":
            print("t3d-bench collectives: --hosts runs CPU tensors only (--device cpu)", file=sys.stderr)
            return 2
        from . import multihost

        return multihost.run(args)
    n = args.nproc
    if device == "cuda" and (why := cuda_refusal(n, args.backends)):
        print(why, file=sys.stderr)
        return 2
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        print(f"t3d-bench: unknown op(s) {bad}; choose from {', '.join(OPS)}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"t3d-bench: --repeat must be at least 1, not {args.repeat}", file=sys.stderr)
        return 2
    sizes = sizes_between(parse_size(args.min), parse_size(args.max))
    results: dict = {"_load": os.getloadavg()[0]}
    skipped: dict = {}
    results["_cores"] = os.cpu_count() or 1
    B = None
    if device == "cpu":  # the host's copy bandwidth: the floor of CPU rows
        B = copy_bandwidth()  # one thread's: recorded beside the run, not a yardstick
        results["_copy_all_cores"] = copy_bandwidth_all_cores()
        print(f"copy bandwidth B = {B / 1e9:.1f} GB/s (read+write, one thread), "
              f"{results['_copy_all_cores'] / 1e9:.1f} GB/s with every core copying; load {results['_load']:.1f}",
              flush=True)
    else:
        import torch

        gpus = min(n, torch.cuda.device_count())
        results["_device"] = f"{gpus} x {torch.cuda.get_device_name()}"
        if gpus < n:  # t3d only (cuda_refusal): its same-device paths
            path = os.environ.get("T3D_CUDA_PATH") or "auto"
            how = f"staged through host memory (T3D_CUDA_PATH={path})"
            if path in ("auto", "ipc"):
                floor = os.environ.get("T3D_CUDA_IPC_MIN_BYTES") or "1048576"
                how = (f"on the device through CUDA IPC (T3D_CUDA_PATH={path}) from {floor} bytes, staged below"
                       if floor != "0" else f"on the device through CUDA IPC (T3D_CUDA_PATH={path}) at every size")
                if os.environ.get("T3D_CUDA_IPC_WAIT") == "host":
                    how += ", peers' events polled by the host (T3D_CUDA_IPC_WAIT=host)"
            if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
                how += f", under MPS (CUDA_MPS_PIPE_DIRECTORY={os.environ['CUDA_MPS_PIPE_DIRECTORY']})"
            results["_gpu_layout"] = f"{n} ranks on {gpus} GPU(s), {how}"
    known = ("t3d", "t3d-mem", "gloo", "mpi") if device == "cpu" else ("t3d", "nccl", "gloo")
    backends = []
    for b in [x for x in args.backends.split(",") if x]:
        if b not in known:
            skipped[b] = f"unknown backend for --device {device} (choose among {', '.join(known)})"
            print(f"skipping {b}: {skipped[b]}", flush=True)
            continue
        if b == "mpi":
            why = mpi_available()
            if why:
                skipped["mpi (Open MPI via mpi4py)"] = why
                print(f"skipping mpi: {why}", flush=True)
                continue
        backends.append(b)
    if "mpi" in backends:
        results["_mpi_pages"] = "plain"  # mpi_peer.plain_array: as torch's tensors, not numpy's huge pages
    runs: dict = {b: [] for b in backends}
    # CPU: the all-core copy bandwidth again after every backend's run. The development machine's moves with its
    # neighbours' use of a shared cache (52-98 GB/s within one run), so each backend's rows are set against the
    # bandwidth measured beside each of its runs (per run the faster of the probes before and after it; each run's
    # time against its own, the median over the runs), and the floor column against the best probe of the whole
    # run (the least time).
    probes = [results["_copy_all_cores"]] if device == "cpu" else []
    beside: dict = {}
    for rep in range(args.repeat):  # backends alternate, so that a slow spell of the machine hits each alike
        for b in [x for x in backends if x not in skipped]:
            t0 = time.time()
            try:
                rows = (run_mpi(n, ops, sizes, args.timeout) if b == "mpi" else
                        run_torch_backend(b, n, ops, sizes, args.timeout, device))
            except Exception as exc:  # a peer that fails is reported, not fatal to the others
                skipped[b] = str(exc)
                print(f"{b} failed: {exc}", flush=True)
                continue
            runs[b].append(rows)
            msg = f"{b}: {len(rows)} rows in {time.time() - t0:.0f} s (run {rep + 1} of {args.repeat})"
            if probes:
                probes.append(copy_bandwidth_all_cores())
                beside.setdefault(b, []).append(max(probes[-2], probes[-1]))
                msg += f"; copy bandwidth after it {probes[-1] / 1e9:.1f} GB/s"
            print(msg, flush=True)
    for b in backends:
        if b not in skipped:
            results[b] = median_rows(runs[b])
    if probes:
        results["_copy_all_cores_runs"] = probes
        results["_copy_all_cores"] = max(probes)
        results["_copy_beside"] = {b: statistics.median(v) for b, v in beside.items() if b not in skipped}
        results["_copy_beside_runs"] = {b: v for b, v in beside.items() if b not in skipped}
    if args.repeat > 1:
        results["_repeat"] = args.repeat
    out = output_dir(args.out)
    md = render(results, n, skipped)
    print(md)
    stem = save_run(out, args.tag or f"collectives-{'cuda-' if device == 'cuda' else ''}{n}ranks",
                    {"nproc": n, "copy_bandwidth": B, "skipped": skipped, "results": results}, md)
    plot(results, n, stem + ".png")
    print(f"saved {stem}.json, .md, .png")
    return 0


def output_dir(out: str | None) -> str:
    """Where a run's files go: --out, by default the repository's docs/benchmarks."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = out or os.path.join(root, "docs", "benchmarks")
    os.makedirs(out, exist_ok=True)
    return out


def save_run(out: str, tag: str, payload: dict, md: str) -> str:
    """Writes <out>/<tag>.json (payload and the command that made it) and .md; returns the path without suffix."""
    stem = os.path.join(out, tag)
    with open(stem + ".json", "w") as f:
        json.dump(dict(payload, command=" ".join(["t3d-bench", "collectives"] + sys.argv[2:])), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md)
    return stem
