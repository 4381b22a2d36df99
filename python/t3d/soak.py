"""Random collectives on many ranks, every element checked against a local reference.

    python -m t3d.soak --nproc 4 --calls 10000 --seed 1            # 10,000 calls, then stops
    python -m t3d.soak --nproc 4 --calls 10000 --seed 1 --hours 8  # rounds of 10,000 (seed, seed+1, ...) for 8 hours
    python -m t3d.soak --nproc 4 --calls 10000 --registered 4096   # tensors from 4 KiB in t3d memory (mapped paths)

Each rank draws, from the shared seed, the same sequence of calls: all_reduce and reduce with every ReduceOp the
dtype allows (AVG and PREMUL_SUM included), broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single (even and uneven splits), gather, scatter, barrier, a send/recv pair and a ring of isend/irecv;
sizes from 0 to ~70k elements (mostly small), dtypes float32/float64/bfloat16/float16/int32/int64/uint8, on the world
group and on two subgroups created up front. Some calls run in asynchronous batches: several calls in flight on
different groups, then waited in an order each rank draws for itself.

Every rank's input is a function of (seed, call index, rank, slot), so each rank computes the expected result of a
call locally and compares every element: exactly (the data are chosen so that sums, products and power-of-two
PREMUL_SUM factors are exact in every dtype and order, integers wrap alike), AVG of floats within a few ulps. A
mismatch stops the run with the call index, op, group, dtype, size, rank and the first bad index; a rank that raises
(a t3d error, a timeout) or hangs stops it too. Exit status: 0 when every call on every rank checked out.

With --registered BYTES the ranks allocate every CPU tensor of at least BYTES in t3d memory (T3D_CPU_ALLOCATOR=1)
and collectives from BYTES offer it to their peers (T3D_SHM_MAPPED_BYTES), so that the same random calls run the
collectives that read and write each other's buffers in place; the summary says how many calls had every checked
tensor in t3d memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue as queue_mod
import random
import sys
import tempfile
import time
import traceback
from datetime import timedelta

DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8"]
FLOATS = ("float32", "float64", "bfloat16", "float16")
REDOPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
# op kind -> weight in the draw
KINDS = {"all_reduce": 20, "broadcast": 10, "all_gather": 5, "all_gather_into_tensor": 8, "reduce_scatter_tensor": 8,
         "all_to_all_single": 8, "reduce": 6, "gather": 3, "scatter": 3, "barrier": 3, "send_recv": 4, "ring": 3}
ASYNC_KINDS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "reduce", "barrier", "all_gather", "send_recv", "ring"]
PROGRESS_EVERY_S = 2.0


class Mismatch(AssertionError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# The plan: groups and calls, pure Python (the same on every rank)
# ---------------------------------------------------------------------------------------------------------------

def plan_groups(seed: int, world: int) -> list[list[int]]:
    """Group 0 is the world; groups 1 and 2 are subsets (the whole world again where it has 2 ranks)."""
    rng = random.Random(seed * 7919 + 17)
    everyone = list(range(world))
    if world < 3:
        return [everyone, everyone, everyone]
    g1 = sorted(rng.sample(everyone, world - 1))
    g2 = sorted(rng.sample(everyone, rng.randint(2, world)))
    return [everyone, g1, g2]


def _size(rng: random.Random) -> int:
    x = rng.random()
    if x < 0.03:
        return 0
    if x < 0.40:
        return rng.randint(1, 16)
    if x < 0.75:
        return rng.randint(17, 512)
    if x < 0.95:
        return rng.randint(513, 8192)
    return rng.randint(8193, 70000)


def _redop(rng: random.Random, dt: str) -> tuple[str, float | None]:
    ops = [o for o in REDOPS if not (dt in FLOATS and o in ("BAND", "BOR", "BXOR")) and
           not (dt == "uint8" and o == "PREMUL_SUM")]
    op = rng.choice(ops)
    factor = None
    if op == "PREMUL_SUM":
        # Powers of two scale exactly in every float type; 3 is exact where the sum has the bits for it.
        factor = rng.choice([0.5, 2.0, -1.0, 0.25] + ([3.0] if dt in ("float32", "float64") else []))
        if dt not in FLOATS:
            factor = rng.choice([2.0, 3.0, -1.0])
    return op, factor


def _one(rng: random.Random, i: int, groups: list[list[int]], kinds=None, world_only=False) -> dict:
    kinds = kinds or list(KINDS)
    kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
    g = 0 if kind in ("send_recv",) or world_only else rng.choice([0, 0, 1, 2])
    members = groups[g]
    ng = len(members)
    spec = {"i": i, "kind": kind, "g": g, "dt": rng.choice(DTYPES), "n": _size(rng), "op": None, "factor": None,
            "root": rng.choice(members)}
    if kind in ("all_reduce", "reduce", "reduce_scatter_tensor"):
        spec["op"], spec["factor"] = _redop(rng, spec["dt"])
    if kind in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter"):
        spec["n"] //= ng  # n is the block per rank; the whole stays under ~70k
    if kind == "all_to_all_single":
        total = spec["n"]
        if rng.random() < 0.5:  # equal blocks
            b = total // ng
            spec["splits"] = None
            spec["n"] = b
        else:  # S[r][q]: elements rank r (group rank) sends to q
            spec["splits"] = [[rng.randint(0, max(1, total // (ng * ng))) if rng.random() < 0.9 else 0
                               for _ in range(ng)] for _ in range(ng)]
    if kind == "send_recv":
        spec["root"], spec["peer"] = rng.sample(members, 2)
    if kind == "barrier":
        spec["n"] = 0
    return spec


def plan_calls(seed: int, world: int, calls: int, groups: list[list[int]] | None = None, batches: bool = True,
               world_only: bool = False, kinds: list[str] | None = None):
    """Yields steps: lists of call specs. A list of one is issued on its own (synchronously, or async and waited at
    once); a longer list is an asynchronous batch, all in flight before any is waited. Without `batches` every step
    is one call; with `world_only` every call is on the world group; `kinds` limits the kinds drawn."""
    groups = groups or plan_groups(seed, world)
    rng = random.Random(seed)
    i = 0
    while i < calls:
        if rng.random() < 0.12 and calls - i >= 2 and batches:
            k = min(rng.randint(2, 6), calls - i)
            batch = []
            for _ in range(k):
                s = _one(rng, i, groups, [k for k in ASYNC_KINDS if kinds is None or k in kinds], world_only)
                s["async"] = True
                batch.append(s)
                i += 1
            yield batch
        else:
            s = _one(rng, i, groups, kinds, world_only)
            s["async"] = rng.random() < 0.25
            i += 1
            yield [s]


def call_spec(seed: int, world: int, index: int) -> dict:
    """The spec of call `index` (for naming a reported call)."""
    for step in plan_calls(seed, world, index + 1):
        for s in step:
            if s["i"] == index:
                return s
    raise IndexError(index)


def corrupt_target(s: dict) -> bool:
    """Whether the self-test (--corrupt K) may alter this call: the first call from K on that gives every rank an
    output of n > 0 elements to check."""
    return s["g"] == 0 and s["n"] > 0 and s["kind"] in ("all_reduce", "broadcast", "all_gather_into_tensor",
                                                        "reduce_scatter_tensor", "all_gather", "ring")


def corrupt_call(seed: int, world: int, at: int) -> dict:
    """The call whose expected value --corrupt `at` alters on every rank."""
    for step in plan_calls(seed, world, 1 << 30):
        for s in step:
            if s["i"] >= at and corrupt_target(s):
                return s
    raise IndexError(at)


def describe(s: dict, groups: list[list[int]]) -> str:
    op = f" op {s['op']}" + (f"({s['factor']})" if s["factor"] is not None else "") if s["op"] else ""
    return (f"{s['kind']}{op} on group {s['g']} {groups[s['g']]} dtype {s['dt']} n {s['n']}"
            + (f" root {s['root']}" if s["kind"] in ("broadcast", "reduce", "gather", "scatter") else "")
            + (f" {s['root']}->{s['peer']}" if s["kind"] == "send_recv" else "")
            + (" async" if s.get("async") else ""))


# ---------------------------------------------------------------------------------------------------------------
# Data and references (torch)
# ---------------------------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _dtype(dt: str):
    return getattr(_torch(), dt)


def _mix(*parts: int) -> int:
    h = 0x243F6A8885A308D3
    for p in parts:
        h ^= p & 0xFFFFFFFFFFFFFFFF
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x3FFFFFFFFFFFFFFF


@functools.lru_cache(maxsize=4)
def _arange(n: int):
    return _torch().arange(n, dtype=_torch().int64)


def _raw(seed: int, i: int, r: int, slot: int, n: int):
    """n pseudo-random int64 values, a pure function of the arguments."""
    x = _arange(n) * 0x5851F42D4C957F2D + _mix(seed, i, r, slot)
    x = x ^ (x >> 29)
    x = x * 0x2545F4914F6CDD1D
    return x ^ (x >> 32)


def _domain(spec: dict) -> str:
    op = spec["op"]
    if op in ("SUM", "PREMUL_SUM"):
        return "sum"
    if op == "AVG":
        return "avg"
    if op == "PRODUCT":
        return "prod"
    return "any"


def make_input(seed: int, spec: dict, r: int, n: int, ng: int, slot: int = 0):
    """Rank r's input of the call (n elements), in a range where the call's reduction is exact."""
    torch = _torch()
    dt, dom = spec["dt"], _domain(spec)
    x = _raw(seed, spec["i"], r, slot, n)
    rem = torch.remainder
    if dt in FLOATS:
        if dom in ("sum", "avg"):
            v = (rem(x, 65) - 32).to(torch.float64) * 0.25  # quarters in [-8, 8]: sums of up to 8 are exact
        elif dom == "prod":
            v = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)[rem(x, 6)]
        else:
            v = (rem(x, 513) - 256).to(torch.float64) * 0.25
        return v.to(_dtype(dt))
    if dom == "avg":  # the sum divides by the group size exactly, without wrapping
        u = rem(x, 255 // (ng * ng) + 1) if dt == "uint8" else rem(x, 2001) - 1000
        return _wrap(u * ng, dt)
    if dom == "prod":
        return torch.tensor([1, 2, 3] if dt == "uint8" else [-2, -1, 1, 2], dtype=torch.int64)[rem(x, 3 if dt == "uint8" else 4)].to(_dtype(dt))
    return _wrap(x, dt)  # full range: sums wrap alike here and in the backend


def _wrap(v, dt: str):
    torch = _torch()
    if dt == "int32":
        v = torch.remainder(v + 2 ** 31, 2 ** 32) - 2 ** 31
    elif dt == "uint8":
        v = torch.remainder(v, 256)
    return v.to(_dtype(dt))


def reduce_ref(inputs: list, spec: dict):
    """The reduction of the inputs (in group rank order) as the backend must return it."""
    torch = _torch()
    op, dt, ng = spec["op"], spec["dt"], len(inputs)
    flt = dt in FLOATS
    wide = [t.to(torch.float64 if flt else torch.int64) for t in inputs]
    if op == "PREMUL_SUM":
        f = spec["factor"]
        wide = [t * f if flt else (t * int(f)) for t in wide]
        op = "SUM"
    if op in ("SUM", "AVG"):
        out = functools.reduce(torch.add, wide)
        if op == "AVG":
            out = out / ng if flt else torch.div(out, ng, rounding_mode="trunc")
    elif op == "PRODUCT":
        out = functools.reduce(torch.mul, wide)
    elif op == "MIN":
        out = functools.reduce(torch.minimum, wide)
    elif op == "MAX":
        out = functools.reduce(torch.maximum, wide)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = functools.reduce(fn, [t.to(_dtype(dt)) for t in inputs])
        return out
    return out.to(_dtype(dt)) if flt else _wrap(out, dt)


_EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def check(got, want, spec: dict, what: str, rank: int, groups: list[list[int]]) -> None:
    """Every element, exactly (AVG of floats: within a few ulps of the dtype). Raises Mismatch naming the call."""
    torch = _torch()
    if got.dtype != want.dtype or got.shape != want.shape:
        raise Mismatch(f"call {spec['i']} rank {rank}: {describe(spec, groups)}: {what}: got {got.dtype} "
                       f"{tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
    if spec["op"] == "AVG" and spec["dt"] in FLOATS and what.startswith("output"):
        g, w = got.to(torch.float64), want.to(torch.float64)
        eps = _EPS[spec["dt"]]
        bad = (g - w).abs() > 4 * eps * w.abs() + 16 * eps
    else:
        if torch.equal(got, want):
            return
        bad = got != want
    idx = torch.nonzero(bad.reshape(-1))
    if idx.numel() == 0:
        return
    j = int(idx[0])
    raise Mismatch(f"call {spec['i']} rank {rank}: {describe(spec, groups)}: {what}: first bad index {j}: got "
                   f"{got.reshape(-1)[j].item()!r} expected {want.reshape(-1)[j].item()!r} ({idx.numel()} of "
                   f"{want.numel()} elements differ)")


# ---------------------------------------------------------------------------------------------------------------
# Issuing calls on one rank
# ---------------------------------------------------------------------------------------------------------------

class _Rank:
    def __init__(self, seed: int, rank: int, world: int, groups: list[list[int]], pgs: list, corrupt: int | None):
        import torch.distributed as dist
        self.dist = dist
        from t3d import mem
        self.registered = 0  # calls whose checked tensors all lay in t3d memory (counted only with the allocator on)
        self._is_registered = mem.is_registered if mem.allocator_stats()["enabled"] else None
        self.seed, self.rank, self.world, self.groups, self.pgs = seed, rank, world, groups, pgs
        self.corrupt = corrupt  # a call index whose first checked expected value is altered (self-test)

    def _inp(self, spec, r, n, slot=0):
        return make_input(self.seed, spec, r, n, len(self.groups[spec["g"]]), slot)

    def _op(self, spec):
        d = self.dist
        if spec["op"] == "PREMUL_SUM":
            return d._make_nccl_premul_sum(spec["factor"])
        return getattr(d.ReduceOp, spec["op"])

    def issue(self, spec):
        """Issues the call; returns (work or None, [(what, tensor, expected)]) or None when this rank is not in it."""
        torch, d = _torch(), self.dist
        members = self.groups[spec["g"]]
        if self.rank not in members:
            return None
        pg = self.pgs[spec["g"]]
        me, ng, n, dt, root = members.index(self.rank), len(members), spec["n"], _dtype(spec["dt"]), spec["root"]
        a = spec.get("async", False)
        kind = spec["kind"]
        outs = []
        if kind == "all_reduce":
            t = self._inp(spec, self.rank, n)
            w = d.all_reduce(t, op=self._op(spec), group=pg, async_op=a)
            outs.append(("output", t, lambda: reduce_ref([self._inp(spec, r, n) for r in members], spec)))
        elif kind == "reduce":
            t = self._inp(spec, self.rank, n)
            w = d.reduce(t, dst=root, op=self._op(spec), group=pg, async_op=a)
            if self.rank == root:
                outs.append(("output", t, lambda: reduce_ref([self._inp(spec, r, n) for r in members], spec)))
        elif kind == "broadcast":
            t = self._inp(spec, self.rank, n) if self.rank == root else torch.full((n,), 7, dtype=dt)
            w = d.broadcast(t, src=root, group=pg, async_op=a)
            outs.append(("output", t, lambda: self._inp(spec, root, n)))
        elif kind == "all_gather":
            t = self._inp(spec, self.rank, n)
            lst = [torch.empty(n, dtype=dt) for _ in members]
            w = d.all_gather(lst, t, group=pg, async_op=a)
            for j, r in enumerate(members):
                outs.append((f"output[{j}]", lst[j], functools.partial(self._inp, spec, r, n)))
            outs.append(("input", t, lambda: self._inp(spec, self.rank, n)))
        elif kind == "all_gather_into_tensor":
            t = self._inp(spec, self.rank, n)
            out = torch.empty(n * ng, dtype=dt)
            w = d.all_gather_into_tensor(out, t, group=pg, async_op=a)
            outs.append(("output", out, lambda: torch.cat([self._inp(spec, r, n) for r in members])))
        elif kind == "reduce_scatter_tensor":
            inp = self._inp(spec, self.rank, n * ng)
            out = torch.empty(n, dtype=dt)
            w = d.reduce_scatter_tensor(out, inp, op=self._op(spec), group=pg, async_op=a)
            outs.append(("output", out, lambda: reduce_ref(
                [self._inp(spec, r, n * ng)[me * n:(me + 1) * n] for r in members], spec)))
        elif kind == "all_to_all_single":
            S = spec.get("splits")
            if S is None:
                inp = self._inp(spec, self.rank, n * ng)
                out = torch.empty(n * ng, dtype=dt)
                w = d.all_to_all_single(out, inp, group=pg, async_op=a)
                exp = lambda: torch.cat([self._inp(spec, r, n * ng)[me * n:(me + 1) * n] for r in members])  # noqa: E731
            else:
                inp = self._inp(spec, self.rank, sum(S[me]))
                out = torch.empty(sum(S[q][me] for q in range(ng)), dtype=dt)
                w = d.all_to_all_single(out, inp, [S[q][me] for q in range(ng)], S[me], group=pg, async_op=a)

                def exp():
                    parts = []
                    for q, r in enumerate(members):
                        off = sum(S[q][:me])
                        parts.append(self._inp(spec, r, sum(S[q]))[off:off + S[q][me]])
                    return torch.cat(parts)
            outs.append(("output", out, exp))
        elif kind == "gather":
            t = self._inp(spec, self.rank, n)
            lst = [torch.empty(n, dtype=dt) for _ in members] if self.rank == root else None
            w = d.gather(t, gather_list=lst, dst=root, group=pg, async_op=a)
            if lst is not None:
                for j, r in enumerate(members):
                    outs.append((f"output[{j}]", lst[j], functools.partial(self._inp, spec, r, n)))
        elif kind == "scatter":
            out = torch.empty(n, dtype=dt)
            lst = [self._inp(spec, root, n, slot=j) for j in range(ng)] if self.rank == root else None
            w = d.scatter(out, scatter_list=lst, src=root, group=pg, async_op=a)
            outs.append(("output", out, lambda: self._inp(spec, root, n, slot=me)))
        elif kind == "barrier":
            w = d.barrier(group=pg, async_op=a)
        elif kind == "send_recv":
            src, dst = spec["root"], spec["peer"]
            if self.rank == src:
                w = (d.isend if a else d.send)(self._inp(spec, src, n), dst=dst, group=pg)
            elif self.rank == dst:
                t = torch.full((n,), 5, dtype=dt)
                w = (d.irecv if a else d.recv)(t, src=src, group=pg)
                outs.append(("output", t, lambda: self._inp(spec, src, n)))
            else:
                return None
            if not a:
                w = None
        elif kind == "ring":
            nxt, prv = members[(me + 1) % ng], members[(me - 1) % ng]
            t = torch.full((n,), 5, dtype=dt)
            ws = [d.isend(self._inp(spec, self.rank, n), dst=nxt, group=pg), d.irecv(t, src=prv, group=pg)]
            w = _Both(ws)
            outs.append(("output", t, lambda: self._inp(spec, prv, n)))
        else:
            raise ValueError(kind)
        return (w if a or kind == "ring" else None), outs

    def verify(self, spec, outs) -> None:
        if self._is_registered is not None and outs and all(self._is_registered(t) for _, t, _ in outs):
            self.registered += 1
        hit = self.corrupt is not None and spec["i"] >= self.corrupt and corrupt_target(spec)
        for what, t, exp in outs:
            want = exp()
            if hit:
                hit = self.corrupt = None
                want = want.clone()
                want[0] = want[0] + 1  # the self-test: the check must catch this and name the call
            check(t, want, spec, what, self.rank, self.groups)


class _Both:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def run_calls(seed: int, rank: int, world: int, calls: int, pgs: list, groups: list[list[int]],
              corrupt: int | None = None, progress=None, on_call=None, stats: dict | None = None, **plan) -> int:
    """Issues and checks `calls` calls of seed's sequence on this rank; returns how many this rank took part in.
    on_call(spec) runs before each call is issued (on every rank, member or not); `plan` goes to plan_calls;
    stats["registered"], when given, grows by the calls whose checked tensors all lay in t3d memory."""
    r = _Rank(seed, rank, world, groups, pgs, corrupt)
    order = random.Random(_mix(seed, rank, 99))  # each rank waits a batch in an order of its own
    done = 0
    last = time.monotonic()
    for step in plan_calls(seed, world, calls, groups, **plan):
        issued = []
        for spec in step:
            if on_call is not None:
                on_call(spec)
            try:
                got = r.issue(spec)
            except Exception as exc:
                raise RuntimeError(f"call {spec['i']} rank {rank}: {describe(spec, groups)}: raised {exc}") from exc
            if got is not None:
                issued.append((spec, got))
        if len(issued) > 1:
            order.shuffle(issued)
        for spec, (w, outs) in issued:
            try:
                if w is not None:
                    w.wait()
            except Exception as exc:
                raise RuntimeError(f"call {spec['i']} rank {rank}: {describe(spec, groups)}: wait raised {exc}") \
                    from exc
            r.verify(spec, outs)
            done += 1
        if progress is not None and time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(step[-1]["i"] + 1)
    if stats is not None:
        stats["registered"] = stats.get("registered", 0) + r.registered
    return done


# ---------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, init: str, seed: int, calls: int, hours: float, corrupt: int | None,
               timeout_s: float, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = 1
    try:
        import torch
        torch.set_num_threads(1)
        import torch.distributed as dist

        import t3d  # noqa: F401  (registers the backend)
        dist.init_process_group("t3d", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        groups = plan_groups(seed, world)
        pgs = [dist.group.WORLD] + [dist.new_group(g) for g in groups[1:]]
        q.put(("ready", rank, 0))
        t_end = time.monotonic() + hours * 3600
        rnd = 0
        total = 0
        stats: dict = {}
        while True:
            s = seed + rnd
            total += run_calls(s, rank, world, calls, pgs, groups, corrupt if rnd == 0 else None,
                               progress=lambda k, s=s, base=rnd * calls: q.put(("progress", rank, base + k, s)),
                               stats=stats)
            rnd += 1
            q.put(("round", rank, rnd * calls, s))
            if time.monotonic() >= t_end:
                break
        dist.barrier()
        dist.destroy_process_group()
        q.put(("done", rank, total, stats.get("registered", 0)))
        code = 0
    except BaseException as exc:  # noqa: BLE001
        msg = str(exc) if isinstance(exc, Mismatch) else traceback.format_exc()
        q.put(("failed", rank, msg))
    try:
        q.close()
        q.join_thread()
    finally:
        sys.stdout.flush()
        os._exit(code)


def run(nproc: int, calls: int, seed: int, hours: float = 0.0, corrupt: int | None = None, idle_s: float = 120.0,
        timeout_s: float = 60.0, log=print, registered: int | None = None) -> dict:
    """Runs the soak on nproc spawned ranks. Returns {"ok", "failures": {rank: message}, "hung": [ranks],
    "calls": calls issued by the world, "seconds", "registered": per rank, the calls whose checked tensors all lay in
    t3d memory}. A rank that reports nothing for idle_s counts as hung; t3d's own timeout (T3D_TIMEOUT_MS) is set to
    timeout_s so that a stuck collective becomes an error that names it. registered: allocate CPU tensors of at
    least this many bytes (positive) in t3d memory, and offer collectives from that size the in-place paths."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    os.environ.setdefault("T3D_TIMEOUT_MS", str(int(timeout_s * 1000)))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if registered is not None:
        os.environ["T3D_CPU_ALLOCATOR"] = "1"
        os.environ["T3D_SHM_MAPPED_BYTES"] = str(registered)
    t0 = time.monotonic()
    res = {"ok": False, "failures": {}, "hung": [], "calls": 0, "seconds": 0.0, "rounds": 0, "registered": {}}
    with tempfile.TemporaryDirectory(prefix="t3d-soak-") as tmp:
        procs = [ctx.Process(target=_rank_main, name=f"soak-rank{r}",
                             args=(r, nproc, os.path.join(tmp, "init"), seed, calls, hours, corrupt, timeout_s, q))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        done, last_msg, where = set(), time.monotonic(), {}
        last_log, t_fail = 0.0, None
        try:
            while len(done) < nproc:
                try:
                    m = q.get(timeout=1.0)
                except queue_mod.Empty:
                    m = None
                now = time.monotonic()
                if m is None:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done
                            and r not in res["failures"]]
                    if dead and q.empty():
                        for r in dead:
                            res["failures"][r] = f"process exited with code {procs[r].exitcode} without a report"
                        t_fail = t_fail or now
                    if t_fail is not None and (now - t_fail > 10 or len(done) + len(res["failures"]) == nproc):
                        break  # the others had their time to report what they saw
                    if now - last_msg > idle_s:
                        res["hung"] = sorted(set(range(nproc)) - done - set(res["failures"]))
                        log(f"soak: no progress for {idle_s:.0f} s; last call reached per rank: {where}")
                        break
                    continue
                last_msg = now
                kind, rank = m[0], m[1]
                if kind in ("progress", "round"):
                    where[rank] = m[2]
                    if kind == "round" and rank == 0:
                        res["rounds"] += 1
                    if rank == 0 and now - last_log > 30:
                        last_log = now
                        log(f"soak: {m[2]} calls (seed {m[3]}) after {now - t0:.0f} s")
                elif kind == "done":
                    done.add(rank)
                    res["registered"][rank] = m[3]
                elif kind == "failed":
                    res["failures"][rank] = m[2]
                    t_fail = t_fail or now
                    log(f"soak: rank {rank} failed:\n{m[2]}")
        finally:
            for p in procs:
                p.join(timeout=5 if len(done) == nproc else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    res["seconds"] = time.monotonic() - t0
    res["calls"] = max(where.values(), default=0)
    res["ok"] = len(done) == nproc and not res["failures"] and not res["hung"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m t3d.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="ranks (processes) on this host")
    ap.add_argument("--calls", type=int, default=10000, help="calls per round")
    ap.add_argument("--seed", type=int, default=1, help="seed of the first round (round k uses seed + k)")
    ap.add_argument("--hours", type=float, default=0.0, help="keep running rounds for this long (0: one round)")
    ap.add_argument("--timeout", type=float, default=60.0, help="t3d/torch timeout of one call, seconds")
    ap.add_argument("--corrupt", type=int, default=None,
                    help="self-test: alter the expected value of this call (or the next one with a checked output)")
    ap.add_argument("--registered", type=int, default=None, metavar="BYTES",
                    help="allocate CPU tensors of at least BYTES in t3d memory and offer collectives from BYTES "
                         "the in-place paths (T3D_CPU_ALLOCATOR=1, T3D_SHM_MAPPED_BYTES=BYTES)")
    a = ap.parse_args(argv)
    if a.registered is not None and a.registered <= 0:
        ap.error(f"--registered must be a positive number of bytes, got {a.registered}")
    print(f"soak: {a.nproc} ranks, {a.calls} calls per round, seed {a.seed}"
          + (f", {a.hours} h" if a.hours else ""), flush=True)
    res = run(a.nproc, a.calls, a.seed, a.hours, a.corrupt, idle_s=max(120.0, 2 * a.timeout), timeout_s=a.timeout,
              log=lambda s: print(s, flush=True), registered=a.registered)
    if res["ok"]:
        print(f"soak: OK: {res['calls']} calls in {res['rounds']} round(s), {res['seconds']:.1f} s, every element "
              f"checked on every rank", flush=True)
        if a.registered is not None:
            per = ", ".join(f"{res['registered'].get(r, 0)}" for r in range(a.nproc))
            print(f"soak: calls with every checked tensor in t3d memory, per rank: {per}", flush=True)
        return 0
    for r, msg in sorted(res["failures"].items()):
        print(f"soak: FAILED on rank {r}: {msg}", flush=True)
    if res["hung"]:
        print(f"soak: HUNG: ranks {res['hung']}", flush=True)
    again = f" --registered {a.registered}" if a.registered is not None else ""
    print(f"soak: reproduce with: python -m t3d.soak --nproc {a.nproc} --calls {a.calls} --seed {a.seed}{again}",
          flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
