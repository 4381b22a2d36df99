#!/usr/bin/env python3
"""t3d against Open MPI over several runs of scripts/bench-c.sh, one output folder per run.

    for i in 1 2 3; do T3D_BENCH_OUT=/tmp/bc$i ./scripts/bench-c.sh 2; done
    scripts/bench_c_summary.py 2 /tmp/bc1 /tmp/bc2 /tmp/bc3 [--out FILE]

Per operation and size: the median over the runs of t3d's time and of Open MPI's (each run pairs them back to
back), their ratio (Open MPI's time over t3d's: above 1, t3d is faster), and per operation the range of that ratio
and the sizes where Open MPI is faster. Prints markdown; `--out` also writes it, `--plot` draws the ratio against
the size, one line per operation (PNG).

Placement: both benches print, before each operation, how long a cache line's round trip between ranks 0 and 1
takes. On the development machine it is either about 80-135 ns ("near": the two virtual CPUs on one core complex of
the host) or 320-430 ns ("far"), it changes between runs and even between the operations of one run, and every
transfer between the ranks is faster when near; longer round trips mean something else held a CPU, and such
sections match nothing. The summary lists each run's placements; `--same-placement` keeps, per operation, only the runs in which t3d
and Open MPI had the same one (files without placement lines count as alike).
"""
import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ab import SECTION, human, parse_rows  # noqa: E402  (the bench's table rows, one parser for both scripts)

PLACEMENT = re.compile(r"^# placement: a cache line's round trip between ranks 0 and 1 takes (-?\d+) ns")
NEAR_NS, FAR_NS = 200, 600  # near: one core complex (80-135 ns here); far: two (320-430); above: disturbed


def placements(path):
    """{op: round-trip ns} of one file's placement lines (none in files from before the benches printed them)."""
    out, op = {}, None
    with open(path) as f:
        for line in f:
            m = SECTION.match(line)
            if m:
                op = m.group(1)
                continue
            m = PLACEMENT.match(line)
            if m and op:
                out[op] = int(m.group(1))
    return out


def placement_class(ns):
    """"near", "far", "?" (a round trip longer than a far one: something else held a CPU) or None (not measured)."""
    if ns is None:
        return None
    return "near" if 0 < ns < NEAR_NS else "far" if 0 < ns < FAR_NS else "?"


def same_placement(a, b):
    ca, cb = placement_class(a), placement_class(b)
    return ca == cb and ca != "?"

OPS = ["allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "sendrecv"]


def read(path):
    """{(op, bytes): microseconds} of one file: t3d's "auto" column, or Open MPI's."""
    with open(path) as f:
        rows = parse_rows(f.read())
    return {(op, size): us for (op, column, size), us in rows.items() if column in ("auto", "mpi")}


def files(ranks, d):
    return os.path.join(d, f"collectives-c-{ranks}ranks.txt"), os.path.join(d, f"collectives-c-mpi-{ranks}ranks.txt")


def ratios(ranks, dirs, same=False):
    """{op: [(bytes, t3d median us, Open MPI median us)]} over the runs (same: only those whose two sides had the same
    placement for that op), sizes every run kept has on both sides."""
    out = {}
    for op in OPS:
        kept = kept_runs(ranks, dirs, op) if same else dirs
        if not kept:
            continue
        t3d = [read(files(ranks, d)[0]) for d in kept]
        mpi = [read(files(ranks, d)[1]) for d in kept]
        keys = sorted(k for k in t3d[0] if k[0] == op and all(k in r for r in t3d + mpi))
        if keys:
            out[op] = [(k[1], statistics.median(r[k] for r in t3d), statistics.median(r[k] for r in mpi))
                       for k in keys]
    return out


def kept_runs(ranks, dirs, op):
    """The runs in which t3d's and Open MPI's sections of op had the same placement."""
    return [d for d in dirs if same_placement(placements(files(ranks, d)[0]).get(op),
                                              placements(files(ranks, d)[1]).get(op))]


def placement_lines(ranks, dirs):
    """One line per run: each op's placement round trip on the t3d side and the Open MPI side."""
    lines = []
    for d in dirs:
        a, b = (placements(f) for f in files(ranks, d))
        if a or b:
            lines.append(f"- {os.path.basename(os.path.normpath(d))}: " + ", ".join(
                f"{op} {a.get(op, '-')} / {b.get(op, '-')} ns" for op in OPS if op in a or op in b))
    return lines


def summary(ranks, dirs, same=False):
    lines = [f"t3d_bench_c against Open MPI's mpi_bench_c, {ranks} ranks, medians of {len(dirs)} runs of "
             f"`scripts/bench-c.sh {ranks}`; Open MPI's time over t3d's (above 1: t3d is faster)", "",
             "| op | Open MPI / t3d | where Open MPI is faster (ratio; t3d / Open MPI us) |", "|---|---|---|"]
    if same:
        lines[0] += ("; per operation only the runs in which both had the same placement (a cache line's round "
                     f"trip between ranks 0 and 1 below {NEAR_NS} ns on both sides, or {NEAR_NS}-{FAR_NS} on both)")
    if same:
        lines[2:4] = ["| op | runs kept | Open MPI / t3d | where Open MPI is faster (ratio; t3d / Open MPI us) |",
                      "|---|---|---|---|"]
    for op, rows in ratios(ranks, dirs, same).items():
        rs = [m / t for _, t, m in rows]
        faster = [f"{human(size)} ({m / t:.2f}; {t:.2f} / {m:.2f})" for size, t, m in rows if m < t]
        kept = ""
        if same:
            classes = [placement_class(placements(files(ranks, d)[0]).get(op)) for d in kept_runs(ranks, dirs, op)]
            kept = f" {len(classes)} ({', '.join(f'{c} {classes.count(c)}' for c in ('near', 'far') if c in classes)}) |"
        lines.append(f"| {op} |{kept} {min(rs):.2f}-{max(rs):.2f} | {', '.join(faster) or 'nowhere'} |")
    pl = placement_lines(ranks, dirs)
    if pl:
        lines += ["", "Placement per run, t3d / Open MPI (a cache line's round trip between ranks 0 and 1):"] + pl
    return "\n".join(lines) + "\n"


def plot(ranks, dirs, path, same=False):
    """Open MPI's time over t3d's against the size, one line per operation, 1 drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    for op, rows in ratios(ranks, dirs, same).items():
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
    p.add_argument("--same-placement", action="store_true",
                   help="per operation, only the runs in which t3d and Open MPI had the same placement")
    a = p.parse_args()
    text = summary(a.ranks, a.dirs, a.same_placement)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.plot:
        plot(a.ranks, a.dirs, a.plot, a.same_placement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
