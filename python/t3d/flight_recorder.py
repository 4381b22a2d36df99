"""t3d's flight recorder: the last operations of this process's t3d groups, dumped in the format of torch's flight
recorder, so that torch's analyser (`torchfrtrace`, `python -m torch.distributed.flight_recorder.fr_trace`) run over
every rank's dump names the rank and the operation that diverged.

The shim records every operation when it is issued (a ring of TORCH_FR_BUFFER_SIZE entries per process, 2000 by
default, 0: off) and marks it started and completed as the engine runs it. A dump is written, per rank, to
<TORCH_FR_DUMP_TEMP_FILE><global rank> (default /tmp/t3d_trace_rank_<rank>):

- by itself, once per process, when an operation fails on a timeout, a lost peer, an abort or ranks that disagree
  (TORCH_FR_DUMP_ON_TIMEOUT=0 turns that off);
- on a signal, once `dump_on_signal()` has installed the handler (a rank that hangs in Python never fails in t3d,
  so something else has to ask it: `kill -USR1 <pid>`);
- when `dump()` is called.

Then, with every rank's dump in one directory:

    python -m torch.distributed.flight_recorder.fr_trace <dir> -p t3d_trace_rank_

The Python stack of each operation is recorded only when TORCH_INCLUDE_STACK_TRACE=1 or `set_stack_capture(True)`:
it takes the GIL on every call. docs/architecture.md, "Flight recorder".
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from . import _C

__all__ = ["FORMAT_VERSION", "analyser_command", "buffer_size", "default_path", "dump", "dump_on_signal", "enabled",
           "get", "reset", "set_stack_capture", "stack_capture"]

# The version string of the dumps: the one torch 2.9 and 2.15's own recorder write (and their analyser reads).
FORMAT_VERSION = "2.10"


def buffer_size() -> int:
    """How many operations the ring keeps (0: the recorder is off)."""
    return int(_C._fr_buffer_size())


def enabled() -> bool:
    return buffer_size() > 0


def reset(buffer_size: int) -> None:
    """Empties the ring and makes it hold `buffer_size` operations from now on (0 turns the recorder off)."""
    if buffer_size < 0:
        raise ValueError(f"t3d.flight_recorder.reset: buffer_size must be >= 0, got {buffer_size}")
    _C._fr_reset(int(buffer_size))


def stack_capture() -> bool:
    return bool(_C._fr_stack_capture())


def set_stack_capture(on: bool) -> None:
    """Records the Python stack of every later operation (off by default: it takes the GIL on every call)."""
    _C._fr_set_stack_capture(bool(on))


def default_path() -> str:
    """Where dump() writes by default: <TORCH_FR_DUMP_TEMP_FILE><global rank>."""
    return str(_C._fr_default_path())


def get() -> dict:
    """The dump as a dict: version, comm_lib_version, pg_config, pg_status and entries (one dict per operation, oldest
    first, with torch's keys: record_id, pg_id, process_group, collective_seq_id, p2p_seq_id, op_id,
    profiling_name, time_created_ns, input_sizes, input_dtypes, output_sizes, output_dtypes, state,
    time_discovered_started_ns, time_discovered_completed_ns, retired, timeout_ms, is_p2p, frames; duration_ms once
    completed, error when it failed)."""
    return pickle.loads(_C._fr_pickled())


def dump(path: str | None = None) -> str:
    """Writes this rank's dump (atomically: a temporary file, then a rename) and returns its path."""
    return str(_C._fr_write(os.fspath(path) if path is not None else ""))


def dump_on_signal(signum: int = signal.SIGUSR1, path: str | None = None):
    """Installs a handler that writes the dump when the process gets `signum` (from the main thread only, as
    Python requires). The handler runs between bytecodes of the main thread, so it also runs while that thread
    sleeps or waits in Python; not while it is blocked inside a C call that never returns. Returns the previous
    handler."""

    def _handler(sig, frame):
        try:
            where = dump(path)
            print(f"t3d: flight recorder: signal {sig}: wrote {where}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001  (a signal handler must not raise into the interrupted code)
            print(f"t3d: flight recorder: signal {sig}: could not write the dump: {exc}", file=sys.stderr,
                  flush=True)

    return signal.signal(signum, _handler)


def analyser_command(trace_dir: str, prefix: str | None = None, *args: str) -> list[str]:
    """argv that runs the installed torch's analyser over a directory of dumps (CompatError when this torch ships
    none: the torch 2.9.1 wheel does not)."""
    from ._compat.torch_compat import flight_recorder_analyser

    if prefix is None:
        prefix = os.path.basename(default_path()).rstrip("0123456789")
    return [sys.executable, "-m", flight_recorder_analyser(), os.fspath(trace_dir), "-p", prefix, *args]
