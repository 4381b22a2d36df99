#!/usr/bin/env python3
"""Groups a system-wide perf profile of a training step (scripts/profile-step.sh) by what ran.

    scripts/perf_step_summary.py perf.data --backend t3d --step-ms 166 --cores 2

Each sample is put in one group by its thread's name (the backends' own threads: t3d's progress and watch
threads, gloo's transport and work threads; the launcher's), else by its library and symbol. With the step time and
the number of cores, a group's share of the samples becomes core-milliseconds per step. The backend's own cost is
its threads, its library (libt3d, UCX; gloo's code inside libtorch_cpu; Open MPI; NCCL) and the kernel's scheduling
and networking that its waits and transfers cause. The interpreter, torch's C++ and bindings and the tensor kernels
run the model and the parallelism in Python whatever the backend: that work over the cores bounds the step from
below on any backend. libc, the kernel's system-call entry and interrupts, and what perf cannot name are counted in
neither (either side may cause them).
"""
import argparse
import re
import subprocess
import sys
from collections import Counter

GROUPS = [
    "Python interpreter",
    "torch C++ (dispatch, autograd, allocation)",
    "torch Python bindings",
    "tensor kernels",
    "libc (malloc, memcpy)",
    "backend threads",
    "backend library",
    "kernel: scheduling, yields, futexes",
    "kernel: networking",
    "kernel: other",
    "idle cores",
    "launcher (t3d-train, torchrun)",
    "other",
]
BACKEND_COST = {"backend threads", "backend library", "kernel: scheduling, yields, futexes", "kernel: networking"}
MODEL_WORK = {"Python interpreter", "torch C++ (dispatch, autograd, allocation)", "torch Python bindings",
              "tensor kernels"}
LINE = re.compile(r"\s+([0-9.]+)%\s+(\S+)\s+(\S+)\s+\[(.)\]\s+(.*)")
KERNELS = re.compile(r"mkl_|gemm|vectorized|_kernel|kernel_|sleef|softmax|flash|attention", re.I)
BACKEND_SYM = re.compile(r"gloo::|ProcessGroupGloo|ProcessGroupMPI|nccl", re.I)
SCHED = re.compile(r"sched|yield|futex|switch|schedule|_task|update_curr|pick_next|wake")
NET = re.compile(r"tcp|udp|skb|sock|net_|netif|ip_|ipv|epoll|ep_|poll|loopback|veth|dev_queue|__sys_(send|recv)")
IDLE = re.compile(r"safe_halt|default_idle|cpu_idle|do_idle|intel_idle|acpi_idle|mwait")
BACKEND_THREADS = {"t3d_progress", "t3d_watch", "gloo_tcp_loop", "pt_gloo_runloop"}
LAUNCHER = {"t3d-train", "pt_elastic", "torchrun"}


def group(comm: str, dso: str, sym: str) -> str:
    if comm == "swapper" or IDLE.search(sym):
        return "idle cores"
    if comm in BACKEND_THREADS:
        return "backend threads"
    if comm in LAUNCHER:
        return "launcher (t3d-train, torchrun)"
    if re.search(r"libt3d\.so|libuc[pst]|libmpi|libopen-p|libnccl", dso) or BACKEND_SYM.search(sym):
        return "backend library"
    if dso.startswith("[kernel") or (dso == "[unknown]" and sym.startswith("0xffff")):
        if SCHED.search(sym):
            return "kernel: scheduling, yields, futexes"
        if NET.search(sym):
            return "kernel: networking"
        return "kernel: other"
    if "libpython" in dso or re.fullmatch(r"python3(\.\d+)?", dso):
        return "Python interpreter"
    if "libtorch_python" in dso:
        return "torch Python bindings"
    if "libt3d_kernels" in dso or "libgomp" in dso or "mkl" in dso:
        return "tensor kernels"
    if re.search(r"libtorch|libc10|libstdc\+\+", dso):
        return "tensor kernels" if KERNELS.search(sym) else "torch C++ (dispatch, autograd, allocation)"
    if dso.startswith("libc.so") or dso.startswith("libm.so"):
        return "libc (malloc, memcpy)"
    return "other"


def shares(report: str) -> Counter:
    """Percent of the samples per group, from `perf report --stdio -F overhead,comm,dso,sym` text."""
    c = Counter()
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            c[group(m.group(2), m.group(3), m.group(5).strip())] += float(m.group(1))
    return c


def split(c: Counter, step_ms: float, cores: int) -> dict:
    """Core-ms per step of the backend's own cost and of the model's work, and the shortest step the latter allows."""
    total = sum(c.values())
    per_step = step_ms * cores
    own = per_step * sum(c[g] for g in BACKEND_COST) / total
    model = per_step * sum(c[g] for g in MODEL_WORK) / total
    return {"per_step": per_step, "own": own, "model": model, "bound_ms": model / cores}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--backend", default="t3d")
    ap.add_argument("--step-ms", type=float, required=True, help="the run's median step time")
    ap.add_argument("--cores", type=int, required=True)
    a = ap.parse_args()
    report = subprocess.run(["perf", "report", "-i", a.data, "--no-children", "--sort", "comm,dso,sym", "--stdio",
                             "-F", "overhead,comm,dso,sym"], capture_output=True, text=True, check=True).stdout
    c = shares(report)
    total = sum(c.values())
    if total <= 0:
        print("perf_step_summary: no samples", file=sys.stderr)
        return 1
    parts = split(c, a.step_ms, a.cores)
    per_step = parts["per_step"]  # core-ms the machine has per step
    print(f"\nbackend {a.backend}: {a.step_ms:.1f} ms per step x {a.cores} cores = {per_step:.0f} core-ms per step\n")
    print("| what ran | share of samples | core-ms per step |")
    print("|---|---|---|")
    for g in GROUPS:
        if c[g] > 0:
            print(f"| {g} | {100 * c[g] / total:.1f}% | {per_step * c[g] / total:.1f} |")
    print(f"\nthe backend's own cost (its threads, its library, scheduling, networking): "
          f"{100 * parts['own'] / per_step:.1f}% = {parts['own']:.1f} core-ms per step")
    print(f"the model's work (interpreter, torch, tensor kernels): {parts['model']:.1f} core-ms; over {a.cores} "
          f"cores no backend makes a step shorter than {parts['bound_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
