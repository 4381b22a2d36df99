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
and Open MPI had the same one (files without placement lines count as alike), `--placement near` (or far) only those
in which both had that one.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ab import human, parse_rows  # noqa: E402  (the bench's table rows, one parser for both scripts)

NEAR_NS, FAR_NS = 200, 600  # near: one core complex (80-135 ns here); far: two (320-430); above: disturbed

OPS = ["allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "sendrecv"]


def placement_class(ns):
    """"near", "far", "?" (a round trip longer than a far one: something else held a CPU) or None (not measured)."""
    if ns is None:
        return None
    return "near" if 0 < ns < NEAR_NS else "far" if 0 < ns < FAR_NS else "?"


def same_placement(a, b, want=None):
    """Both sides had the same placement (want: that one, "near" or "far")."""
    ca, cb = placement_class(a), placement_class(b)
    return ca == cb and ca != "?" and (want is None or ca == want)


def files(ranks, d):
    return os.path.join(d, f"collectives-c-{ranks}ranks.txt"), os.path.join(d, f"collectives-c-mpi-{ranks}ranks.txt")


def read(path):
    """({(op, bytes): microseconds}, {op: placement round-trip ns}) of one file: t3d's "auto" column, or Open MPI's."""
    placements = {}
    with open(path) as f:
        rows = parse_rows(f.read(), placements)
    return {(op, size): us for (op, column, size), us in rows.items() if column in ("auto", "mpi")}, placements


def load(ranks, dirs):
    """Every run, each file read once: [(name, (t3d times, placements), (Open MPI times, placements))]."""
    return [(os.path.basename(os.path.normpath(d)), *(read(f) for f in files(ranks, d))) for d in dirs]


def _want(same):
    """same: False (every run), True (the same placement on both sides) or "near" / "far" (that one on both)."""
    return same if same in ("near", "far") else None


def _ratios(runs, same):
    """{op: (rows, classes)}: rows [(bytes, t3d median us, Open MPI median us)] over the runs kept (same: those whose
    two sides had the same placement for op, or "near" / "far": that one), sizes every one of them has on both sides;
    classes: their placements."""
    out = {}
    for op in OPS:
        kept = [(t, m) for _, t, m in runs if not same or same_placement(t[1].get(op), m[1].get(op), _want(same))]
        if not kept:
            continue
        t3d, mpi = [t[0] for t, _ in kept], [m[0] for _, m in kept]
        keys = sorted(k for k in t3d[0] if k[0] == op and all(k in r for r in t3d + mpi))
        if keys:
            rows = [(k[1], statistics.median(r[k] for r in t3d), statistics.median(r[k] for r in mpi)) for k in keys]
            out[op] = rows, [placement_class(t[1].get(op)) for t, _ in kept]
    return out


def ratios(ranks, dirs, same=False):
    """{op: [(bytes, t3d median us, Open MPI median us)]} over the runs (same: only those whose two sides had the same
    placement for that op), sizes every run kept has on both sides."""
    return {op: rows for op, (rows, _) in _ratios(load(ranks, dirs), same).items()}


def _summary(ranks, runs, same):
    head = (f"t3d_bench_c against Open MPI's mpi_bench_c, {ranks} ranks, medians of {len(runs)} runs of "
            f"`scripts/bench-c.sh {ranks}`; Open MPI's time over t3d's (above 1: t3d is faster)")
    if same:
        which = {"near": f"below {NEAR_NS} ns on both sides", "far": f"{NEAR_NS}-{FAR_NS} ns on both sides"}
        head += (f"; per operation only the runs in which both had {'the same placement' if not _want(same) else same} "
                 "(a cache line's round trip between ranks 0 and 1 "
                 + which.get(_want(same), f"below {NEAR_NS} ns on both sides, or {NEAR_NS}-{FAR_NS} on both") + ")")
    kept_col = " runs kept |" if same else ""
    lines = [head, "", f"| op |{kept_col} Open MPI / t3d | where Open MPI is faster (ratio; t3d / Open MPI us) |",
             "|---|" + ("---|" if same else "") + "---|---|"]
    for op, (rows, classes) in _ratios(runs, same).items():
        rs = [m / t for _, t, m in rows]
        faster = [f"{human(size)} ({m / t:.2f}; {t:.2f} / {m:.2f})" for size, t, m in rows if m < t]
        kept = ""
        if same:
            kept = f" {len(classes)} ({', '.join(f'{c} {classes.count(c)}' for c in ('near', 'far') if c in classes)}) |"
        lines.append(f"| {op} |{kept} {min(rs):.2f}-{max(rs):.2f} | {', '.join(faster) or 'nowhere'} |")
    placed = [f"- {name}: " + ", ".join(f"{op} {t[1].get(op, '-')} / {m[1].get(op, '-')} ns"
                                        for op in OPS if op in t[1] or op in m[1])
              for name, t, m in runs if t[1] or m[1]]
    if placed:
        lines += ["", "Placement per run, t3d / Open MPI (a cache line's round trip between ranks 0 and 1):"] + placed
    return "\n".join(lines) + "\n"


def summary(ranks, dirs, same=False):
    return _summary(ranks, load(ranks, dirs), same)


def plot(ranks, runs, path, same=False):
    """Open MPI's time over t3d's against the size, one line per operation, 1 drawn across (runs: load's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=110)
    for op, (rows, _) in _ratios(runs, same).items():
        ax.plot([size for size, _, _ in rows], [m / t for _, t, m in rows], marker="o", ms=3, label=op)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("Open MPI time / t3d time")
    ax.set_title(f"C level, {ranks} ranks, medians of {len(runs)} runs (above 1: t3d is faster)", fontsize=9)
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
    p.add_argument("--placement", choices=("near", "far"),
                   help="per operation, only the runs in which both had this placement")
    a = p.parse_args()
    runs = load(a.ranks, a.dirs)
    same = a.placement or a.same_placement
    text = _summary(a.ranks, runs, same)
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.plot:
        plot(a.ranks, runs, a.plot, same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
