# Every torch.distributed collective and P2P call over dtypes x reduce ops x world sizes 1-4, checked against values
# each rank computes on its own from the known per-rank inputs. One world per world size runs all checks.
import os
import tempfile
import zlib

import pytest

import _dist

WORLD_SIZES = [1, 2, 3, 4]
DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64", "int8", "uint8", "bool", "complex64"]
FLOATS = {"float32", "float64", "bfloat16", "float16"}
INTS = {"int32", "int64", "int8", "uint8"}
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BOR", "BXOR"]
PREMUL_FACTOR = 0.5
SIZES = [1, 13, 4099]


def op_valid(op, dt):
    """Whether torch accepts this op for this dtype (the checks only cover accepted combinations)."""
    if dt == "complex64":
        return op in ("SUM", "AVG", "PREMUL_SUM")   # torch views complex as float pairs for these only
    if dt in FLOATS:
        return op not in ("BAND", "BOR", "BXOR")
    if dt == "bool":
        return op not in ("AVG", "PREMUL_SUM")
    return op != "PREMUL_SUM"


def gloo_skip(coll, op=None, dt=None):
    if not _dist.is_gloo():
        return None
    if op == "PREMUL_SUM":
        return "gloo: Cannot use ReduceOp.PREMUL_SUM with Gloo"
    if op == "AVG" and dt in INTS:
        return "gloo computes AVG in floating point and cannot write it to an integer tensor"
    if coll == "all_to_all":
        return "gloo: Backend gloo does not support alltoall (list form)"
    if coll in ("reduce_scatter", "reduce_scatter_tensor") and op in ("BAND", "BOR", "BXOR") and dt == "bool":
        return "gloo reduce_scatter has no bitwise ops for bool"
    if coll == "reduce_scatter_tensor_stacked":
        return ("gloo rejects the documented stacked input [ws, *out.shape]: output with shape [n] doesn't match "
                "the broadcast shape [1, n]")
    if coll == "all_gather_into_tensor_stacked":
        return ("gloo rejects the documented stacked output [ws, *in.shape]: ProcessGroupGloo::allgather: invalid "
                "tensor size")
    if coll == "gather" and dt == "complex64":
        return "gloo gather: Invalid scalar type (no complex)"
    if coll == "bad_input-reduce_scatter_tensor_input_size":
        return ("gloo aborts the process (SIGABRT): ProcessGroupGloo.cpp Check failed: outputShape[0] * worldSize "
                "== inputShape[0]")
    if coll.startswith("mismatch"):
        return "gloo does not compare dtypes or sizes across ranks"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Helpers that run in the children
# ---------------------------------------------------------------------------------------------------------------

def _torch():
    import torch
    import torch.distributed as dist
    return torch, dist


def _gen(*seed):
    torch, _ = _torch()
    s = zlib.crc32(repr(seed).encode())   # not hash(): that differs between processes
    return torch.Generator().manual_seed(s)


def reduce_input(rank, ws, n, dt, op, salt=0):
    """Per-rank input for a reduction, chosen so the exact result is representable in dt."""
    torch, _ = _torch()
    g = _gen("red", rank, n, dt, op, salt)
    shared = _gen("shared", n, dt, op, salt)   # the same on every rank
    tdt = getattr(torch, dt)
    if dt == "bool":
        p = {"SUM": 0.2, "MAX": 0.2, "BOR": 0.2, "PRODUCT": 0.85, "MIN": 0.85, "BAND": 0.85}.get(op, 0.5)
        return torch.rand(n, generator=g) < p
    if dt == "complex64":
        re = torch.randint(-4, 5, (n,), generator=g).double()
        im = torch.randint(-4, 5, (n,), generator=g).double()
        return torch.complex(re, im).to(tdt)
    if dt in FLOATS:
        if op in ("SUM", "PREMUL_SUM"):
            v = torch.randint(-8, 9, (n,), generator=g).double()
        elif op == "PRODUCT":
            choices = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
            v = choices[torch.randint(0, 6, (n,), generator=g)]
        elif op == "AVG":
            v = torch.randint(-64, 65, (n,), generator=g).double() / 4
        else:  # MIN / MAX: any value, rounded to dt first so the expected value is exactly one of the inputs
            v = torch.randn(n, generator=g, dtype=torch.float64) * 100
        return v.to(tdt)
    info = torch.iinfo(tdt)
    if op == "SUM":
        lo, hi = {"int8": (-30, 31), "uint8": (0, 61), "int32": (-10 ** 6, 10 ** 6),
                  "int64": (-2 ** 40, 2 ** 40)}[dt]
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(tdt)
    if op == "PRODUCT":
        choices = {"int8": [-2, -1, 1, 2], "uint8": [1, 2, 3], "int32": [-3, -2, -1, 1, 2, 3],
                   "int64": [-1000, -3, 1, 2, 997]}[dt]
        c = torch.tensor(choices, dtype=torch.int64)
        return c[torch.randint(0, len(choices), (n,), generator=g)].to(tdt)
    if op == "AVG":
        # base (shared) + k * (2r - ws + 1): the offsets cancel over the ranks, so the mean is exactly base.
        # Ranges keep the intermediate sum inside the type too (int8/uint8 AVG that overflows the sum is
        # implementation-defined: NCCL sums in the element type, then divides).
        lo, hi, kmax = {"int8": (-20, 21, 2), "uint8": (10, 51, 3), "int32": (-10 ** 6, 10 ** 6, 1000),
                        "int64": (-2 ** 40, 2 ** 40, 10 ** 6)}[dt]
        base = torch.randint(lo, hi, (n,), generator=shared, dtype=torch.int64)
        k = torch.randint(0, kmax + 1, (n,), generator=_gen("k", n, dt, salt), dtype=torch.int64)
        return (base + k * (2 * rank - ws + 1)).to(tdt)
    # MIN / MAX / bitwise: the whole range of the type
    lo, hi = max(info.min, -2 ** 62), min(info.max, 2 ** 62)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(tdt)


