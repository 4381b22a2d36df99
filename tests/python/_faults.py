# Helpers of the fault and stress tests (test_faults.py, test_stress.py).
import contextlib
import os
import time

SHM = "/dev/shm"


def _t3d_segments() -> set:
    """t3d's segments in /dev/shm: c_src/shm/segment.c names them /t3d-<creator pid>-<counter>-<random>."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("t3d-")}
    except FileNotFoundError:
        return set()


def _creator_gone(name: str) -> bool:
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextlib.contextmanager
def shm_leak_check(settle_s: float = 3.0):
    """Fails if the block leaves a t3d segment behind: one that was not there before and whose creating process has
    exited (segments of other live processes, e.g. tests running beside this one, are theirs)."""
    before = _t3d_segments()
    yield
    deadline = time.monotonic() + settle_s
    while True:
        leaked = sorted(n for n in _t3d_segments() - before if _creator_gone(n))
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leaked, f"t3d segments left in {SHM}: {leaked}"
