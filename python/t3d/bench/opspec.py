"""The collectives `t3d-bench collectives` times, as the facts its two kinds of ranks share: the torch.distributed
ranks (collectives.py: t3d, gloo) and the Open MPI peer (mpi_peer.py). Which ops exist, how many float32 elements a
message size gives each buffer and how many bytes the row reports, what each rank's input holds, what its output
must hold, nccl-tests' bus bandwidth factor, and how many calls a row makes.

Plain Python with no imports: mpi_peer.py runs under mpirun without torch (or the t3d package, which loads it).
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")

# The rank whose buffer broadcast sends.
ROOT = 0

# What an output holds before the call a check runs: a value no op produces from the inputs below (all >= 0).
POISON = -1.0


def runs_on(op: str, n: int) -> bool:
    """Whether op has a row at n ranks (a ring shift needs two)."""
    return op != "send_recv" or n >= 2


# nccl-tests: busbw = algbw * factor; S is the size of the whole array (per rank for all_reduce and broadcast).
def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def counts(op: str, nbytes: int, n: int) -> tuple[int, int, int]:
    """(input elements, output elements, S in bytes) of one rank for a message of nbytes: S per rank for all_reduce,
    broadcast and send_recv (count = nbytes / 4), the whole array for the others (per = count / n elements a rank,
    n * per in all); never zero. all_reduce and broadcast work in place (their input is their output)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    count = max(1, nbytes // 4)
    if op in ("all_reduce", "broadcast", "send_recv"):
        return count, count, count * 4
    per = max(1, count // n)
    if op == "all_gather":
        return per, per * n, per * n * 4
    if op == "reduce_scatter":
        return per * n, per, per * n * 4
    return per * n, per * n, per * n * 4


def input_value(op: str, rank: int, n: int) -> float:
    """Every element of rank's input for the checked call: rank + 1 where the op sums (so that a rank that adds
    nothing shows), rank where its data moves, broadcast's 7.0 at the root (POISON elsewhere: it is their output)."""
    if op in ("all_reduce", "reduce_scatter"):
        return float(rank + 1)
    if op == "broadcast":
        return 7.0 if rank == ROOT else POISON
    return float(rank)


def ring_peers(rank: int, n: int) -> tuple[int, int]:
    """send_recv's ring shift: (the rank this one sends to, the rank it receives from)."""
    return (rank + 1) % n, (rank - 1) % n


def expected_blocks(op: str, rank: int, n: int) -> list[float]:
    """What rank's output must hold after the checked call, as equal blocks, each all one value: n blocks for
    all_gather and all_to_all (block p comes from rank p), one for the others."""
    if op in ("all_reduce", "reduce_scatter"):
        return [n * (n + 1) / 2]
    if op in ("all_gather", "all_to_all"):
        return [float(p) for p in range(n)]
    if op == "broadcast":
        return [input_value(op, ROOT, n)]
    return [input_value(op, ring_peers(rank, n)[1], n)]


def output_ok(op: str, rank: int, n: int, out) -> bool:
    """Whether out (rank's whole output: a 1-D float32 torch tensor or numpy array) holds expected_blocks."""
    blocks = expected_blocks(op, rank, n)
    per = len(out) // len(blocks)
    return all(bool((out[i * per:(i + 1) * per] == v).all()) for i, v in enumerate(blocks))


def iters_for(nbytes: int) -> tuple[int, int]:
    """(warmup, timed) iterations: many for small messages, few for large ones (the box has 2 cores)."""
    if nbytes <= 64 << 10:
        return 50, 1000
    if nbytes <= 4 << 20:
        return 5, 40
    return 2, 8


# Timed iterations stop at about this many seconds per row (slow peers at small sizes would take minutes at 8 ranks);
# every rank derives the same count from the slowest rank's warm-up.
ROW_BUDGET_S = 1.5


def budget_iters(iters: int, slowest_warm_call_s: float, budget_s: float = ROW_BUDGET_S) -> int:
    """Timed calls of a row: iters_for's, cut to budget_s at the slowest rank's warm-up time per call, at least 5."""
    return max(5, min(iters, int(budget_s / max(slowest_warm_call_s, 1e-9))))


# Small all_reduce calls each rank process makes before its first timed row.
WARMUP_CALLS = 500


def row(op: str, size_b: int, call_s: float, ok: bool) -> dict:
    """One result row: the op, S in bytes, the slowest rank's time per call, and whether any rank's check failed."""
    return {"op": op, "bytes": size_b, "time_us": call_s * 1e6, "wrong": 0 if ok else 1}