def expected_reduction(inputs, op, dt):
    """Reduces a list of per-rank tensors in a wide type without any collective."""
    torch, _ = _torch()
    tdt = getattr(torch, dt)
    ws = len(inputs)
    if dt == "bool":
        x = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        if op == "BXOR":
            return (x.to(torch.int64).sum(0) % 2).bool()
    if dt == "complex64":
        x = torch.stack([t.to(torch.complex128) for t in inputs])
    elif dt in FLOATS:
        x = torch.stack([t.double() for t in inputs])
    else:
        x = torch.stack([t.to(torch.int64) for t in inputs])
    if op == "SUM":
        r = x.sum(0)
    elif op == "PRODUCT":
        r = x.prod(0)
    elif op == "MIN":
        r = x.amin(0)
    elif op == "MAX":
        r = x.amax(0)
    elif op == "AVG":
        r = x.sum(0) / ws if dt not in INTS else torch.div(x.sum(0), ws, rounding_mode="floor")
    elif op == "PREMUL_SUM":
        r = (x * PREMUL_FACTOR).sum(0)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        r = x[0]
        for i in range(1, ws):
            r = fn(r, x[i])
    return r.to(tdt)


def make_op(op):
    _, dist = _torch()
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, op)


def assert_values(actual, expected, what, op=None):
    torch, _ = _torch()
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if op in ("AVG",) and (actual.is_floating_point() or actual.is_complex()):
        eps = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 2e-6, torch.float64: 1e-12,
               torch.complex64: 2e-6}[actual.dtype]
        torch.testing.assert_close(actual, expected, rtol=eps, atol=eps, msg=lambda m: f"{what}: {m}")
        return
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero().flatten()
        i = int(bad[0]) if bad.numel() else 0
        raise AssertionError(f"{what}: {bad.numel()} of {actual.numel()} elements differ; first at index {i}: "
                             f"got {actual.flatten()[i].item()!r}, expected {expected.flatten()[i].item()!r}")


def roots(ws):
    return sorted({0, ws - 1})


# ---------------------------------------------------------------------------------------------------------------
# Reductions: one check per (collective, op, dtype)
# ---------------------------------------------------------------------------------------------------------------

def chk_all_reduce(rank, ws, op, dt):
    torch, dist = _torch()
    for n in SIZES:
        inputs = [reduce_input(r, ws, n, dt, op) for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t, op=make_op(op))
        assert_values(t, expected_reduction(inputs, op, dt), f"all_reduce {op} {dt} n={n} rank {rank}", op)


def chk_reduce(rank, ws, op, dt):
    torch, dist = _torch()
    for dst in roots(ws):
        for n in SIZES:
            inputs = [reduce_input(r, ws, n, dt, op, salt=dst) for r in range(ws)]
            t = inputs[rank].clone()
            dist.reduce(t, dst, op=make_op(op))
            if rank == dst:
                assert_values(t, expected_reduction(inputs, op, dt), f"reduce {op} {dt} n={n} dst={dst}", op)


