#!/usr/bin/env python3
"""t3d against Open MPI over several runs of scripts/bench-c.sh, one output folder per run.

    for i in 1 2 3; do T3D_BENCH_OUT=/tmp/bc$i ./scripts/bench-c.sh 2; done
    scripts/bench_c_summary.py 2 /tmp/bc1 /tmp/bc2 /tmp/bc3 [--out FILE]

Per operation and size: the median over the runs of t3d's time and of Open MPI's (each run pairs them back to
back), their ratio (Open MPI's time over t3d's: above 1, t3d is faster), and per operation the range of that ratio
and the sizes where Open MPI is faster. Prints markdown; `--out` also writes it, `--plot` draws the ratio against
the size, one line per operation (PNG).
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


def ratios(ranks, dirs):
    """{op: [(bytes, t3d median us, Open MPI median us)]} over the runs, sizes every run has on both sides."""
    t3d = [read(os.path.join(d, f"collectives-c-{ranks}ranks.txt")) for d in dirs]
    mpi = [read(os.path.join(d, f"collectives-c-mpi-{ranks}ranks.txt")) for d in dirs]
    out = {}
    for op in OPS:
        keys = sorted(k for k in t3d[0] if k[0] == op and all(k in r for r in t3d + mpi))
        if keys:
            out[op] = [(k[1], statistics.median(r[k] for r in t3d), statistics.median(r[k] for r in mpi))
                       for k in keys]
    return out


def summary(ranks, dirs):
    lines = [f"t3d_bench_c against Open MPI's mpi_bench_c, {ranks} ranks, medians of {len(dirs)} runs of "
             f"`scripts/bench-c.sh {ranks}`; Open MPI's time over t3d's (above 1: t3d is faster)", "",
             "| op | Open MPI / t3d | where Open MPI is faster (ratio; t3d / Open MPI us) |", "|---|---|---|"]
    for op, rows in ratios(ranks, dirs).items():
        rs = [m / t for _, t, m in rows]
        faster = [f"{human(size)} ({m / t:.2f}; {t:.2f} / {m:.2f})" for size, t, m in rows if m < t]
        lines.append(f"| {op} | {min(rs):.2f}-{max(rs):.2f} | {', '.join(faster) or 'nowhere'} |")
    return "\n".join(lines) + "\n"


def plot(ranks, dirs, path):
    """Open MPI's time over t3d's against the size, one line per operation, 1 drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    for op, rows in ratios(ranks, dirs).items():
        ax.plot([size for size, _, _ in rows], [m / t for _, t, m in rows], marker="o", ms=3, label=op)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("Open MPI time / t3d time")
    ax.set_title(f"C level, {ranks} ranks, medians of {len(dirs)} runs (above 1: t3d is faster)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ranks", type=int)
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out")
    p.add_argument("--plot", help="also draw the ratios into this PNG")
    a = p.parse_args()
    text = summary(a.ranks, a.dirs)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.plot:
        plot(a.ranks, a.dirs, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
