#!/usr/bin/env python3
"""Two builds of t3d_bench_c (or mpi_bench_c) against each other, in alternating runs on the same machine.

    scripts/bench_ab.py --a OLD/bench/c/t3d_bench_c --b build/bench/c/t3d_bench_c [--rounds 3] [--out FILE] -- ARGS

Runs A, B, A, B, ... (`--rounds` of each) with the same ARGS, reads every table row (operation, size, time), and
prints per operation and size the median time of each side, the ratio B / A of the medians and the range of each
side: a behaviour-preserving change should show ratios near 1 whose ranges overlap. Alternating keeps a slow
minute of the machine from landing on one side only. `--out` also writes the table (markdown) and the raw runs.
"""
import argparse
import re
import statistics
import subprocess
import sys
import time

ROW = re.compile(r"^\s*(\d+)\s+\d+\s+\S+\s+\S+\s+\|\s+(\S+)\s+([\d.]+)\s")
SECTION = re.compile(r"^# (\w+), ")
PLACEMENT = re.compile(r"^# placement: a cache line's round trip between ranks 0 and 1 takes (-?\d+) ns")


def parse_rows(text, placements=None):
    """{(op, column, bytes): microseconds} of a bench's output; column is "auto", "ucx" or "mpi". placements: a dict
    that also receives {op: round-trip ns} from the sections' placement lines (the benches print one before each
    operation where every rank has a CPU of its own)."""
    times, op = {}, None
    for line in text.splitlines():
        m = SECTION.match(line)
        if m:
            op = m.group(1)
            continue
        m = ROW.match(line)
        if m and op:
            times[(op, m.group(2), int(m.group(1)))] = float(m.group(3))
            continue
        m = PLACEMENT.match(line) if placements is not None else None
        if m and op:
            placements[op] = int(m.group(1))
    return times


def run(binary, args):
    out = subprocess.run([binary] + args, check=True, capture_output=True, text=True).stdout
    return out, parse_rows(out)


def human(n):
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n}{unit}" if unit == "B" else f"{n:g}{unit}"
        n /= 1024
    return str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the build before")
    ap.add_argument("--b", required=True, help="the build after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the table and the raw output here")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    runs = {"A": [], "B": []}
    raw = []
    for r in range(a.rounds):
        for side, binary in (("A", a.a), ("B", a.b)):
            t0 = time.time()
            out, times = run(binary, args)
            runs[side].append(times)
            raw.append(f"## round {r + 1}, {side}: {binary} {' '.join(args)} ({time.time() - t0:.0f} s)\n{out}")
            print(f"round {r + 1} {side}: {len(times)} rows", file=sys.stderr)
    keys = sorted(set().union(*runs["A"]) & set().union(*runs["B"]), key=lambda k: (k[0], k[1], k[2]))
    lines = [f"A = `{a.a}`, B = `{a.b}`, `{' '.join(args)}`, {a.rounds} alternating runs of each; times in us "
             f"(medians; range in brackets)", "",
             "| op | path | size | A | B | B / A |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    ratios = []
    for k in keys:
        va = [t[k] for t in runs["A"] if k in t]
        vb = [t[k] for t in runs["B"] if k in t]
        ma, mb = statistics.median(va), statistics.median(vb)
        ratio = mb / ma if ma > 0 else float("nan")
        ratios.append(ratio)
        lines.append(f"| {k[0]} | {k[1]} | {human(k[2])} | {ma:.2f} [{min(va):.2f}-{max(va):.2f}] | "
                     f"{mb:.2f} [{min(vb):.2f}-{max(vb):.2f}] | {ratio:.2f} |")
    if ratios:
        lines.append("")
        lines.append(f"B / A over all {len(ratios)} rows: median {statistics.median(ratios):.3f}, "
                     f"geometric mean {statistics.geometric_mean([r for r in ratios if r > 0]):.3f}, "
                     f"range {min(ratios):.2f}-{max(ratios):.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n<details><summary>raw runs</summary>\n\n```\n" + "\n".join(raw) + "```\n</details>\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