def chk_reduce_scatter(rank, ws, op, dt):
    torch, dist = _torch()
    for n in SIZES:
        # chunks[r][p]: what rank r contributes to rank p's result
        chunks = [[reduce_input(r, ws, n, dt, op, salt=100 + p) for p in range(ws)] for r in range(ws)]
        out = torch.empty(n, dtype=getattr(torch, dt))
        dist.reduce_scatter(out, [c.clone() for c in chunks[rank]], op=make_op(op))
        exp = expected_reduction([chunks[r][rank] for r in range(ws)], op, dt)
        assert_values(out, exp, f"reduce_scatter {op} {dt} n={n} rank {rank}", op)


def chk_reduce_scatter_tensor(rank, ws, op, dt):
    torch, dist = _torch()
    for n in SIZES:
        chunks = [[reduce_input(r, ws, n, dt, op, salt=200 + p) for p in range(ws)] for r in range(ws)]
        inp = torch.cat(chunks[rank])
        out = torch.empty(n, dtype=getattr(torch, dt))
        dist.reduce_scatter_tensor(out, inp, op=make_op(op))
        exp = expected_reduction([chunks[r][rank] for r in range(ws)], op, dt)
        assert_values(out, exp, f"reduce_scatter_tensor {op} {dt} n={n} rank {rank}", op)


# ---------------------------------------------------------------------------------------------------------------
# Data movement: one check per (collective, dtype)
# ---------------------------------------------------------------------------------------------------------------

def data(rank, n, dt, salt=0):
    """Distinct per-rank data using the dtype's whole range."""
    torch, _ = _torch()
    g = _gen("data", rank, n, dt, salt)
    tdt = getattr(torch, dt)
    if dt == "bool":
        return torch.rand(n, generator=g) < 0.5
    if dt == "complex64":
        return torch.randn(n, generator=g, dtype=torch.complex64)
    if dt in FLOATS:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 1000).to(tdt)
    info = torch.iinfo(tdt)
    return torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), (n,), generator=g,
                         dtype=torch.int64).to(tdt)


def chk_broadcast(rank, ws, dt):
    torch, dist = _torch()
    for src in roots(ws):
        for n in SIZES:
            t = data(rank, n, dt, salt=src)
            dist.broadcast(t, src)
            assert_values(t, data(src, n, dt, salt=src), f"broadcast {dt} n={n} src={src} rank {rank}")


def chk_reduce_scatter_tensor_stacked(rank, ws):
    """The documented second input layout: [world_size, *output.shape]."""
    torch, dist = _torch()
    for dt in ("float32", "int64"):
        for shape in ((5,), (2, 3)):
            chunks = [[reduce_input(r, ws, 6, dt, "SUM", salt=p)[:int(torch.tensor(shape).prod())].view(shape)
                       for p in range(ws)] for r in range(ws)]   # integer values: exact in any summation order
            out = torch.empty(shape, dtype=getattr(torch, dt))
            dist.reduce_scatter_tensor(out, torch.stack(chunks[rank]))
            exp = expected_reduction([chunks[r][rank] for r in range(ws)], "SUM", dt)
            assert_values(out, exp, f"reduce_scatter_tensor stacked input {dt} shape {shape} rank {rank}")


def chk_all_gather(rank, ws, dt):
    torch, dist = _torch()
    for n in SIZES:
        outs = [torch.empty(n, dtype=getattr(torch, dt)) for _ in range(ws)]
        dist.all_gather(outs, data(rank, n, dt))
        for r in range(ws):
            assert_values(outs[r], data(r, n, dt), f"all_gather {dt} n={n} slot {r} on rank {rank}")


def chk_all_gather_into_tensor(rank, ws, dt):
    torch, dist = _torch()
    for n in SIZES:
        exp = torch.cat([data(r, n, dt) for r in range(ws)])
        out = torch.empty(ws * n, dtype=getattr(torch, dt))
        dist.all_gather_into_tensor(out, data(rank, n, dt))
        assert_values(out, exp, f"all_gather_into_tensor {dt} n={n} rank {rank}")


def chk_all_gather_into_tensor_stacked(rank, ws):
    """The documented second output layout: [world_size, *input.shape]."""
    torch, dist = _torch()
    for dt in ("float32", "int64", "bool"):
        for shape in ((5,), (2, 3)):
            out = torch.empty((ws,) + shape, dtype=getattr(torch, dt))
            dist.all_gather_into_tensor(out, data(rank, 6, dt)[:int(torch.tensor(shape).prod())].view(shape))
            exp = torch.stack([data(r, 6, dt)[:int(torch.tensor(shape).prod())].view(shape) for r in range(ws)])
            assert_values(out, exp, f"all_gather_into_tensor stacked output {dt} shape {shape} rank {rank}")


