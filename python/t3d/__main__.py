"""`python -m t3d` (also `t3d-info`): what this t3d is and what it can use on this machine now.

Prints the t3d version, the Python and torch it runs with, the torch its shim was built against, the features
compiled in (`t3d.build_info()`), the environment variables t3d reads with the values in effect, and the transports
usable now, each probed cheaply: UCX (compiled in or not), POSIX shared memory (a small file in /dev/shm),
cross-memory attach between processes (a child process reads a word of this one with process_vm_readv, as t3d's
ranks do) and the NCCL library (loaded).

`python -m t3d params` explains each environment variable; `--markdown` prints the README's table of them,
`--update-readme README.md` rewrites it there (t3d._params)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

# Runs in a child: reads 16 bytes at argv[2] in process argv[1]; prints them in hex, or the error and exits 1.
_CMA_CHILD = """
import ctypes, os, sys
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.restype = ctypes.c_ssize_t
out = ctypes.create_string_buffer(16)
local, remote = iovec(ctypes.addressof(out), 16), iovec(int(sys.argv[2]), 16)
n = libc.process_vm_readv(int(sys.argv[1]), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
if n != 16:
    print(os.strerror(ctypes.get_errno()))
    sys.exit(1)
print(out.raw.hex())
"""


def probe_shared_memory() -> tuple[bool, str]:
    """Whether a POSIX shared-memory segment can be made (t3d's shm_open goes to /dev/shm), with its free space."""
    path = f"/dev/shm/t3d-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, 4096)
        finally:
            os.close(fd)
            os.unlink(path)
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return False, f"cannot create a segment in /dev/shm: {e.strerror}"
    return True, f"/dev/shm, {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"


def probe_cross_memory_attach() -> tuple[bool, str]:
    """Whether another process may read this one's memory (process_vm_readv), which shared-memory point-to-point
    and single-copy collectives need; seccomp, the Yama LSM (ptrace_scope) or differing users can forbid it."""
    word = ctypes.create_string_buffer(b"t3d-cma-probe-ok", 16)
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _CMA_CHILD, str(os.getpid()),
                              str(ctypes.addressof(word))], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"could not run the probe: {e}"
    if out.returncode == 0 and out.stdout.strip() == word.raw.hex():
        return True, "process_vm_readv between processes"
    said = (out.stdout.strip() or out.stderr.strip()).splitlines()
    reason = said[-1] if said else f"exit code {out.returncode}"
    yama = ""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            yama = f"; Yama ptrace_scope is {f.read().strip()}"
    except OSError:
        pass
    return False, f"process_vm_readv refused: {reason}{yama}"


def report() -> str:
    import torch

    import t3d
    from t3d import _params

    info = t3d.build_info()
    features = " ".join(f"{k}={v}" for k, v in info["features"].items())
    lines = [
        f"t3d {info['version']} ({os.path.dirname(os.path.abspath(t3d.__file__))})",
        f"python {platform.python_version()} ({sys.executable})",
        f"torch {torch.__version__} (the shim was built against torch {info['torch_built']})",
    ]
    if info["torch_built"] != torch.__version__:
        lines.append("  warning: torch differs from the one the shim was built against; rebuild t3d")
    lines.append(f"compiled in: {features}; CUDA tensors: {'yes' if info['cuda'] else 'no'}")
    lines.append("environment variables (value in effect, who reads it, where the value comes from; "
                 "`python -m t3d params` says what each does):")
    lines += ["  " + line for line in _params.describe(info["params"])]

    if info["ucx"]:
        ucx = (True, f"UCX {info['ucx_version']}: groups across hosts")
    else:
        ucx = (False, "not compiled in (T3D_WITH_UCX=OFF): only groups on one host, over shared memory")
    nccl = (True, f"NCCL {info['nccl_version']}") if info["nccl_version"] else (False, info["nccl_error"] or "")
    usable = [
        ("ucx", ucx),
        ("shared memory", probe_shared_memory()),
        ("cross-memory attach", probe_cross_memory_attach()),
        ("nccl", nccl),
    ]
    lines.append("transports usable now:")
    lines += [f"  {name:<20} {'yes' if ok else 'no '}  {why}" for name, (ok, why) in usable]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["params"]:
        import t3d  # noqa: F401  (loads libtorch before the extension)

        from t3d import _params

        return _params.main(argv[1:])
    if argv:
        print("usage: python -m t3d [params [--markdown | --update-readme PATH | --check-readme PATH]]",
              file=sys.stderr)
        return 2
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
