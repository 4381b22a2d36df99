#!/usr/bin/env python3
"""The structure of c_src/ as the code draws it: which file calls which, whether the calls form a circle, and
which files are too long.

    scripts/c_structure.py BUILD_DIR [--dot] [--max-lines 700]

The graph comes from libt3d's object files: for every object, its undefined symbols resolved to the object that
defines them (`nm`). A call through a function pointer (a provider table, a transport table) is no edge: the table
is a symbol of the file that defines it, so the file that names the table depends on that file. Prints one line
per file with the files it calls, then the circles (strongly connected sets of more than one file) and the files
over the line limit; exits 1 when there is either. ctest runs it (tests/c/CMakeLists.txt, `CStructure`).
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def objects(build):
    base = os.path.join(build, "c_src", "CMakeFiles", "t3d.dir")
    out = {}
    for d, _, files in os.walk(base):
        for f in files:
            if f.endswith(".o"):
                path = os.path.join(d, f)
                src = os.path.relpath(path, base)[: -len(".o")]  # shm/allreduce.c
                if os.path.exists(os.path.join(ROOT, "c_src", src)):  # not a leftover of a moved file
                    out[src] = path
    if not out:
        sys.exit(f"c_structure: no object files of libt3d under {base} (build first)")
    return out


def symbols(path):
    defined, undefined = set(), set()
    text = subprocess.run(["nm", path], check=True, capture_output=True, text=True).stdout
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRVW":  # global text, data, bss, read-only, weak
            defined.add(parts[2])
    return defined, undefined


def graph(objs):
    owner, needs = {}, {}
    for src, path in objs.items():
        d, u = symbols(path)
        for s in d:
            owner[s] = src
        needs[src] = u
    edges = {src: sorted({owner[s] for s in u if s in owner and owner[s] != src}) for src, u in needs.items()}
    return edges


def circles(edges):
    """Strongly connected sets of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def long_files(limit):
    out = []
    for d, _, files in os.walk(os.path.join(ROOT, "c_src")):
        for f in files:
            if f.endswith((".c", ".h")):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > limit:
                    out.append((os.path.relpath(path, ROOT), n))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    ap.add_argument("--max-lines", type=int, default=700)
    a = ap.parse_args()
    edges = graph(objects(a.build))
    if a.dot:
        print("digraph t3d {")
        for v in sorted(edges):
            for w in edges[v]:
                print(f'  "{v}" -> "{w}";')
        print("}")
    else:
        for v in sorted(edges):
            print(f"{v:28} -> {', '.join(edges[v]) or '-'}")
    bad = 0
    for comp in circles(edges):
        print(f"circle: {' <-> '.join(comp)}")
        bad = 1
    for path, n in long_files(a.max_lines):
        print(f"too long: {path} has {n} lines (limit {a.max_lines})")
        bad = 1
    if not bad:
        print(f"c_structure: {len(edges)} files, no circle, none over {a.max_lines} lines")
    return bad


if __name__ == "__main__":
    sys.exit(main())
