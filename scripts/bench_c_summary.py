#!/usr/bin/env python3
"""t3d against Open MPI over several runs of scripts/bench-c.sh, one output folder per run.

    for i in 1 2 3; do T3D_BENCH_OUT=/tmp/bc$i ./scripts/bench-c.sh 2; done
    scripts/bench_c_summary.py 2 /tmp/bc1 /tmp/bc2 /tmp/bc3 [--out FILE]

Per operation and size: the median over the runs of t3d's time and of Open MPI's (each run pairs them back to
back), their ratio (Open MPI's time over t3d's: above 1, t3d is faster), and per operation the range of that ratio
and the sizes where Open MPI is faster. Prints markdown; `--out` also writes it.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ab import human, parse_rows  # noqa: E402  (the bench's table rows, one parser for both scripts)

OPS = ["allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "sendrecv"]


def read(path):
    """{(op, bytes): microseconds} of one file: t3d's "auto" column, or Open MPI's."""
    with open(path) as f:
        rows = parse_rows(f.read())
    return {(op, size): us for (op, column, size), us in rows.items() if column in ("auto", "mpi")}


def summary(ranks, dirs):
    t3d = [read(os.path.join(d, f"collectives-c-{ranks}ranks.txt")) for d in dirs]
    mpi = [read(os.path.join(d, f"collectives-c-mpi-{ranks}ranks.txt")) for d in dirs]
    lines = [f"t3d_bench_c against Open MPI's mpi_bench_c, {ranks} ranks, medians of {len(dirs)} runs of "
             f"`scripts/bench-c.sh {ranks}`; Open MPI's time over t3d's (above 1: t3d is faster)", "",
             "| op | Open MPI / t3d | where Open MPI is faster (ratio; t3d / Open MPI us) |", "|---|---|---|"]
    for op in OPS:
        keys = sorted(k for k in t3d[0] if k[0] == op and all(k in r for r in t3d + mpi))
        if not keys:
            continue
        ratios, faster = [], []
        for k in keys:
            t = statistics.median(r[k] for r in t3d)
            m = statistics.median(r[k] for r in mpi)
            ratios.append(m / t)
            if m < t:
                faster.append(f"{human(k[1])} ({m / t:.2f}; {t:.2f} / {m:.2f})")
        lines.append(f"| {op} | {min(ratios):.2f}-{max(ratios):.2f} | {', '.join(faster) or 'nowhere'} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ranks", type=int)
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out")
    a = p.parse_args()
    text = summary(a.ranks, a.dirs)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