def chk_gather(rank, ws, dt):
    torch, dist = _torch()
    for dst in roots(ws):
        for n in SIZES:
            lst = [torch.empty(n, dtype=getattr(torch, dt)) for _ in range(ws)] if rank == dst else None
            dist.gather(data(rank, n, dt, salt=dst), lst, dst=dst)
            if rank == dst:
                for r in range(ws):
                    assert_values(lst[r], data(r, n, dt, salt=dst), f"gather {dt} n={n} dst={dst} slot {r}")


def chk_scatter(rank, ws, dt):
    torch, dist = _torch()
    for src in roots(ws):
        for n in SIZES:
            lst = [data(100 + p, n, dt, salt=src) for p in range(ws)] if rank == src else None
            out = torch.empty(n, dtype=getattr(torch, dt))
            dist.scatter(out, lst, src=src)
            assert_values(out, data(100 + rank, n, dt, salt=src), f"scatter {dt} n={n} src={src} rank {rank}")


def split_size(src, dst, ws):
    """Rows that src sends dst: uneven, with zeros."""
    return (2 * src + 3 * dst + ws) % 4


def chk_all_to_all_single(rank, ws, dt):
    torch, dist = _torch()
    tdt = getattr(torch, dt)
    cols = 3
    # Equal splits (no split sizes given)
    rows = 2
    inp = data(rank, ws * rows * cols, dt, salt=1).view(ws * rows, cols)
    out = torch.empty(ws * rows, cols, dtype=tdt)
    dist.all_to_all_single(out, inp)
    exp = torch.cat([data(r, ws * rows * cols, dt, salt=1).view(ws, rows, cols)[rank] for r in range(ws)])
    assert_values(out, exp, f"all_to_all_single equal splits {dt} rank {rank}")
    # Uneven and zero splits
    in_splits = [split_size(rank, p, ws) for p in range(ws)]
    out_splits = [split_size(p, rank, ws) for p in range(ws)]

    def rank_input(r):
        total = sum(split_size(r, p, ws) for p in range(ws))
        return data(r, total * cols, dt, salt=2).view(total, cols)
    inp = rank_input(rank)
    out = torch.empty(sum(out_splits), cols, dtype=tdt)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    parts = []
    for r in range(ws):
        off = sum(split_size(r, p, ws) for p in range(rank))
        parts.append(rank_input(r)[off:off + split_size(r, rank, ws)])
    assert_values(out, torch.cat(parts), f"all_to_all_single splits in={in_splits} out={out_splits} {dt} "
                                         f"rank {rank}")
    # A rank that sends nothing at all (rank 0) while others still exchange
    in_splits = [0 if rank == 0 else split_size(rank, p, ws) for p in range(ws)]
    out_splits = [0 if p == 0 else split_size(p, rank, ws) for p in range(ws)]
    total = sum(in_splits)
    inp = data(rank, total * cols, dt, salt=3).view(total, cols)
    out = torch.empty(sum(out_splits), cols, dtype=tdt)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    parts = []
    for r in range(1, ws):
        tot = sum(split_size(r, p, ws) for p in range(ws))
        off = sum(split_size(r, p, ws) for p in range(rank))
        parts.append(data(r, tot * cols, dt, salt=3).view(tot, cols)[off:off + split_size(r, rank, ws)])
    exp = torch.cat(parts) if parts else torch.empty(0, cols, dtype=tdt)
    assert_values(out, exp, f"all_to_all_single with rank 0 sending nothing {dt} rank {rank}")


def chk_all_to_all(rank, ws, dt):
    torch, dist = _torch()
    tdt = getattr(torch, dt)
    ins = [data(rank * 10 + p, split_size(rank, p, ws), dt, salt=4) for p in range(ws)]
    outs = [torch.empty(split_size(p, rank, ws), dtype=tdt) for p in range(ws)]
    dist.all_to_all(outs, ins)
    for p in range(ws):
        assert_values(outs[p], data(p * 10 + rank, split_size(p, rank, ws), dt, salt=4),
                      f"all_to_all {dt} from {p} on rank {rank}")


# ---------------------------------------------------------------------------------------------------------------
# P2P, barrier, async, layout and error checks
# ---------------------------------------------------------------------------------------------------------------

