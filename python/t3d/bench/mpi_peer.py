"""Open MPI's side of `t3d-bench collectives`: every rank of an mpirun runs the ops through mpi4py on numpy float32
buffers (on ordinary pages, as torch's tensors: plain_array), with the sizes, inputs, checks and calls per row of
opspec.py, as the torch.distributed ranks of collectives.py do, and rank 0 prints the rows on one line,
"T3D_BENCH_ROWS <json>", for collectives.run_mpi.

    mpirun --oversubscribe --bind-to none -np N python .../t3d/bench/mpi_peer.py OPS_JSON SIZES_JSON BUDGET_S

OPS_JSON: a JSON list of opspec.OPS names; SIZES_JSON: a JSON list of message sizes in bytes; BUDGET_S: seconds of
timed calls per row (opspec.budget_iters). collectives.run_mpi (command() here) runs this file by its path, so that
the ranks load numpy and mpi4py only: `python -m t3d.bench.mpi_peer` works too, but imports the t3d package, which
loads torch and t3d's extension into every rank.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

if __package__:
    from . import opspec
else:  # run by path: opspec.py is beside this file, which is first on sys.path
    import opspec

ROWS_PREFIX = "T3D_BENCH_ROWS "


def command(n: int, ops: list[str], sizes: list[int], budget_s: float, python: str | None = None) -> list[str]:
    """The mpirun command line that runs this peer on n ranks of this machine."""
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [python or sys.executable, os.path.abspath(__file__), json.dumps(ops), json.dumps(sizes),
                  str(budget_s)]


def parse_args(argv: list[str]) -> tuple[list[str], list[int], float]:
    """(ops, sizes, budget_s) from the arguments after the program name; ValueError when they are not that."""
    if len(argv) != 3:
        raise ValueError(f"expected OPS_JSON SIZES_JSON BUDGET_S, got {len(argv)} arguments")
    ops, sizes, budget_s = json.loads(argv[0]), json.loads(argv[1]), float(argv[2])
    if not isinstance(ops, list) or any(op not in opspec.OPS for op in ops):
        raise ValueError(f"ops must be a list among {', '.join(opspec.OPS)}, not {argv[0]}")
    if not isinstance(sizes, list) or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be a list of positive integers, not {argv[1]}")
    return ops, sizes, budget_s


def format_rows(rows: list[dict]) -> str:
    return ROWS_PREFIX + json.dumps(rows)


def parse_output(stdout: str) -> list[dict] | None:
    """The rows rank 0 printed, or None when it printed none (mpirun or a rank failed)."""
    for line in stdout.splitlines():
        if line.startswith(ROWS_PREFIX):
            return json.loads(line[len(ROWS_PREFIX):])
    return None


def plain_array(np, count: int):
    """An uninitialised float32 array of count elements on anonymous pages that nobody asked to be huge, as torch's
    CPU tensors are by default, so that every backend of the bench moves the same kind of memory. numpy asks the
    kernel for transparent huge pages for its large arrays itself; on huge pages large copies and the kernel's
    single copy ran up to 1.8x faster here (docs/benchmarks/thp-2ranks.txt)."""
    pages = mmap.mmap(-1, max(count, 1) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc's
    return np.frombuffer(pages, np.float32, count)


def make_op(op: str, nbytes: int, comm, MPI, np):
    """(a callable that runs op once, a check, S in bytes) on numpy buffers. As in collectives._make_op the timed
    callable only communicates; the check poisons the output, runs once more and compares every element with
    opspec's expected output. all_reduce runs out of place (MPI's usual form), broadcast in place."""
    rank, n = comm.Get_rank(), comm.Get_size()
    n_in, n_out, size_b = opspec.counts(op, nbytes, n)
    x = plain_array(np, n_in)
    x.fill(opspec.input_value(op, rank, n))
    if op == "broadcast":
        def run():
            comm.Bcast(x, root=opspec.ROOT)

        def check():
            x.fill(opspec.input_value(op, rank, n))
            run()
            return opspec.output_ok(op, rank, n, x)
        return run, check, size_b
    out = plain_array(np, n_out)
    if op == "all_reduce":
        run = lambda: comm.Allreduce(x, out, op=MPI.SUM)  # noqa: E731
    elif op == "all_gather":
        run = lambda: comm.Allgather(x, out)  # noqa: E731
    elif op == "reduce_scatter":
        run = lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM)  # noqa: E731
    elif op == "all_to_all":
        run = lambda: comm.Alltoall(x, out)  # noqa: E731
    else:
        to, frm = opspec.ring_peers(rank, n)
        run = lambda: comm.Sendrecv(x, to, 0, out, frm, 0)  # noqa: E731

    def check():
        out.fill(opspec.POISON)
        run()
        return opspec.output_ok(op, rank, n, out)
    return run, check, size_b


def run_rows(comm, MPI, np, ops: list[str], sizes: list[int], budget_s: float) -> list[dict]:
    """Every (op, size) row on this rank; each rank returns the same rows (times and checks are the slowest's)."""
    n = comm.Get_size()
    w_in, w_out = np.ones(2, np.float32), np.empty(2, np.float32)
    for _ in range(opspec.WARMUP_CALLS):  # warm-up before the first row, as for the torch backends
        comm.Allreduce(w_in, w_out, op=MPI.SUM)
    rows = []
    for op in ops:
        if not opspec.runs_on(op, n):
            continue
        for nbytes in sizes:
            run, check, size_b = make_op(op, nbytes, comm, MPI, np)
            warm, iters = opspec.iters_for(nbytes)
            t0 = time.perf_counter()
            for _ in range(warm):
                run()
            iters = opspec.budget_iters(iters, comm.allreduce((time.perf_counter() - t0) / warm, op=MPI.MAX),
                                        budget_s)
            ok = check()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            dt = comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)
            wrong = comm.allreduce(0 if ok else 1, op=MPI.MAX)
            rows.append(opspec.row(op, size_b, dt, wrong == 0))
    return rows


def main(argv: list[str] | None = None) -> int:
    try:
        ops, sizes, budget_s = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"mpi_peer: {exc}\nusage: mpirun -np N python mpi_peer.py OPS_JSON SIZES_JSON BUDGET_S",
              file=sys.stderr)
        return 2
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = run_rows(comm, MPI, np, ops, sizes, budget_s)
    if comm.Get_rank() == 0:
        print(format_rows(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
