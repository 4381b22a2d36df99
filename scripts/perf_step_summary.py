#!/usr/bin/env python3
"""Groups a system-wide perf profile of a training step (scripts/profile-step.sh) by what ran.

    scripts/perf_step_summary.py perf.data --backend t3d --step-ms 166 --cores 2

Each sample is put in one group by its process, library and symbol. With the step time and the number of cores,
a group's share of the samples becomes core-milliseconds per step. The backend's own cost is its library (libt3d,
UCX; gloo's code inside libtorch_cpu; Open MPI; NCCL) and the kernel's scheduling and networking that its waits and
transfers cause. The interpreter, torch's C++ and bindings and the tensor kernels run the model and the parallelism
in Python whatever the backend: that work over the cores bounds the step from below on any backend. libc, the
kernel's system-call entry and interrupts, and what perf cannot name are counted in neither (either side may cause
them).
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
    "backend library",
    "kernel: scheduling, yields, futexes",
    "kernel: networking",
    "kernel: other",
    "idle cores",
    "other",
]
BACKEND_COST = {"backend library", "kernel: scheduling, yields, futexes", "kernel: networking"}
MODEL_WORK = {"Python interpreter", "torch C++ (dispatch, autograd, allocation)", "torch Python bindings",
              "tensor kernels"}
LINE = re.compile(r"\s+([0-9.]+)%\s+(\S+)\s+(\S+)\s+\[(.)\]\s+(.*)")
KERNELS = re.compile(r"mkl_|gemm|vectorized|_kernel|kernel_|sleef|softmax|flash|attention", re.I)
BACKEND_SYM = re.compile(r"gloo::|ProcessGroupGloo|ProcessGroupMPI|nccl", re.I)
SCHED = re.compile(r"sched|yield|futex|switch|schedule|_task|update_curr|pick_next|wake")
NET = re.compile(r"tcp|udp|skb|sock|net_|netif|ip_|ipv|epoll|ep_|poll|loopback|veth|dev_queue|__sys_(send|recv)")
IDLE = re.compile(r"safe_halt|default_idle|cpu_idle|do_idle|intel_idle|acpi_idle|mwait")


def group(comm: str, dso: str, sym: str) -> str:
    if comm == "swapper" or IDLE.search(sym):
        return "idle cores"
    if re.search(r"libt3d\.so|libuc[pst]|libmpi|libopen-p|libnccl", dso) or BACKEND_SYM.search(sym):
        return "backend library"
    if dso.startswith("[kernel") or dso == "[unknown]" and sym.startswith("0xffff"):
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


def shares(path: str) -> Counter:
    out = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "comm,dso,sym", "--stdio",
                          "-F", "overhead,comm,dso,sym"], capture_output=True, text=True, check=True).stdout
    c = Counter()
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            c[group(m.group(2), m.group(3), m.group(5).strip())] += float(m.group(1))
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--backend", default="t3d")
    ap.add_argument("--step-ms", type=float, required=True, help="the run's median step time")
    ap.add_argument("--cores", type=int, required=True)
    a = ap.parse_args()
    c = shares(a.data)
    total = sum(c.values())
    if total <= 0:
        print("perf_step_summary: no samples", file=sys.stderr)
        return 1
    per_step = a.step_ms * a.cores  # core-ms the machine has per step
    print(f"\nbackend {a.backend}: {a.step_ms:.1f} ms per step x {a.cores} cores = {per_step:.0f} core-ms per step\n")
    print("| what ran | share of samples | core-ms per step |")
    print("|---|---|---|")
    for g in GROUPS:
        if c[g] > 0:
            print(f"| {g} | {100 * c[g] / total:.1f}% | {per_step * c[g] / total:.1f} |")
    own = sum(c[g] for g in BACKEND_COST) / total
    model = sum(c[g] for g in MODEL_WORK) / total
    print(f"\nthe backend's own cost (its library, scheduling, networking): {100 * own:.1f}% = "
          f"{per_step * own:.1f} core-ms per step")
    print(f"the model's work (interpreter, torch, tensor kernels): {per_step * model:.1f} core-ms; over {a.cores} "
          f"cores no backend makes a step shorter than {per_step * model / a.cores:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