def chk_send_recv(rank, ws):
    torch, dist = _torch()
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    for n in (1, 1000, 70000):
        t = torch.empty(n)
        if rank == 0:   # serialised ring: blocking calls cannot deadlock
            dist.send(data(rank, n, "float32"), nxt)
            dist.recv(t, prv)
        else:
            dist.recv(t, prv)
            dist.send(data(rank, n, "float32"), nxt)
        assert_values(t, data(prv, n, "float32"), f"recv n={n} from {prv} on rank {rank}")
    # Tags keep messages apart
    if rank == 0:
        dist.send(torch.full((4,), 7.0), 1, tag=7)
        dist.send(torch.full((4,), 3.0), 1, tag=3)
    elif rank == 1:
        a, b = torch.empty(4), torch.empty(4)
        dist.recv(a, 0, tag=7)
        dist.recv(b, 0, tag=3)
        assert a.eq(7).all() and b.eq(3).all(), f"tagged recv got {a.tolist()} / {b.tolist()}"


def chk_isend_irecv(rank, ws):
    torch, dist = _torch()
    reqs, bufs = [], {}
    for p in range(ws):
        if p == rank:
            continue
        bufs[p] = torch.empty(33, dtype=torch.int64)
        reqs.append(dist.irecv(bufs[p], p))
    for p in range(ws):
        if p != rank:
            reqs.append(dist.isend(torch.arange(33, dtype=torch.int64) + 1000 * rank + p, p))
    for r in reqs:
        r.wait()
    for p, b in bufs.items():
        assert_values(b, torch.arange(33, dtype=torch.int64) + 1000 * p + rank, f"irecv from {p} on rank {rank}")


def chk_recv_any_source(rank, ws):
    torch, dist = _torch()
    if rank == 0:
        seen = []
        for _ in range(ws - 1):
            t = torch.empty(5, dtype=torch.int64)
            src = dist.recv(t, src=None)
            assert t.eq(src * 11).all(), f"recv(src=None) said sender {src} but data is {t.tolist()}"
            seen.append(src)
        assert sorted(seen) == list(range(1, ws)), f"recv(src=None) senders {seen}"
    else:
        dist.send(torch.full((5,), rank * 11, dtype=torch.int64), 0)


def chk_barrier(rank, ws, shared_dir):
    _, dist = _torch()
    import time
    d = os.path.join(shared_dir, f"barrier-{ws}")
    os.makedirs(d, exist_ok=True)
    for rnd in range(3):
        if rank == rnd % ws:
            time.sleep(0.3)   # the late rank: nobody may leave the barrier before it arrives
        open(os.path.join(d, f"{rnd}-{rank}"), "w").close()
        dist.barrier()
        missing = [r for r in range(ws) if not os.path.exists(os.path.join(d, f"{rnd}-{r}"))]
        assert not missing, f"barrier round {rnd}: rank {rank} left before ranks {missing} arrived"


def chk_async_ops(rank, ws):
    torch, dist = _torch()
    inputs = [data(r, 100, "float32").round() for r in range(ws)]
    exp = torch.stack(inputs).sum(0)
    t = inputs[rank].clone()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert work.is_completed(), "work.is_completed() is False after wait()"
    assert_values(t, exp, "async all_reduce after wait()")
    t = inputs[rank].clone()
    fut = dist.all_reduce(t, async_op=True).get_future()
    val = fut.wait()
    assert isinstance(val, list) and len(val) == 1, f"all_reduce future value: {type(val)} {val!r}"
    assert_values(val[0], exp, "all_reduce future value")
    assert_values(t, exp, "all_reduce tensor after future wait")
    t = inputs[rank].clone()
    chained = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] / 2)
    assert_values(chained.wait(), exp / 2, "future.then result")
    # Many in flight, waited in reverse order
    ts = [inputs[rank].clone() * (i + 1) for i in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        assert_values(x, exp * (i + 1), f"in-flight all_reduce #{i}")
    # Other collectives, async
    b = data(rank, 50, "float32")
    dist.broadcast(b, ws - 1, async_op=True).wait()
    assert_values(b, data(ws - 1, 50, "float32"), "async broadcast")
    out = torch.empty(ws * 7)
    dist.all_gather_into_tensor(out, data(rank, 7, "float32"), async_op=True).wait()
    assert_values(out, torch.cat([data(r, 7, "float32") for r in range(ws)]), "async all_gather_into_tensor")
    rs = torch.empty(5)
    dist.reduce_scatter_tensor(rs, torch.cat([inputs[rank][:5]] * ws), async_op=True).wait()
    assert_values(rs, exp[:5], "async reduce_scatter_tensor")
    out = torch.empty(ws * 2)
    fut = dist.all_to_all_single(out, torch.arange(ws * 2, dtype=torch.float32) + 100 * rank,
                                 async_op=True).get_future()
    fut.wait()
    exp_a2a = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(ws)])
    assert_values(out, exp_a2a, "async all_to_all_single via future")
    dist.barrier(async_op=True).wait()


def chk_non_contiguous(rank, ws):
    """A transposed tensor either gives the right values in place, or an error that says contiguous."""
    torch, dist = _torch()
    inputs = [data(r, 12, "float32").round().view(3, 4) for r in range(ws)]
    exp = torch.stack(inputs).sum(0).t()
    t = inputs[rank].clone().t()
    assert not t.is_contiguous()
    try:
        dist.all_reduce(t)
    except Exception as e:
        assert "contiguous" in str(e).lower(), f"non-contiguous all_reduce raised without saying why: {e}"
    else:
        assert_values(t, exp, "all_reduce on a transposed tensor")
    b = data(rank, 12, "float32").view(3, 4).t()
    try:
        dist.broadcast(b, 0)
    except Exception as e:
        assert "contiguous" in str(e).lower(), f"non-contiguous broadcast raised without saying why: {e}"
    else:
        assert_values(b, data(0, 12, "float32").view(3, 4).t(), "broadcast into a transposed tensor")
    src = data(rank, 12, "float32").view(3, 4).t()
    out = torch.empty(ws * 4, 3)
    try:
        dist.all_gather_into_tensor(out, src)
    except Exception as e:
        assert "contiguous" in str(e).lower(), f"non-contiguous all_gather_into_tensor input error: {e}"
    else:
        exp = torch.cat([data(r, 12, "float32").view(3, 4).t() for r in range(ws)])
        assert_values(out, exp, "all_gather_into_tensor from a transposed tensor")


def _expect_error(fn, words, what):
    try:
        fn()
    except Exception as e:
        text = str(e).lower()
        assert any(w in text for w in words), f"{what}: error does not name the argument ({words}): {e}"
        return str(e)
    raise AssertionError(f"{what}: no error raised")


BAD_INPUT_CASES = ["all_gather_into_tensor_output_size", "reduce_scatter_tensor_input_size",
                   "all_gather_into_tensor_dtype", "all_to_all_single_splits", "all_gather_list_length"]


def chk_bad_input(rank, ws, case):
    """The same wrong call on every rank: an error naming the argument, on every rank, and no hang."""
    torch, dist = _torch()
    n = 3
    if case == "all_gather_into_tensor_output_size":
        _expect_error(lambda: dist.all_gather_into_tensor(torch.empty(ws * n + 1), torch.ones(n)),
                      ("output", "size"), "all_gather_into_tensor with a wrong output size")
    elif case == "reduce_scatter_tensor_input_size":
        _expect_error(lambda: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(ws * n + 2)),
                      ("input", "size"), "reduce_scatter_tensor with a wrong input size")
    elif case == "all_gather_into_tensor_dtype":
        _expect_error(lambda: dist.all_gather_into_tensor(torch.empty(ws * n, dtype=torch.float64), torch.ones(n)),
                      ("dtype", "type"), "all_gather_into_tensor with output dtype != input dtype")
    elif case == "all_to_all_single_splits":
        _expect_error(lambda: dist.all_to_all_single(torch.empty(ws), torch.ones(ws + 1), [1] * ws, [1] * ws),
                      ("split", "size", "input"), "all_to_all_single with splits that do not cover the input")
    elif case == "all_gather_list_length":
        _expect_error(lambda: dist.all_gather([torch.empty(n) for _ in range(ws + 1)], torch.ones(n)),
                      ("size", "list", "output", "world"), "all_gather with world_size+1 outputs")
    # The group must still work afterwards
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.eq(ws).all(), f"all_reduce after errors gave {t.tolist()}"


def chk_zero_size(rank, ws):
    torch, dist = _torch()
    t = torch.empty(0)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    out = torch.empty(0)
    dist.all_gather_into_tensor(out, torch.empty(0))
    dist.reduce_scatter_tensor(torch.empty(0), torch.empty(0))
    dist.all_to_all_single(torch.empty(0), torch.empty(0))
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.eq(ws).all(), f"all_reduce after zero-size calls gave {t.tolist()}"


def chk_large(rank, ws):
    torch, dist = _torch()
    n = (1 << 20) + 5
    inputs = [torch.randint(-100, 100, (n,), generator=_gen("large", r)).float() for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    assert_values(t, torch.stack(inputs).sum(0), f"all_reduce float32 n={n}")
    tb = inputs[rank].to(torch.bfloat16)
    dist.all_reduce(tb, op=dist.ReduceOp.MAX)
    assert_values(tb, torch.stack(inputs).amax(0).to(torch.bfloat16), f"all_reduce bfloat16 MAX n={n}")
    out = torch.empty(ws * n)
    dist.all_gather_into_tensor(out, inputs[rank])
    assert_values(out, torch.cat(inputs), f"all_gather_into_tensor n={n}")
    b = inputs[rank].clone()
    dist.broadcast(b, ws - 1)
    assert_values(b, inputs[ws - 1], f"broadcast n={n}")
    m = n // ws * ws
    rs = torch.empty(m // ws)
    dist.reduce_scatter_tensor(rs, inputs[rank][:m].clone())
    exp = torch.stack([x[:m] for x in inputs]).sum(0).view(ws, m // ws)[rank]
    assert_values(rs, exp, f"reduce_scatter_tensor n={m}")


def chk_coalescing(rank, ws):
    torch, dist = _torch()
    from torch.distributed.distributed_c10d import _coalescing_manager
    inputs = [[data(r, 17 + i, "float32").round() for i in range(3)] for r in range(ws)]
    ts = [x.clone() for x in inputs[rank]]
    with _coalescing_manager(async_ops=True) as cm:
        for x in ts:
            dist.all_reduce(x)
    cm.wait()
    for i, x in enumerate(ts):
        assert_values(x, torch.stack([inputs[r][i] for r in range(ws)]).sum(0), f"coalesced all_reduce #{i}")
    outs = [torch.empty(ws * 4) for _ in range(2)]
    with _coalescing_manager(async_ops=True) as cm:
        for i, o in enumerate(outs):
            dist.all_gather_into_tensor(o, data(rank, 4, "float32", salt=i))
    cm.wait()
    for i, o in enumerate(outs):
        assert_values(o, torch.cat([data(r, 4, "float32", salt=i) for r in range(ws)]), f"coalesced allgather #{i}")


def chk_functional(rank, ws):
    """Functional collectives (the path DTensor and context parallel take)."""
    torch, _ = _torch()
    import torch.distributed._functional_collectives as funcol
    import torch.distributed as dist
    group = dist.group.WORLD
    inputs = [data(r, 24, "float32").round().view(4, 6) for r in range(ws)]
    r = funcol.all_reduce(inputs[rank], "sum", group)
    assert_values(funcol.wait_tensor(r), torch.stack(inputs).sum(0), "funcol.all_reduce")
    g = funcol.all_gather_tensor(inputs[rank], 0, group)
    assert_values(funcol.wait_tensor(g), torch.cat(inputs), "funcol.all_gather_tensor")
    rs = funcol.reduce_scatter_tensor(torch.cat([inputs[rank]] * ws), "sum", 0, group)
    assert_values(funcol.wait_tensor(rs), torch.stack(inputs).sum(0), "funcol.reduce_scatter_tensor")
    a = funcol.all_to_all_single(torch.arange(ws * 3, dtype=torch.float32) + 100 * rank, None, None, group)
    exp = torch.cat([torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) + 100 * q for q in range(ws)])
    assert_values(funcol.wait_tensor(a), exp, "funcol.all_to_all_single")
    outs = funcol.all_gather_into_tensor_coalesced([inputs[rank], inputs[rank][0] * 2], group)
    outs = [funcol.wait_tensor(o) for o in outs]
    assert_values(outs[0], torch.cat(inputs), "funcol.all_gather_into_tensor_coalesced[0]")
    assert_values(outs[1], torch.cat([x[0] * 2 for x in inputs]), "funcol.all_gather_into_tensor_coalesced[1]")


def chk_mismatch(rank, ws, kind):
    """A call whose arguments disagree across ranks must raise (on every rank), not hang or corrupt data."""
    torch, dist = _torch()
    if kind == "dtype":   # same element size, so only a dtype comparison can tell
        dt = torch.float32 if rank == 0 else torch.int32
        _expect_error(lambda: dist.all_reduce(torch.ones(8, dtype=dt)), ("dtype", "type", "mismatch"),
                      "all_reduce with float32 on rank 0 and int32 elsewhere")
    else:
        n = 8 if rank == 0 else 9
        _expect_error(lambda: dist.all_reduce(torch.ones(n)), ("size", "count", "numel", "mismatch"),
                      "all_reduce with 8 elements on rank 0 and 9 elsewhere")


# ---------------------------------------------------------------------------------------------------------------
# The check lists and the pytest items
# ---------------------------------------------------------------------------------------------------------------

SHARED_DIR = tempfile.mkdtemp(prefix="t3d-coll-")
REDUCTIONS = [("all_reduce", chk_all_reduce), ("reduce", chk_reduce), ("reduce_scatter", chk_reduce_scatter),
              ("reduce_scatter_tensor", chk_reduce_scatter_tensor)]
MOVEMENT = [("broadcast", chk_broadcast), ("all_gather", chk_all_gather),
            ("all_gather_into_tensor", chk_all_gather_into_tensor), ("gather", chk_gather),
            ("scatter", chk_scatter), ("all_to_all_single", chk_all_to_all_single), ("all_to_all", chk_all_to_all)]
MISC = [("send_recv", chk_send_recv, (), 2), ("isend_irecv", chk_isend_irecv, (), 2),
        ("recv_any_source", chk_recv_any_source, (), 2), ("barrier", chk_barrier, (SHARED_DIR,), 1),
        ("reduce_scatter_tensor_stacked", chk_reduce_scatter_tensor_stacked, (), 1),
        ("async_ops", chk_async_ops, (), 1), ("non_contiguous", chk_non_contiguous, (), 1),
        ("zero_size", chk_zero_size, (), 1), ("large", chk_large, (), 1), ("coalescing", chk_coalescing, (), 1),
        ("functional_collectives", chk_functional, (), 1),
        ("all_gather_into_tensor_stacked", chk_all_gather_into_tensor_stacked, (), 1)] + [
        (f"bad_input-{c}", chk_bad_input, (c,), 1) for c in BAD_INPUT_CASES] + [
        ("mismatch-size", chk_mismatch, ("size",), 2),   # last: after a mismatch the group may be unusable
        ("mismatch-dtype", chk_mismatch, ("dtype",), 2)]


def all_checks(ws):
    """[(name, fn, args, skip_reason)] in run order."""
    out = []
    for coll, fn in REDUCTIONS:
        for op in OPS:
            for dt in DTYPES:
                if op_valid(op, dt):
                    out.append((f"{coll}-{op}-{dt}", fn, (op, dt), gloo_skip(coll, op, dt)))
    for coll, fn in MOVEMENT:
        for dt in DTYPES:
            out.append((f"{coll}-{dt}", fn, (dt,), gloo_skip(coll, dt=dt)))
    for name, fn, args, min_ws in MISC:
        skip = gloo_skip(name) or (f"needs at least {min_ws} ranks" if ws < min_ws else None)
        out.append((name, fn, args, skip))
    return out


def _params():
    ps = []
    for ws in WORLD_SIZES:
        for name, _, _, skip in all_checks(ws):
            marks = [pytest.mark.skip(reason=skip)] if skip else []
            ps.append(pytest.param(ws, name, marks=marks, id=f"ws{ws}-{name}"))
        ps.append(pytest.param(ws, "destroy_process_group", id=f"ws{ws}-destroy_process_group"))
    return ps


@pytest.mark.timeout(480)
@pytest.mark.parametrize("ws,name", _params())
def test_collective(world_cache, ws, name):
    checks = [(n, fn, args) for n, fn, args, skip in all_checks(ws) if not skip]
    outcomes = _dist.world_outcomes(world_cache, ("collectives", ws), checks, ws, budget=300.0)
    _dist.assert_outcome(outcomes, name)


def autoload_world(rank, ws):
    """Runs in a process that never imported t3d: the torch.backends entry point must have registered it."""
    import sys
    import torch
    import torch.distributed as dist
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "value": t.tolist(), "t3d_imported_by_torch": "t3d" in sys.modules}


@pytest.mark.skipif(_dist.is_gloo() or _dist.BACKEND != "t3d", reason="checks the t3d entry point")
@pytest.mark.timeout(200)
def test_autoload_without_import():
    res = _dist.run_world(autoload_world, 2, import_t3d=False, timeout=60)
    for r, out in enumerate(res):
        assert out["value"] == [3.0, 3.0, 3.0], f"rank {r}: {out}"
        assert out["backend"] == "t3d", f"rank {r}: {out}"
