#!/usr/bin/env python
"""Differential test harness: the same seeded random sequence of torch.distributed calls on t3d and on gloo.

Every rank joins the t3d default group (the _dist launcher does this) and creates, in the same order everywhere:
a gloo group over all ranks (the oracle), a gloo control group (only the harness's own agreement traffic uses it),
and per seed a t3d group over all ranks plus t3d and gloo subgroups over the same random subset of ranks.

A generator seeded by the seed (the same on every rank) produces call specs (plain dicts, printable). Tensor data
is derived from (seed, call index, slot, rank) with a torch.Generator, so every rank can regenerate every rank's
inputs: each call runs on t3d with fresh inputs, then on gloo with identical fresh inputs, and the outputs (and the
inputs that must stay unchanged, and the guard elements around strided/offset views) are compared element by element,
as are raised exceptions (coarsely, by family). Every call is also checked against a reference computed locally from
all ranks' inputs; where gloo legitimately cannot make the call, KNOWN_DIFFERENCES says so and why, and t3d is checked
against that reference alone. Cases where t3d is wrong go to T3D_BUGS (the generator marks them skipped).

Reproduce a reported mismatch with the line it prints, e.g.
    python tests/python/difftest.py --seed 7 --world 3 --calls 42          (the first 42 calls of seed 7)
    python tests/python/difftest.py --seed 7 --world 3 --only 41           (call 41 alone)
Soak:
    python tests/python/difftest.py --long --hours 2 --world 4 --seed 1000
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import traceback
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _dist  # noqa: E402

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "bool", "complex64"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}
INTS = {"int8", "uint8", "int32", "int64"}
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]
BITWISE = {"BAND", "BOR", "BXOR"}
PREMUL_FACTORS = [0.5, 2.0, -1.0, 0.25, 3.0]
DEFAULT_CALLS = 150
POLL_LIMIT_S = 20.0


def op_valid(op, dt, native_complex=False):
    """Whether the reduce op is generated for this dtype (a call t3d accepts). Complex: torch views it as float pairs
    for SUM, AVG and PREMUL_SUM (native_complex: the collective hands complex to the backend as is; only SUM is
    meaningful there). PREMUL_SUM on integers is a t3d extension (see KNOWN_DIFFERENCES)."""
    if dt == "complex64":
        return op == "SUM" if native_complex else op in ("SUM", "AVG", "PREMUL_SUM")
    if dt in FLOATS:
        return op not in BITWISE
    if dt == "bool":
        return op not in ("AVG", "PREMUL_SUM")
    return True


# ----------------------------------------------------------------------------------------------------------------
# The tables: legitimate differences between t3d and gloo, and t3d bugs (skipped by the generator)
# ----------------------------------------------------------------------------------------------------------------

class Known:
    """One legitimate difference. when(spec) -> bool selects the calls; check says how they are still checked:
      "reference": t3d against the locally computed reference; gloo is still called and must raise (gloo="raises"),
                   or is not called at all (gloo="skip": it would take the process down).
      "gloo_or_reference": gloo is called; where it raises (as described), t3d is checked against the reference,
                   else against gloo as usual.
      "both_raise": both must raise; the exception family is not compared.
      "gloo_with": gloo is called with the spec changed by the dict in `gloo` (e.g. {"wait": "wait"}) and compared as
                   usual; this applies whatever other entry matches too."""

    def __init__(self, name, when, differs, reason, check="reference", gloo="raises"):
        self.name, self.when, self.differs, self.reason = name, when, differs, reason
        self.check, self.gloo = check, gloo


def _k(s):
    return s.get("kind")


KNOWN_DIFFERENCES = [
    Known("gloo-premul-sum",
          lambda s: s.get("op") == "PREMUL_SUM" and _k(s) != "invalid",
          "gloo raises 'Cannot use ReduceOp.PREMUL_SUM with Gloo'; t3d computes sum(factor * x)",
          "PREMUL_SUM is an NCCL op that gloo never implemented; t3d supports it like NCCL"),
    Known("t3d-premul-sum-integer",
          lambda s: s.get("op") == "PREMUL_SUM" and s.get("dt") in INTS,
          "t3d accepts PREMUL_SUM on integer tensors: each rank's tensor is scaled in its own type (a whole factor "
          "multiplies exactly, wrapping; another goes through double, truncated toward zero and saturated), then "
          "summed (wrapping); gloo raises, and so would NCCL (TypeError 'PreMulSum Data type must be half, float, "
          "bfloat16 or double'). bool is refused by t3d too",
          "a deliberate t3d extension (c_src/base/reduce.c t3d__scale); checked against a reference with exactly those "
          "semantics"),
    Known("gloo-avg-integer",
          lambda s: s.get("op") == "AVG" and s.get("dt") in INTS,
          "gloo raises 'result type Float can't be cast to the desired output type' for AVG on integer tensors; "
          "t3d returns the integer mean",
          "gloo divides in floating point and cannot write that back to an integer tensor; t3d divides the integer "
          "sum by the group size like NCCL's ncclAvg (the data make the mean exact)"),
    Known("gloo-all-to-all-list",
          lambda s: _k(s) == "all_to_all",
          "gloo raises 'Backend gloo does not support alltoall' (torch 2.9's gloo; torch 2.15's serves it, "
          "and is then compared as usual)",
          "gloo implemented only the single-tensor all_to_all_single", check="gloo_or_reference"),
    Known("gloo-uneven-all-gather",
          lambda s: _k(s) == "all_gather" and len(set(s["sizes"])) > 1,
          "gloo raises 'ProcessGroupGloo::allgather: invalid tensor size'",
          "gloo requires every rank's tensor to have the same size; t3d agrees the sizes first (NCCL-like uneven "
          "all_gather through torch's all_gather list API)"),
    Known("gloo-complex-gather",
          lambda s: _k(s) == "gather" and s["dt"] == "complex64",
          "gloo raises 'Invalid scalar type'",
          "torch hands complex to gather's backend as is (no view_as_real) and gloo's gather has no complex type"),
    Known("gloo-stacked-all-gather-into-tensor",
          lambda s: _k(s) == "all_gather_into_tensor" and s["variant"] == "stacked",
          "gloo raises 'ProcessGroupGloo::allgather: invalid tensor size' for the output [group_size, *input.shape]",
          "torch documents that output layout; gloo only accepts the concatenated one"),
    Known("gloo-stacked-reduce-scatter-tensor",
          lambda s: _k(s) == "reduce_scatter_tensor" and s["variant"] == "stacked",
          "gloo aborts the process (SIGABRT: ProcessGroupGloo.cpp Check failed: outputShape[0] * worldSize == "
          "inputShape[0], or outputShape[i] == inputShape[i]) for the input [group_size, *output.shape]",
          "torch documents that input layout; gloo only accepts the concatenated one, and checks it with a CHECK "
          "that kills the process, so gloo is not called", gloo="skip"),
    Known("default-group-bad-root",
          lambda s: _k(s) == "invalid" and (s["case"].startswith("bad_root_") and s["case"] != "bad_root_tensor"
                                           or s["case"] == "send_bad_peer") and s["group"] == "world",
          "both raise, but torch checks a root/peer rank in Python (ValueError) only for groups other than the "
          "default one; on the default group (t3d) the backend raises RuntimeError",
          "a torch front-end difference between default and new groups, not between the backends",
          check="both_raise"),
    Known("gloo-strided-views",
          lambda s: (_k(s) in ("all_reduce", "reduce", "broadcast") and s["layout"] == "strided")
          or (_k(s) in ("scatter", "reduce_scatter") and "strided" in (s["in_layout"], s["out_layout"])),
          "gloo returns wrong values for tensors with gaps (a strided slice such as buf[::2]) and writes into the gaps "
          "outside the view; t3d gives the right values and leaves the gaps alone",
          "gloo runs these collectives on data_ptr() .. data_ptr() + numel() as if the tensor were contiguous (a "
          "gloo bug; gather, all_gather and all_to_all copy such tensors first). Not compared with gloo", gloo="skip"),
    Known("gloo-non-contiguous-all-to-all-single",
          lambda s: _k(s) == "all_to_all_single" and s["in_layout"] == "transposed",
          "gloo raises ValueError 'Tensors must be contiguous' for a non-contiguous input; t3d exchanges the rows "
          "of the transposed input",
          "gloo's alltoall_base requires contiguous tensors; t3d copies a non-contiguous input first. Not called on "
          "gloo: whether the input is contiguous depends on each rank's row count (0 or 1 rows are), so gloo would "
          "raise on some ranks and leave the others blocked in the call", gloo="skip"),
    Known("gloo-pg-allgather-complex",
          lambda s: _k(s) == "pg_multi" and s["variant"] == "allgather" and s["dt"] == "complex64",
          "gloo raises 'Invalid scalar type' for ProcessGroup.allgather on complex tensors",
          "the ProcessGroup-level call gets no view_as_real from torch (dist.all_gather does that) and gloo's "
          "allgather has no complex type; t3d moves complex as bytes"),
    Known("gloo-inference-tensor-copy-back",
          lambda s: s.get("mode") == "inference_issue" and (
              (_k(s) == "reduce_scatter_tensor" and s.get("async"))
              or (_k(s) == "coalesced" and s["variant"] == "mgr_reduce_scatter_tensor")),
          "gloo raises 'Inplace update to inference tensor outside InferenceMode is not allowed' at wait() "
          "(reduce_scatter_tensor, also in a coalescing block)",
          "the output is an inference tensor (made in inference_mode) and wait() runs outside it: gloo's "
          "reduce_scatter_tensor copies its result into the output at wait() under the waiting thread's state; t3d "
          "writes it under the state of the thread that issued the call"),
    Known("gloo-coalesced-single-strided-complex-element",
          lambda s: _k(s) == "coalesced" and s["variant"].endswith("all_reduce") and s["dt"] == "complex64"
          and s["sizes"] == [1] and s["layouts"] == ["strided"] and not s.get("alias"),
          "gloo's allreduce_coalesced of a single tensor that is a 1-element strided complex view raises 'unsupported "
          "operation: some elements of the input tensor and the written-to tensor refer to a single memory "
          "location'; t3d returns the sum",
          "gloo flattens a lone tensor with view(-1), which here aliases the input (the real view is [1, 2] with "
          "strides (4, 1)), and the copy back trips torch's partial-overlap check (2 elements, or a second "
          "tensor, and it copies instead)"),
    Known("gloo-non-contiguous-p2p",
          lambda s: _k(s) == "p2p" and any(m["layout"] == "strided" for m in s["msgs"]),
          "gloo raises 'input tensor has to be contiguous' for a strided send/recv tensor; t3d sends and receives "
          "it correctly",
          "gloo's p2p works on the raw buffer only. Not called on gloo: in a batch it raises after posting the "
          "earlier operations, which would leave unmatched messages in the gloo group", gloo="skip"),
    Known("gloo-recv-any-source-empty",
          lambda s: _k(s) == "p2p" and s["variant"] == "recv_any" and s["msgs"][0]["n"] == 0,
          "gloo's recv(src=None) of a 0-element tensor fails on the receiver ('enforce fail at "
          "gloo/transport/tcp/unbound_buffer.cc:184 offset < this->size. 0 vs 0'); t3d receives it and returns the "
          "sender",
          "a gloo bug; not called on gloo because the failed receive leaves the sent message unmatched and the gloo "
          "group then hangs", gloo="skip"),
    Known("gloo-avg-requires-grad",
          lambda s: _k(s) == "all_reduce" and s.get("op") == "AVG" and s.get("grad") and s.get("mode") == "plain",
          "gloo's all_reduce raises 'a leaf Variable that requires grad is being used in an in-place operation' for "
          "AVG on a tensor that requires grad (its reduce does not); t3d returns the mean",
          "gloo's all_reduce divides the sum in place with an autograd-visible op (grad mode is on); t3d writes raw "
          "memory"),
    Known("gloo-reduce-scatter-never-completes-without-wait",
          lambda s: _k(s) in ("reduce_scatter", "reduce_scatter_tensor") and s.get("async") and s.get("wait") == "poll",
          "gloo's reduce_scatter works report is_completed() == False until wait() is called (checked for 20 s); "
          "t3d's complete on their own",
          "gloo finishes these works (copy of the result) only inside wait(). gloo is called with wait() instead of "
          "polling and compared as usual", check="gloo_with", gloo={"wait": "wait"}),
    Known("gloo-aborts-reduce-scatter-tensor-size",
          lambda s: _k(s) == "invalid" and s["case"] == "rs_tensor_in_size",
          "gloo aborts the process (SIGABRT: ProcessGroupGloo.cpp Check failed: outputShape[0] * worldSize == "
          "inputShape[0]); t3d raises",
          "a gloo CHECK instead of an error; the reference is 'raises'", gloo="skip"),
]


class Bug:
    """A case where t3d is wrong (see /tmp/difftest_findings.md); the generator marks matching calls skipped."""

    def __init__(self, name, when, what, reproducer):
        self.name, self.when, self.what, self.reproducer = name, when, what, reproducer


# Fixed (kept as an example of an entry; see /tmp/difftest_findings.md):
#   t3d-copy-back-into-leaf-that-requires-grad: all_reduce / reduce / broadcast (non-root) on a non-contiguous leaf
#   that requires grad raised "a (view of a) leaf Variable that requires grad is being used in an in-place operation";
#   fixed by 283d3ec (copy-back below autograd). Entry form:
#   Bug(name, when=lambda spec: ..., what="what t3d does wrong", reproducer="python tests/python/difftest.py ...")
T3D_BUGS = []


_PRIORITY = {"reference/skip": 0, "reference/raises": 1, "gloo_or_reference/raises": 2, "both_raise/raises": 3,
             "gloo_with": 4}


def _prio(k):
    return _PRIORITY["gloo_with" if k.check == "gloo_with" else f"{k.check}/{k.gloo}"]


def known_differences(spec):
    """Every KNOWN_DIFFERENCES entry that matches the spec, the one that decides how it is checked first (an entry
    that must not call gloo wins over one that expects gloo to raise, and so on)."""
    found = [k for k in KNOWN_DIFFERENCES if k.when(spec)]
    return sorted(found, key=_prio)


def known_difference(spec):
    found = known_differences(spec)
    return found[0] if found else None


def gloo_spec(spec):
    """The spec as gloo runs it: with the changes of every matching "gloo_with" entry."""
    out = spec
    for k in known_differences(spec):
        if k.check == "gloo_with":
            out = dict(out, **k.gloo)
    return out


def t3d_bug(spec):
    for b in T3D_BUGS:
        if b.when(spec):
            return b
    return None


# ----------------------------------------------------------------------------------------------------------------
# Spec generation (pure Python; the same on every rank and in the parent)
# ----------------------------------------------------------------------------------------------------------------

LAYOUTS_1D = ["contig", "contig", "contig", "offset", "strided"]
LAYOUTS_ND = LAYOUTS_1D + ["transposed", "channels_last"]
MODES = ["plain"] * 6 + ["no_grad", "inference", "inference_issue"]
ASYNC_KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "barrier", "gather", "scatter",
               "all_gather_coalesced"]


def pick_n(rng):
    r = rng.random()
    if r < 0.06:
        return 0
    if r < 0.16:
        return 1
    if r < 0.55:
        return rng.randrange(2, 40) | 1
    if r < 0.88:
        return rng.randrange(40, 2000)
    return rng.randrange(4000, 70000)


def pick_shape(rng, layout, n=None):
    n = pick_n(rng) if n is None else n
    if layout == "transposed":
        a = rng.choice([1, 2, 3, 5, 7, 16])
        return [a, n // a if n >= a else rng.choice([0, 1, 3])]
    if layout == "channels_last":
        return [rng.randint(1, 3), rng.randint(2, 5), rng.randint(1, 6), rng.randint(1, 6)]
    if layout in ("contig", "offset") and rng.random() < 0.04:
        return []   # a 0-dim tensor
    if rng.random() < 0.15 and n >= 4:
        return [2, n // 2]
    return [n]


def pick_dt_op(rng, native_complex=False, ops=None):
    dt = rng.choice(DTYPES)
    cands = [o for o in (ops or OPS) if op_valid(o, dt, native_complex)]
    if not cands:
        dt = "float32"
        cands = [o for o in (ops or OPS) if op_valid(o, dt, native_complex)]
    return dt, rng.choice(cands)


def _red_fields(rng, dt, op):
    out = {"dt": dt, "op": op}
    if op == "PREMUL_SUM":
        out["factor"] = rng.choice(PREMUL_FACTORS)
    if (dt in FLOATS or dt == "complex64") and op in ("SUM", "AVG", "PREMUL_SUM") and rng.random() < 0.3:
        out["flavor"] = "noisy"
    elif dt in FLOATS and op in ("MIN", "MAX") and rng.random() < 0.3:
        out["flavor"] = "special"
    else:
        out["flavor"] = "exact"
    return out


def _move_flavor(rng, dt):
    return "special" if dt in FLOATS and rng.random() < 0.25 else "plain"


def _grad(rng, dt):
    """Whether the (leaf) tensor handed to the call requires grad (floating and complex only)."""
    return dt not in INTS and dt != "bool" and rng.random() < 0.15


def gen_all_reduce(rng, k, ws):
    layout = rng.choice(LAYOUTS_ND)
    s = dict(_red_fields(rng, *pick_dt_op(rng)), layout=layout, shape=pick_shape(rng, layout))
    s["grad"] = _grad(rng, s["dt"])
    return s


def gen_reduce(rng, k, ws):
    layout = rng.choice(LAYOUTS_ND)
    s = dict(_red_fields(rng, *pick_dt_op(rng, native_complex=True)), layout=layout, shape=pick_shape(rng, layout))
    s["grad"] = _grad(rng, s["dt"])
    s["root"] = rng.randrange(k)
    return s


def gen_broadcast(rng, k, ws):
    layout = rng.choice(LAYOUTS_ND)
    dt = rng.choice(DTYPES)
    return dict(dt=dt, flavor=_move_flavor(rng, dt), layout=layout, shape=pick_shape(rng, layout),
                root=rng.randrange(k), grad=_grad(rng, dt))


def gen_coalesced(rng, k, ws):
    variant = rng.choice(["func_all_reduce", "mgr_all_reduce", "mgr_all_gather_into_tensor",
                          "mgr_reduce_scatter_tensor"])
    m = rng.randint(1, 4)
    if variant == "mgr_all_gather_into_tensor":
        dt = rng.choice(DTYPES)
        s = dict(dt=dt, flavor=_move_flavor(rng, dt))
    else:
        s = _red_fields(rng, *pick_dt_op(rng, native_complex=variant == "mgr_reduce_scatter_tensor"))
    s.update(variant=variant, sizes=[pick_n(rng) % 3000 for _ in range(m)],
             layouts=[rng.choice(LAYOUTS_1D) for _ in range(m)])
    if variant.endswith("all_reduce") and m >= 2 and rng.random() < 0.4:
        s["alias"] = [rng.randrange(m) for _ in range(rng.randint(1, 2))]   # extra list entries: these tensors again
    return s


def gen_all_gather(rng, k, ws):
    dt = rng.choice(DTYPES)
    n = pick_n(rng) % 5000
    sizes = [n] * k if rng.random() < 0.75 else [rng.choice([0, 1, 3, 17, 100]) for _ in range(k)]
    return dict(dt=dt, flavor=_move_flavor(rng, dt), sizes=sizes, in_layout=rng.choice(LAYOUTS_1D),
                out_layout=rng.choice(LAYOUTS_1D), grad=_grad(rng, dt))


def gen_all_gather_into_tensor(rng, k, ws):
    dt = rng.choice(DTYPES)
    variant = rng.choice(["cat", "cat", "cat", "stacked", "inplace"])
    in_layout = rng.choice(LAYOUTS_1D + ["transposed"]) if variant != "inplace" else "contig"
    shape = (pick_shape(rng, in_layout) if variant != "inplace" else [pick_n(rng)])[:2] or [1]
    return dict(dt=dt, flavor=_move_flavor(rng, dt), variant=variant, shape=shape, in_layout=in_layout,
                out_layout=rng.choice(["contig", "contig", "offset", "strided"] if variant != "inplace"
                                      else ["contig"]))


def gen_all_gather_coalesced(rng, k, ws):
    m = rng.randint(1, 3)
    same = rng.random() < 0.75
    dt0 = rng.choice(DTYPES)
    dts = [dt0 if same else rng.choice(DTYPES) for _ in range(m)]
    sizes = [pick_n(rng) % 3000 for _ in range(m)]
    if not any(sizes):
        sizes[0] = 5   # torch: "At least one tensor has to be non empty"
    return dict(dts=dts, flavor="plain", sizes=sizes)


def gen_gather(rng, k, ws):
    dt = rng.choice(DTYPES)
    return dict(dt=dt, flavor=_move_flavor(rng, dt), n=pick_n(rng) % 20000, root=rng.randrange(k),
                in_layout=rng.choice(LAYOUTS_1D), out_layout=rng.choice(LAYOUTS_1D))


gen_scatter = gen_gather


def gen_reduce_scatter(rng, k, ws):
    s = _red_fields(rng, *pick_dt_op(rng, native_complex=True))
    s.update(n=pick_n(rng) % 20000, in_layout=rng.choice(LAYOUTS_1D), out_layout=rng.choice(LAYOUTS_1D))
    return s


def gen_reduce_scatter_tensor(rng, k, ws):
    s = _red_fields(rng, *pick_dt_op(rng, native_complex=True))
    variant = rng.choice(["cat", "cat", "cat", "stacked"])
    in_layout = rng.choice(LAYOUTS_1D + ["transposed"])
    shape = pick_shape(rng, in_layout)[:2] or [1]
    s.update(variant=variant, shape=shape, in_layout=in_layout, out_layout=rng.choice(LAYOUTS_1D))
    return s


def gen_all_to_all_single(rng, k, ws):
    dt = rng.choice(DTYPES)
    cols = rng.choice([0, 0, 1, 3, 8])
    if rng.random() < 0.5:
        splits = None
        rows = rng.choice([0, 1, 2, 5, 40, 1000])
    else:
        rows = None
        splits = [[rng.choice([0, 0, 1, 2, 3, 7, 50]) for _ in range(k)] for _ in range(k)]
    return dict(dt=dt, flavor=_move_flavor(rng, dt), cols=cols, rows=rows, splits=splits,
                in_layout=rng.choice(["contig", "contig", "offset"] + (["transposed"] if cols else [])),
                out_layout=rng.choice(["contig", "contig", "offset"]))


def gen_all_to_all(rng, k, ws):
    dt = rng.choice(DTYPES)
    return dict(dt=dt, flavor=_move_flavor(rng, dt),
                splits=[[rng.choice([0, 1, 2, 5, 33, 500]) for _ in range(k)] for _ in range(k)],
                in_layout=rng.choice(LAYOUTS_1D), out_layout=rng.choice(LAYOUTS_1D))


def gen_barrier(rng, k, ws):
    return {}


def gen_p2p(rng, k, ws):
    variant = rng.choice(["send_recv", "send_recv", "recv_any", "isend_irecv", "isend_irecv", "batch"])
    nmsg = 1 if variant in ("send_recv", "recv_any") else rng.randint(1, 6)
    msgs = []
    for _ in range(nmsg):
        src = rng.randrange(ws)
        dst = rng.choice([r for r in range(ws) if r != src])
        dt = rng.choice(DTYPES)
        msgs.append(dict(src=src, dst=dst, n=pick_n(rng), dt=dt, tag=rng.choice([0, 0, 1, 7, 1000]),
                         layout=rng.choice(LAYOUTS_1D)))
    return dict(variant=variant, msgs=msgs, flavor="plain")


def gen_objects(rng, k, ws):
    return dict(variant=rng.choice(["all_gather_object", "broadcast_object_list", "gather_object",
                                    "scatter_object_list"]),
                root=rng.randrange(k), m=rng.randint(1, 3), big=rng.random() < 0.2)


def gen_pg_multi(rng, k, ws):
    variant = rng.choice(["allreduce", "broadcast", "allgather"])
    m = rng.randint(1, 3)
    if variant == "allreduce":
        s = _red_fields(rng, *pick_dt_op(rng, native_complex=True,
                                         ops=["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]))
    else:
        dt = rng.choice(DTYPES)
        s = dict(dt=dt, flavor=_move_flavor(rng, dt))
    s.update(variant=variant, m=m, n=pick_n(rng) % 5000, root=rng.randrange(k), root_tensor=rng.randrange(m))
    return s


def gen_sparse(rng, k, ws):
    dense_shape = rng.choice([[7], [40], [1000], [5, 6], [30, 4], [3, 4, 2]])
    sparse_dim = rng.randint(1, len(dense_shape))
    return dict(dt=rng.choice(["float32", "float64", "int64", "int32"]), op="SUM", flavor="exact",
                shape=dense_shape, sparse_dim=sparse_dim, nnz_max=rng.choice([0, 1, 3, 10, 25]),
                coalesce=rng.random() < 0.5)


INVALID_CASES = ["bad_root_broadcast", "bad_root_reduce", "bad_root_gather", "bad_root_scatter",
                 "bad_root_tensor", "ag_tensor_out_size", "ag_tensor_dtype", "ag_list_len", "a2a_single_splits",
                 "band_float", "complex_max", "rs_tensor_in_size", "send_bad_peer", "ag_list_dtype",
                 "rs_list_len", "coalesced_mixed_dtype", "sparse_max"]


def gen_invalid(rng, k, ws):
    return dict(case=rng.choice(INVALID_CASES), n=rng.choice([1, 3, 10]))


GEN = {"all_reduce": gen_all_reduce, "coalesced": gen_coalesced, "reduce": gen_reduce, "broadcast": gen_broadcast,
       "all_gather": gen_all_gather, "all_gather_into_tensor": gen_all_gather_into_tensor,
       "all_gather_coalesced": gen_all_gather_coalesced, "gather": gen_gather, "scatter": gen_scatter,
       "reduce_scatter": gen_reduce_scatter, "reduce_scatter_tensor": gen_reduce_scatter_tensor,
       "all_to_all_single": gen_all_to_all_single, "all_to_all": gen_all_to_all, "barrier": gen_barrier,
       "p2p": gen_p2p, "objects": gen_objects, "pg_multi": gen_pg_multi, "sparse": gen_sparse,
       "invalid": gen_invalid}
WEIGHTS = {"all_reduce": 12, "coalesced": 5, "reduce": 5, "broadcast": 5, "all_gather": 5,
           "all_gather_into_tensor": 6, "all_gather_coalesced": 3, "gather": 4, "scatter": 4, "reduce_scatter": 4,
           "reduce_scatter_tensor": 5, "all_to_all_single": 5, "all_to_all": 3, "barrier": 2, "p2p": 6,
           "objects": 4, "pg_multi": 4, "sparse": 3, "invalid": 4, "async_batch": 6}
NO_ASYNC = {"p2p", "objects", "pg_multi", "invalid", "coalesced"}   # their own async forms, or none


def _gen_one(rng, kind, ws, sub, idx):
    # world: the t3d default group (gloo: a gloo group over all ranks); all: a t3d new_group over all ranks; sub: t3d
    # and gloo groups over the seed's subset of ranks. Point-to-point uses global ranks: world or all only.
    group = rng.choice(["world", "all"] if kind == "p2p" else ["world", "world", "all", "sub", "sub"])
    k = len(sub) if group == "sub" else ws
    s = {"i": idx, "kind": kind, "group": group, "k": k}
    s.update(GEN[kind](rng, k, ws))
    if kind == "invalid" and s["case"] == "send_bad_peer":
        s["group"], s["k"] = "world", ws
    s["async"] = kind not in NO_ASYNC and rng.random() < 0.3
    s["wait"] = rng.choice(["wait", "wait", "future", "poll"])
    return s


def generate(seed, ws, ncalls):
    """(subgroup ranks, [spec]) for a seed; the same on every rank and in the parent."""
    rng = random.Random(f"difftest:{seed}:{ws}")
    sub = sorted(rng.sample(range(ws), rng.randint(1, ws)))
    kinds = [k for k in WEIGHTS if not (k == "p2p" and ws < 2)]
    weights = [WEIGHTS[k] for k in kinds]
    specs = []
    for i in range(ncalls):
        kind = rng.choices(kinds, weights)[0]
        if kind == "async_batch":
            subs = []
            for j in range(rng.randint(2, 4)):
                sk = rng.choice(ASYNC_KINDS)
                ss = _gen_one(rng, sk, ws, sub, f"{i}.{j}")
                ss["async"] = True
                subs.append(ss)
            s = {"i": i, "kind": "async_batch", "calls": subs}
        else:
            s = _gen_one(rng, kind, ws, sub, i)
        s["mode"] = rng.choice(MODES)
        # After which calls the ranks compare notes (on the control group): always where an error is possible, else
        # at random, so that ranks also run ahead of each other between calls.
        s["sync"] = kind in ("invalid", "p2p") or rng.random() < 0.5
        for ss in (s["calls"] if kind == "async_batch" else [s]):
            ss["mode"] = s["mode"]
            b = t3d_bug(ss)
            if b is not None:
                ss["skip"] = b.name
            kds = known_differences(ss)
            if kds:
                ss["known"] = ",".join(k.name for k in kds)
                s["sync"] = True
        specs.append(s)
    return sub, specs


def short(spec):
    """One line describing a spec."""
    if spec.get("kind") == "async_batch":
        return "async_batch[" + "; ".join(short(c) for c in spec["calls"]) + f"] mode={spec.get('mode')}"
    keys = [k for k in spec if k not in ("i", "kind", "sync")]
    return f"#{spec['i']} {spec['kind']} " + " ".join(f"{k}={spec[k]}" for k in keys)


# ----------------------------------------------------------------------------------------------------------------
# Everything below runs in the ranks (torch imported lazily so that the parent stays light)
# ----------------------------------------------------------------------------------------------------------------

def _t():
    import torch
    import torch.distributed as dist
    return torch, dist


def _dtype(dt):
    torch, _ = _t()
    return getattr(torch, dt)


def _gen(*key):
    torch, _ = _t()
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def values(seed, i, slot, r, n, dt, op=None, flavor="plain", k=1, pos=0):
    """Deterministic 1-D contiguous data of global rank r for call i, the same in every process. op: the data feed
    that reduction (None: data movement, any bit pattern); k: the group size; pos: r's position in the group."""
    torch, _ = _t()
    tdt = _dtype(dt)
    if n == 0:
        return torch.empty(0, dtype=tdt)
    g = _gen(seed, i, slot, r)
    if op is None:   # data movement: any bit pattern
        if dt == "bool":
            return torch.rand(n, generator=g) < 0.5
        if dt == "complex64":
            return (torch.randn(n, generator=g, dtype=torch.complex64) * 100)
        if dt in FLOATS:
            v = (torch.randn(n, generator=g, dtype=torch.float64) * 1000).to(tdt)
            if flavor == "special":
                sp = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=tdt)
                pos = torch.randint(0, n, (min(n, 4),), generator=g)
                v[pos] = sp[:pos.numel()]
            return v
        info = torch.iinfo(tdt)
        return torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), (n,), generator=g,
                             dtype=torch.int64).to(tdt)
    if dt == "bool":
        p = {"SUM": 0.2, "MAX": 0.2, "BOR": 0.2, "PRODUCT": 0.85, "MIN": 0.85, "BAND": 0.85}.get(op, 0.5)
        return torch.rand(n, generator=g) < p
    if dt == "complex64":
        if flavor == "noisy":
            return torch.complex(torch.randn(n, generator=g).clamp(-4, 4), torch.randn(n, generator=g).clamp(-4, 4))
        re = torch.randint(-4, 5, (n,), generator=g).double()
        im = torch.randint(-4, 5, (n,), generator=g).double()
        return torch.complex(re, im).to(tdt)
    if dt in FLOATS:
        if flavor == "noisy" and op in ("SUM", "AVG", "PREMUL_SUM"):
            return torch.randn(n, generator=g, dtype=torch.float64).clamp(-4, 4).to(tdt)
        if op in ("SUM", "PREMUL_SUM"):
            return torch.randint(-8, 9, (n,), generator=g).double().to(tdt)
        if op == "PRODUCT":
            ch = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
            return ch[torch.randint(0, 6, (n,), generator=g)].to(tdt)
        if op == "AVG":
            return (torch.randint(-64, 65, (n,), generator=g).double() / 4).to(tdt)
        v = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(tdt)   # MIN / MAX
        if flavor == "special":
            sp = torch.tensor([float("inf"), float("-inf")], dtype=tdt)
            pos = torch.randint(0, n, (min(n, 2),), generator=g)
            v[pos] = sp[:pos.numel()]
        return v
    info = torch.iinfo(tdt)
    if op == "PRODUCT":
        ch = {"int8": [-7, -3, -1, 1, 2, 5], "uint8": [0, 1, 2, 3, 7], "int32": [-100, -3, -1, 1, 2, 99],
              "int64": [-1000, -3, 1, 2, 997]}[dt]
        c = torch.tensor(ch, dtype=torch.int64)
        return c[torch.randint(0, len(ch), (n,), generator=g)].to(tdt)
    if op == "AVG":
        # shared base + c * (2 pos - k + 1): the offsets cancel over the group, so the mean is exactly the base (any
        # rounding of the division gives it) and the sum stays inside the type.
        lo, hi, cmax = {"int8": (-20, 21, 2), "uint8": (10, 51, 3), "int32": (-10 ** 6, 10 ** 6, 1000),
                        "int64": (-2 ** 40, 2 ** 40, 10 ** 6)}[dt]
        shared = _gen(seed, i, slot, "shared")
        base = torch.randint(lo, hi, (n,), generator=shared, dtype=torch.int64)
        c = torch.randint(0, cmax + 1, (n,), generator=shared, dtype=torch.int64)
        return (base + c * (2 * pos - k + 1)).to(tdt)
    if op == "SUM" and dt == "int64":
        return torch.randint(-2 ** 60, 2 ** 60, (n,), generator=g, dtype=torch.int64)
    if op == "PREMUL_SUM" and dt == "int64":   # exact in double, so that a fractional factor rounds one way only
        return torch.randint(-2 ** 50, 2 ** 50, (n,), generator=g, dtype=torch.int64)
    # SUM (wraps in the narrow types, the same in any order), MIN / MAX / bitwise: the whole range of the type
    return torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), (n,), generator=g,
                         dtype=torch.int64).to(tdt)


def sentinel(dt):
    return {"bool": True, "int8": -101, "uint8": 201, "int32": -0x5A5A5A5, "int64": -0x5A5A5A5A5A}.get(dt, -96.0)


def numel(shape):
    return int(math.prod(shape))


def alloc(shape, layout, dt):
    """(tensor of `shape` in `layout`, the whole buffer it lives in), filled with the sentinel."""
    torch, _ = _t()
    tdt = _dtype(dt)
    shape = list(shape)
    fill = sentinel(dt)
    if layout == "offset":
        buf = torch.full((numel(shape) + 3,), fill, dtype=tdt)
        return buf[3:].view(shape), buf
    if layout == "strided":
        bs = shape[:-1] + [shape[-1] * 2]
        buf = torch.full(bs, fill, dtype=tdt)
        return buf[..., ::2], buf
    if layout == "transposed" and len(shape) >= 2:
        buf = torch.full(shape[::-1], fill, dtype=tdt)
        t = buf.permute(*reversed(range(len(shape))))
        return t, t
    if layout == "channels_last" and len(shape) == 4:
        t = torch.full(shape, fill, dtype=tdt).contiguous(memory_format=torch.channels_last)
        return t, t
    t = torch.full(shape, fill, dtype=tdt)
    return t, t


def make(vals, shape, layout, dt, grad=False):
    """(tensor holding vals in `shape` and `layout`, its whole buffer). grad: the tensor handed over requires grad:
    it is a leaf that requires grad, or (offset and strided layouts) a view of one, like param[::2]."""
    torch, _ = _t()
    t, buf = alloc(shape, layout, dt)
    t.copy_(vals.view(list(shape)))
    if grad and not torch.is_inference_mode_enabled():
        if t is buf:
            t.requires_grad_(True)
            buf = t
        else:
            buf.requires_grad_(True)
            t = buf.as_strided(t.shape, t.stride(), t.storage_offset())
    return t, buf


def items(label, t, buf):
    return [(label, t)] + ([(label + "~buffer", buf)] if buf is not t else [])


def reduce_ref(vals, op, dt, factor=None):
    """Reduces per-member tensors in a wide type, without any collective."""
    torch, _ = _t()
    tdt = _dtype(dt)
    k = len(vals)
    if dt == "bool":
        x = torch.stack(vals)
        if op in ("SUM", "MAX", "BOR"):
            return x.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return x.all(0)
        if op == "BXOR":
            return (x.to(torch.int64).sum(0) % 2).bool()
        raise ValueError(op)
    if dt == "complex64":
        x = torch.stack([v.to(torch.complex128) for v in vals])
    elif dt in FLOATS:
        x = torch.stack([v.double() for v in vals])
    else:
        x = torch.stack([v.to(torch.int64) for v in vals])
    if op == "SUM":
        r = x.sum(0)
    elif op == "PRODUCT":
        r = x.prod(0)
    elif op == "MIN":
        r = x.amin(0)
    elif op == "MAX":
        r = x.amax(0)
    elif op == "AVG":
        r = x.sum(0) / k if dt not in INTS else torch.div(x.sum(0), k, rounding_mode="trunc")
    elif op == "PREMUL_SUM" and dt in INTS:
        # t3d: scaled in the element type first (a whole factor exactly, wrapping; else via double, truncated toward
        # zero and saturated), then summed, wrapping.
        info = torch.iinfo(tdt)
        if factor == int(factor):
            y = x * int(factor)
        else:
            y = (x.double() * factor).trunc().clamp(info.min, info.max).to(torch.int64)
        r = y.to(tdt).to(torch.int64).sum(0)
    elif op == "PREMUL_SUM":
        r = (x * factor).sum(0)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        r = x[0]
        for j in range(1, k):
            r = fn(r, x[j])
    return r.to(tdt)


def make_op(s):
    _, dist = _t()
    if s["op"] == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(s["factor"])
    return getattr(dist.ReduceOp, s["op"])


class Raises:
    """A reference that says: this call must raise."""

    def __repr__(self):
        return "<must raise>"


class X:
    """One rank's view of the world for one seed: groups, members, data."""

    def __init__(self, rank, ws, seed, sub, groups):
        self.rank, self.ws, self.seed, self.sub = rank, ws, seed, sub
        self.g = groups

    def members(self, s):
        return list(self.sub) if s["group"] == "sub" else list(range(self.ws))

    def member(self, s):
        return self.rank in self.members(s)

    def gr(self, s):
        return self.members(s).index(self.rank)

    def root(self, s):
        return self.members(s)[s["root"]]

    def group(self, s, be):
        return self.g[(be, s["group"])]

    def pg(self, s, be):
        _, dist = _t()
        g = self.group(s, be)
        return dist.distributed_c10d._get_default_group() if g is None else g

    def v(self, s, slot, r, n, dt=None, movement=False):
        """Rank r's data for slot `slot` of call s (n elements)."""
        members = self.members(s)
        return values(self.seed, s["i"], slot, r, n, dt or s["dt"], None if movement else s.get("op"),
                      s.get("flavor", "plain"), len(members), members.index(r) if r in members else 0)

    def red(self, s, slot_fn, n, members=None):
        members = self.members(s) if members is None else members
        return reduce_ref([self.v(s, slot_fn(r), r, n) for r in members], s["op"], s["dt"], s.get("factor"))


# ---- one function pair per kind: run(x, s, be) -> (work or None, collect() -> items); ref(x, s) -> items -------

def run_all_reduce(x, s, be):
    _, dist = _t()
    t, buf = make(x.v(s, "in", x.rank, numel(s["shape"])), s["shape"], s["layout"], s["dt"], s.get("grad"))
    w = dist.all_reduce(t, op=make_op(s), group=x.group(s, be), async_op=s["async"])
    return w, lambda: items("out", t, buf)


def ref_all_reduce(x, s):
    e = x.red(s, lambda r: "in", numel(s["shape"]))
    t, buf = make(e, s["shape"], s["layout"], s["dt"])
    return items("out", t, buf)


def run_reduce(x, s, be):
    _, dist = _t()
    t, buf = make(x.v(s, "in", x.rank, numel(s["shape"])), s["shape"], s["layout"], s["dt"])
    w = dist.reduce(t, dst=x.root(s), op=make_op(s), group=x.group(s, be), async_op=s["async"])
    # Only the root's result is defined; the other ranks' tensors may be used as scratch space.
    return w, lambda: items("out", t, buf) if x.rank == x.root(s) else []


def ref_reduce(x, s):
    return ref_all_reduce(x, s) if x.rank == x.root(s) else []


def run_broadcast(x, s, be):
    _, dist = _t()
    t, buf = make(x.v(s, "in", x.rank, numel(s["shape"]), movement=True), s["shape"], s["layout"], s["dt"],
                  s.get("grad"))
    w = dist.broadcast(t, src=x.root(s), group=x.group(s, be), async_op=s["async"])
    return w, lambda: items("out", t, buf)


def ref_broadcast(x, s):
    t, buf = make(x.v(s, "in", x.root(s), numel(s["shape"]), movement=True), s["shape"], s["layout"], s["dt"])
    return items("out", t, buf)


def _coalesced_tensors(x, s, r, make_them=True):
    """Per distinct tensor of the coalesced call: (input values of member r, output size)."""
    k = len(x.members(s))
    out = []
    for j, n in enumerate(s["sizes"]):
        if s["variant"] == "mgr_reduce_scatter_tensor":
            out.append(x.v(s, ("c", j), r, n * k))
        elif s["variant"] == "mgr_all_gather_into_tensor":
            out.append(x.v(s, ("c", j), r, n, movement=True))
        else:
            out.append(x.v(s, ("c", j), r, n))
    return out


def run_coalesced(x, s, be):
    torch, dist = _t()
    from torch.distributed.distributed_c10d import _coalescing_manager
    g = x.group(s, be)
    k = len(x.members(s))
    vals = _coalesced_tensors(x, s, x.rank)
    v = s["variant"]
    res = []
    if v.endswith("all_reduce"):
        ts = [make(val, [val.numel()], lay, s["dt"]) for val, lay in zip(vals, s["layouts"])]
        lst = [t for t, _ in ts] + [ts[j][0] for j in s.get("alias", [])]
        if v == "func_all_reduce":
            w = dist.all_reduce_coalesced(lst, op=make_op(s), group=g, async_op=s["async"])
        else:
            with _coalescing_manager(group=g, async_ops=True) as cm:
                for t in lst:
                    dist.all_reduce(t, op=make_op(s), group=g)
            w = cm
        for j, (t, buf) in enumerate(ts):
            res += items(f"t{j}", t, buf)
        return w, lambda: res
    ins = [make(val, [val.numel()], lay, s["dt"]) for val, lay in zip(vals, s["layouts"])]
    if v == "mgr_all_gather_into_tensor":
        outs = [alloc([n * k], "contig", s["dt"]) for n in s["sizes"]]
    else:
        outs = [alloc([n], "contig", s["dt"]) for n in s["sizes"]]
    with _coalescing_manager(group=g, async_ops=True) as cm:
        for (o, _), (i, _) in zip(outs, ins):
            if v == "mgr_all_gather_into_tensor":
                dist.all_gather_into_tensor(o, i, group=g)
            else:
                dist.reduce_scatter_tensor(o, i, op=make_op(s), group=g)
    for j, (o, ob) in enumerate(outs):
        res += items(f"out{j}", o, ob)
    for j, (i, ib) in enumerate(ins):
        if v == "mgr_all_gather_into_tensor":
            res += items(f"in{j}", i, ib)
    return cm, lambda: res


def ref_coalesced(x, s):
    torch, _ = _t()
    members = x.members(s)
    k = len(members)
    per = {r: _coalesced_tensors(x, s, r) for r in members}
    v = s["variant"]
    res = []
    for j, n in enumerate(s["sizes"]):
        if v.endswith("all_reduce"):
            e = reduce_ref([per[r][j] for r in members], s["op"], s["dt"], s.get("factor"))
            res += items(f"t{j}", *make(e, [n], s["layouts"][j], s["dt"]))
        elif v == "mgr_all_gather_into_tensor":
            res += items(f"out{j}", *make(torch.cat([per[r][j] for r in members]), [n * k], "contig", s["dt"]))
        else:
            gr = x.gr(s)
            e = reduce_ref([per[r][j][gr * n:(gr + 1) * n] for r in members], s["op"], s["dt"], s.get("factor"))
            res += items(f"out{j}", *make(e, [n], "contig", s["dt"]))
    if v == "mgr_all_gather_into_tensor":
        for j, n in enumerate(s["sizes"]):
            res += items(f"in{j}", *make(per[x.rank][j], [n], s["layouts"][j], s["dt"]))
    return res


def run_all_gather(x, s, be):
    _, dist = _t()
    sizes = s["sizes"]
    outs = [alloc([n], s["out_layout"], s["dt"]) for n in sizes]
    inp, ib = make(x.v(s, "in", x.rank, sizes[x.gr(s)], movement=True), [sizes[x.gr(s)]], s["in_layout"], s["dt"],
                   s.get("grad"))
    w = dist.all_gather([o for o, _ in outs], inp, group=x.group(s, be), async_op=s["async"])

    def collect():
        res = []
        for j, (o, ob) in enumerate(outs):
            res += items(f"out{j}", o, ob)
        return res + items("in", inp, ib)
    return w, collect


def ref_all_gather(x, s):
    res = []
    for j, r in enumerate(x.members(s)):
        res += items(f"out{j}", *make(x.v(s, "in", r, s["sizes"][j], movement=True), [s["sizes"][j]],
                                      s["out_layout"], s["dt"]))
    n = s["sizes"][x.gr(s)]
    return res + items("in", *make(x.v(s, "in", x.rank, n, movement=True), [n], s["in_layout"], s["dt"]))


def _agit_out_shape(s, k):
    shape = s["shape"]
    if s["variant"] == "stacked":
        return [k] + shape
    return [k * shape[0]] + shape[1:]


def run_all_gather_into_tensor(x, s, be):
    _, dist = _t()
    k = len(x.members(s))
    n = numel(s["shape"])
    out, ob = alloc(_agit_out_shape(s, k), s["out_layout"], s["dt"])
    mine = x.v(s, "in", x.rank, n, movement=True)
    if s["variant"] == "inplace":
        gr = x.gr(s)
        inp = out.view(-1)[gr * n:(gr + 1) * n]
        inp.copy_(mine)
        ib = inp
    else:
        inp, ib = make(mine, s["shape"], s["in_layout"], s["dt"])
    w = dist.all_gather_into_tensor(out, inp, group=x.group(s, be), async_op=s["async"])
    return w, lambda: items("out", out, ob) + ([] if s["variant"] == "inplace" else items("in", inp, ib))


def ref_all_gather_into_tensor(x, s):
    torch, _ = _t()
    k = len(x.members(s))
    n = numel(s["shape"])
    e = torch.cat([x.v(s, "in", r, n, movement=True) for r in x.members(s)])
    res = items("out", *make(e, _agit_out_shape(s, k), s["out_layout"], s["dt"]))
    if s["variant"] != "inplace":
        res += items("in", *make(x.v(s, "in", x.rank, n, movement=True), s["shape"], s["in_layout"], s["dt"]))
    return res


def run_all_gather_coalesced(x, s, be):
    _, dist = _t()
    k = len(x.members(s))
    ins = [make(x.v(s, ("in", i), x.rank, n, dt=dt, movement=True), [n], "contig", dt)
           for i, (n, dt) in enumerate(zip(s["sizes"], s["dts"]))]
    outs = [[alloc([n], "contig", dt) for n, dt in zip(s["sizes"], s["dts"])] for _ in range(k)]
    w = dist.all_gather_coalesced([[o for o, _ in row] for row in outs], [t for t, _ in ins],
                                  group=x.group(s, be), async_op=s["async"])

    def collect():
        res = []
        for j, row in enumerate(outs):
            for i, (o, _) in enumerate(row):
                res.append((f"out[{j}][{i}]", o))
        return res + [(f"in{i}", t) for i, (t, _) in enumerate(ins)]
    return w, collect


def ref_all_gather_coalesced(x, s):
    res = []
    for j, r in enumerate(x.members(s)):
        for i, (n, dt) in enumerate(zip(s["sizes"], s["dts"])):
            res.append((f"out[{j}][{i}]", x.v(s, ("in", i), r, n, dt=dt, movement=True)))
    return res + [(f"in{i}", x.v(s, ("in", i), x.rank, n, dt=dt, movement=True))
                  for i, (n, dt) in enumerate(zip(s["sizes"], s["dts"]))]


def run_gather(x, s, be):
    _, dist = _t()
    k, n = len(x.members(s)), s["n"]
    is_root = x.rank == x.root(s)
    outs = [alloc([n], s["out_layout"], s["dt"]) for _ in range(k)] if is_root else None
    inp, ib = make(x.v(s, "in", x.rank, n, movement=True), [n], s["in_layout"], s["dt"])
    w = dist.gather(inp, [o for o, _ in outs] if is_root else None, dst=x.root(s), group=x.group(s, be),
                    async_op=s["async"])

    def collect():
        res = []
        for j, (o, ob) in enumerate(outs or []):
            res += items(f"out{j}", o, ob)
        return res + items("in", inp, ib)
    return w, collect


def ref_gather(x, s):
    n = s["n"]
    res = []
    if x.rank == x.root(s):
        for j, r in enumerate(x.members(s)):
            res += items(f"out{j}", *make(x.v(s, "in", r, n, movement=True), [n], s["out_layout"], s["dt"]))
    return res + items("in", *make(x.v(s, "in", x.rank, n, movement=True), [n], s["in_layout"], s["dt"]))


def run_scatter(x, s, be):
    _, dist = _t()
    k, n = len(x.members(s)), s["n"]
    is_root = x.rank == x.root(s)
    ins = [make(x.v(s, ("sc", j), x.rank, n, movement=True), [n], s["in_layout"], s["dt"]) for j in range(k)] \
        if is_root else None
    out, ob = alloc([n], s["out_layout"], s["dt"])
    w = dist.scatter(out, [t for t, _ in ins] if is_root else None, src=x.root(s), group=x.group(s, be),
                     async_op=s["async"])

    def collect():
        res = items("out", out, ob)
        for j, (t, b) in enumerate(ins or []):
            res += items(f"in{j}", t, b)
        return res
    return w, collect


def ref_scatter(x, s):
    n, k = s["n"], len(x.members(s))
    res = items("out", *make(x.v(s, ("sc", x.gr(s)), x.root(s), n, movement=True), [n], s["out_layout"], s["dt"]))
    if x.rank == x.root(s):
        for j in range(k):
            res += items(f"in{j}", *make(x.v(s, ("sc", j), x.rank, n, movement=True), [n], s["in_layout"], s["dt"]))
    return res


def run_reduce_scatter(x, s, be):
    _, dist = _t()
    k, n = len(x.members(s)), s["n"]
    ins = [make(x.v(s, ("rs", j), x.rank, n), [n], s["in_layout"], s["dt"]) for j in range(k)]
    out, ob = alloc([n], s["out_layout"], s["dt"])
    w = dist.reduce_scatter(out, [t for t, _ in ins], op=make_op(s), group=x.group(s, be), async_op=s["async"])
    return w, lambda: items("out", out, ob)


def ref_reduce_scatter(x, s):
    e = x.red(s, lambda r: ("rs", x.gr(s)), s["n"])
    return items("out", *make(e, [s["n"]], s["out_layout"], s["dt"]))


def _rst_in_shape(s, k):
    shape = s["shape"]
    return [k] + shape if s["variant"] == "stacked" else [k * shape[0]] + shape[1:]


def run_reduce_scatter_tensor(x, s, be):
    _, dist = _t()
    k, n = len(x.members(s)), numel(s["shape"])
    inp, ib = make(x.v(s, "in", x.rank, k * n), _rst_in_shape(s, k), s["in_layout"], s["dt"])
    out, ob = alloc(s["shape"], s["out_layout"], s["dt"])
    w = dist.reduce_scatter_tensor(out, inp, op=make_op(s), group=x.group(s, be), async_op=s["async"])
    return w, lambda: items("out", out, ob)


def ref_reduce_scatter_tensor(x, s):
    k, n = len(x.members(s)), numel(s["shape"])
    gr = x.gr(s)
    e = reduce_ref([x.v(s, "in", r, k * n)[gr * n:(gr + 1) * n] for r in x.members(s)], s["op"], s["dt"],
                   s.get("factor"))
    return items("out", *make(e, s["shape"], s["out_layout"], s["dt"]))


def _a2a_rows(s, k):
    if s["splits"] is None:
        return [[s["rows"]] * k for _ in range(k)]
    return s["splits"]


def _a2a_shape(rows, cols):
    return [rows] if cols == 0 else [rows, cols]


def run_all_to_all_single(x, s, be):
    _, dist = _t()
    k = len(x.members(s))
    S = _a2a_rows(s, k)
    gr = x.gr(s)
    cols = s["cols"]
    rin = sum(S[gr])
    rout = sum(S[j][gr] for j in range(k))
    inp, ib = make(x.v(s, "in", x.rank, rin * max(cols, 1), movement=True), _a2a_shape(rin, cols), s["in_layout"],
                   s["dt"])
    out, ob = alloc(_a2a_shape(rout, cols), s["out_layout"], s["dt"])
    if s["splits"] is None:
        w = dist.all_to_all_single(out, inp, group=x.group(s, be), async_op=s["async"])
    else:
        w = dist.all_to_all_single(out, inp, [S[j][gr] for j in range(k)], list(S[gr]), group=x.group(s, be),
                                   async_op=s["async"])
    return w, lambda: items("out", out, ob) + items("in", inp, ib)


def ref_all_to_all_single(x, s):
    torch, _ = _t()
    k = len(x.members(s))
    S = _a2a_rows(s, k)
    gr = x.gr(s)
    cols = max(s["cols"], 1)
    parts = []
    for j, r in enumerate(x.members(s)):
        full = x.v(s, "in", r, sum(S[j]) * cols, movement=True)
        off = sum(S[j][:gr]) * cols
        parts.append(full[off:off + S[j][gr] * cols])
    rout = sum(S[j][gr] for j in range(k))
    res = items("out", *make(torch.cat(parts), _a2a_shape(rout, s["cols"]), s["out_layout"], s["dt"]))
    rin = sum(S[gr])
    return res + items("in", *make(x.v(s, "in", x.rank, rin * cols, movement=True), _a2a_shape(rin, s["cols"]),
                                   s["in_layout"], s["dt"]))


def run_all_to_all(x, s, be):
    _, dist = _t()
    k = len(x.members(s))
    S = s["splits"]
    gr = x.gr(s)
    ins = [make(x.v(s, ("a2a", d), x.rank, S[gr][d], movement=True), [S[gr][d]], s["in_layout"], s["dt"])
           for d in range(k)]
    outs = [alloc([S[j][gr]], s["out_layout"], s["dt"]) for j in range(k)]
    w = dist.all_to_all([o for o, _ in outs], [t for t, _ in ins], group=x.group(s, be), async_op=s["async"])

    def collect():
        res = []
        for j, (o, ob) in enumerate(outs):
            res += items(f"out{j}", o, ob)
        for j, (t, b) in enumerate(ins):
            res += items(f"in{j}", t, b)
        return res
    return w, collect


def ref_all_to_all(x, s):
    S = s["splits"]
    gr = x.gr(s)
    res = []
    for j, r in enumerate(x.members(s)):
        res += items(f"out{j}", *make(x.v(s, ("a2a", gr), r, S[j][gr], movement=True), [S[j][gr]], s["out_layout"],
                                      s["dt"]))
    for d in range(len(x.members(s))):
        res += items(f"in{d}", *make(x.v(s, ("a2a", d), x.rank, S[gr][d], movement=True), [S[gr][d]],
                                     s["in_layout"], s["dt"]))
    return res


def run_barrier(x, s, be):
    _, dist = _t()
    w = dist.barrier(group=x.group(s, be), async_op=s["async"])
    return w, lambda: []


def ref_barrier(x, s):
    return []


def _p2p_ops(x, s):
    """This rank's part of the messages, in a per-rank random order that keeps the order of the messages of each
    (direction, peer, tag): those must match in posting order."""
    mine = []
    for m, msg in enumerate(s["msgs"]):
        if msg["src"] == x.rank:
            mine.append(("send", msg["dst"], msg["tag"], m))
        if msg["dst"] == x.rank:
            mine.append(("recv", msg["src"], msg["tag"], m))
    rnd = random.Random(f"p2p:{x.seed}:{s['i']}:{x.rank}")
    order = list(range(len(mine)))
    rnd.shuffle(order)
    shuffled = [mine[j] for j in order]
    buckets = {}
    for pos, op in enumerate(shuffled):
        buckets.setdefault(op[:3], []).append(pos)
    out = list(shuffled)
    for key, poss in buckets.items():
        ops = sorted((shuffled[p] for p in poss), key=lambda o: o[3])
        for p, op in zip(poss, ops):
            out[p] = op
    return out


def _p2p_msg(x, s, m):
    msg = s["msgs"][m]
    return x.v(dict(s, dt=msg["dt"], op=None), ("p2p", m), msg["src"], msg["n"], dt=msg["dt"], movement=True)


def run_p2p(x, s, be):
    _, dist = _t()
    g = x.group(s, be)
    v = s["variant"]
    res = {}
    if v in ("send_recv", "recv_any"):
        msg = s["msgs"][0]
        if x.rank == msg["src"]:
            t, b = make(_p2p_msg(x, s, 0), [msg["n"]], msg["layout"], msg["dt"])
            dist.send(t, msg["dst"], group=g, tag=msg["tag"])
            res[0] = items("sent0", t, b)
        elif x.rank == msg["dst"]:
            t, b = alloc([msg["n"]], msg["layout"], msg["dt"])
            frm = dist.recv(t, None if v == "recv_any" else msg["src"], group=g, tag=msg["tag"])
            res[0] = items("recv0", t, b) + [("sender", frm)]
        return None, lambda: [it for m in sorted(res) for it in res[m]]
    ops = _p2p_ops(x, s)
    p2p = []
    for kind, peer, tag, m in ops:
        msg = s["msgs"][m]
        if kind == "send":
            t, b = make(_p2p_msg(x, s, m), [msg["n"]], msg["layout"], msg["dt"])
            res[(m, 0)] = items(f"sent{m}", t, b)
        else:
            t, b = alloc([msg["n"]], msg["layout"], msg["dt"])
            res[(m, 1)] = items(f"recv{m}", t, b)
        p2p.append((kind, t, peer, tag))
    works = []
    if v == "isend_irecv":
        for kind, t, peer, tag in p2p:
            works.append((dist.isend if kind == "send" else dist.irecv)(t, peer, group=g, tag=tag))
    elif p2p:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, g, tag)
                                        for kind, t, peer, tag in p2p])
    rnd = random.Random(f"p2pwait:{x.seed}:{s['i']}:{x.rank}")
    rnd.shuffle(works)
    for w in works:
        w.wait()
    return None, lambda: [it for key in sorted(res) for it in res[key]]


def ref_p2p(x, s):
    res = {}
    for m, msg in enumerate(s["msgs"]):
        if msg["src"] == x.rank:
            res[(m, 0)] = items(f"sent{m}", *make(_p2p_msg(x, s, m), [msg["n"]], msg["layout"], msg["dt"]))
        if msg["dst"] == x.rank:
            res[(m, 1)] = items(f"recv{m}", *make(_p2p_msg(x, s, m), [msg["n"]], msg["layout"], msg["dt"]))
    if s["variant"] in ("send_recv", "recv_any"):
        msg = s["msgs"][0]
        out = []
        if x.rank == msg["src"]:
            out = items("sent0", *make(_p2p_msg(x, s, 0), [msg["n"]], msg["layout"], msg["dt"]))
        elif x.rank == msg["dst"]:
            out = items("recv0", *make(_p2p_msg(x, s, 0), [msg["n"]], msg["layout"], msg["dt"])) + \
                [("sender", msg["src"])]
        return out
    return [it for key in sorted(res) for it in res[key]]


def make_obj(seed, i, slot, r, big):
    rnd = random.Random(f"obj:{seed}:{i}:{slot}:{r}")
    shape = rnd.randrange(5)
    if shape == 0:
        return None
    if shape == 1:
        return rnd.randint(-10 ** 18, 10 ** 18)
    n = rnd.choice([0, 1, 7, 100, 3000] + ([40000] if big else []))
    return {"rank": r, "slot": repr(slot), "bytes": rnd.randbytes(n), "s": "x" * rnd.randrange(50) + "\u00e9",
            "l": [rnd.randint(-10 ** 12, 10 ** 12) for _ in range(rnd.randint(0, 20))], "f": rnd.random(),
            "t": (1, "two", (3.5, None)), "set": frozenset(range(rnd.randrange(5)))}


def run_objects(x, s, be):
    _, dist = _t()
    g = x.group(s, be)
    k = len(x.members(s))
    v = s["variant"]
    big = s["big"]
    if v == "all_gather_object":
        out = [None] * k
        dist.all_gather_object(out, make_obj(x.seed, s["i"], "ag", x.rank, big), group=g)
        return None, lambda: [("objs", out)]
    if v == "broadcast_object_list":
        lst = [make_obj(x.seed, s["i"], ("b", j), x.rank, big) for j in range(s["m"])] \
            if x.rank == x.root(s) else [None] * s["m"]
        dist.broadcast_object_list(lst, src=x.root(s), group=g)
        return None, lambda: [("objs", lst)]
    if v == "gather_object":
        out = [None] * k if x.rank == x.root(s) else None
        dist.gather_object(make_obj(x.seed, s["i"], "g", x.rank, big), out, dst=x.root(s), group=g)
        return None, lambda: [("objs", out)]
    out = [None]
    inp = [make_obj(x.seed, s["i"], ("s", j), x.rank, big) for j in range(k)] if x.rank == x.root(s) else None
    dist.scatter_object_list(out, inp, src=x.root(s), group=g)
    return None, lambda: [("objs", out)]


def ref_objects(x, s):
    v = s["variant"]
    big = s["big"]
    if v == "all_gather_object":
        return [("objs", [make_obj(x.seed, s["i"], "ag", r, big) for r in x.members(s)])]
    if v == "broadcast_object_list":
        return [("objs", [make_obj(x.seed, s["i"], ("b", j), x.root(s), big) for j in range(s["m"])])]
    if v == "gather_object":
        return [("objs", [make_obj(x.seed, s["i"], "g", r, big) for r in x.members(s)]
                 if x.rank == x.root(s) else None)]
    return [("objs", [make_obj(x.seed, s["i"], ("s", x.gr(s)), x.root(s), big)])]


def run_pg_multi(x, s, be):
    _, dist = _t()
    pg = x.pg(s, be)
    k, m, n = len(x.members(s)), s["m"], s["n"]
    mv = s["variant"] != "allreduce"
    ts = [make(x.v(s, ("t", j), x.rank, n, movement=mv), [n], "contig", s["dt"])[0] for j in range(m)]
    if s["variant"] == "allreduce":
        o = dist.AllreduceOptions()
        o.reduceOp = make_op(s)
        w = pg.allreduce(ts, o)
        return w, lambda: [(f"t{j}", t) for j, t in enumerate(ts)]
    if s["variant"] == "broadcast":
        o = dist.BroadcastOptions()
        o.rootRank = s["root"]
        o.rootTensor = s["root_tensor"]
        w = pg.broadcast(ts, o)
        return w, lambda: [(f"t{j}", t) for j, t in enumerate(ts)]
    outs = [[alloc([n], "contig", s["dt"])[0] for _ in range(k * m)] for _ in range(m)]
    w = pg.allgather(outs, ts)
    return w, lambda: [(f"out[{i}][{j}]", o) for i, row in enumerate(outs) for j, o in enumerate(row)] + \
        [(f"t{j}", t) for j, t in enumerate(ts)]


def ref_pg_multi(x, s):
    k, m, n = len(x.members(s)), s["m"], s["n"]
    if s["variant"] == "allreduce":
        e = reduce_ref([x.v(s, ("t", j), r, n) for r in x.members(s) for j in range(m)], s["op"], s["dt"])
        return [(f"t{j}", e) for j in range(m)]
    if s["variant"] == "broadcast":
        e = x.v(s, ("t", s["root_tensor"]), x.root(s), n, movement=True)
        return [(f"t{j}", e) for j in range(m)]
    flat = [x.v(s, ("t", j), r, n, movement=True) for r in x.members(s) for j in range(m)]
    return [(f"out[{i}][{j}]", flat[j]) for i in range(m) for j in range(k * m)] + \
        [(f"t{j}", x.v(s, ("t", j), x.rank, n, movement=True)) for j in range(m)]


def _sparse_input(x, s, r):
    torch, _ = _t()
    g = _gen(x.seed, s["i"], "sparse", r)
    shape, sd = s["shape"], s["sparse_dim"]
    nnz = int(torch.randint(0, s["nnz_max"] + 1, (1,), generator=g)) if s["nnz_max"] else 0
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sd)]) if sd else None
    vals = values(x.seed, s["i"], "sv", r, nnz * numel(shape[sd:]), s["dt"], "SUM", "exact").view([nnz] + shape[sd:])
    t = torch.sparse_coo_tensor(idx, vals, shape)
    return t.coalesce() if s["coalesce"] else t


def run_sparse(x, s, be):
    _, dist = _t()
    t = _sparse_input(x, s, x.rank)
    w = dist.all_reduce(t, group=x.group(s, be), async_op=s["async"])
    return w, lambda: [("dense", t.to_dense()), ("is_sparse", t.is_sparse)]


def ref_sparse(x, s):
    e = reduce_ref([_sparse_input(x, s, r).to_dense() for r in x.members(s)], "SUM", s["dt"])
    return [("dense", e), ("is_sparse", True)]


def run_invalid(x, s, be):
    torch, dist = _t()
    g = x.group(s, be)
    k, n = len(x.members(s)), s["n"]
    outside = [r for r in range(x.ws) if r not in x.members(s)]
    bad_root = outside[0] if outside else x.ws
    c = s["case"]
    if c == "bad_root_broadcast":
        w = dist.broadcast(torch.ones(n), src=bad_root, group=g)
    elif c == "bad_root_reduce":
        w = dist.reduce(torch.ones(n), dst=bad_root, group=g)
    elif c == "bad_root_gather":
        w = dist.gather(torch.ones(n), None, dst=bad_root, group=g)
    elif c == "bad_root_scatter":
        w = dist.scatter(torch.ones(n), None, src=bad_root, group=g)
    elif c == "bad_root_tensor":
        o = dist.BroadcastOptions()
        o.rootRank = 0
        o.rootTensor = 2
        w = x.pg(s, be).broadcast([torch.ones(n), torch.ones(n)], o)
        w.wait()
    elif c == "ag_tensor_out_size":
        w = dist.all_gather_into_tensor(torch.empty(k * n + 1), torch.ones(n), group=g)
    elif c == "ag_tensor_dtype":
        w = dist.all_gather_into_tensor(torch.empty(k * n, dtype=torch.float64), torch.ones(n), group=g)
    elif c == "ag_list_len":
        w = dist.all_gather([torch.empty(n) for _ in range(k + 1)], torch.ones(n), group=g)
    elif c == "a2a_single_splits":
        w = dist.all_to_all_single(torch.empty(k), torch.ones(k + 1), [1] * k, [1] * k, group=g)
    elif c == "band_float":
        w = dist.all_reduce(torch.ones(n), op=dist.ReduceOp.BAND, group=g)
    elif c == "complex_max":
        w = dist.all_reduce(torch.ones(n, dtype=torch.complex64), op=dist.ReduceOp.MAX, group=g)
    elif c == "rs_tensor_in_size":
        w = dist.reduce_scatter_tensor(torch.empty(n), torch.ones(k * n + 2), group=g)
    elif c == "ag_list_dtype":
        w = dist.all_gather([torch.empty(n, dtype=torch.float64) for _ in range(k)], torch.ones(n), group=g)
    elif c == "rs_list_len":
        w = dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(k + 1)], group=g)
    elif c == "coalesced_mixed_dtype":
        w = dist.all_reduce_coalesced([torch.ones(n), torch.ones(n, dtype=torch.float64)], group=g)
    elif c == "sparse_max":
        sp = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), (n,))
        w = dist.all_reduce(sp, op=dist.ReduceOp.MAX, group=g)
    elif c == "send_bad_peer":
        w = dist.send(torch.ones(n), x.ws, group=g)
    else:
        raise AssertionError(c)
    return w, lambda: [("returned", "no error")]


def ref_invalid(x, s):
    return Raises()


RUN = {k: globals()["run_" + k] for k in GEN}
REF = {k: globals()["ref_" + k] for k in GEN}


# ----------------------------------------------------------------------------------------------------------------
# Running, capturing and comparing
# ----------------------------------------------------------------------------------------------------------------

def family(e):
    for c in (ValueError, TypeError, LookupError, AssertionError, RuntimeError):
        if isinstance(e, c):
            return c.__name__
    return type(e).__name__


class Outcome:
    def __init__(self, items=None, exc=None):
        self.items, self.exc = items, exc   # exc: (family, class name, message)

    @property
    def raised(self):
        return self.exc is not None


def _capture(fn):
    try:
        return Outcome(items=fn())
    except Exception as e:  # noqa: BLE001 - every exception is a result here
        lines = str(e).strip().splitlines()
        return Outcome(exc=(family(e), type(e).__name__, lines[0][:300] if lines else ""))


@contextlib.contextmanager
def _mode(mode):
    torch, _ = _t()
    if mode == "no_grad":
        with torch.no_grad():
            yield
    elif mode in ("inference", "inference_issue"):
        with torch.inference_mode():
            yield
    else:
        yield


def _wait(w, how):
    if w is None:
        return
    if hasattr(w, "works"):   # a _CoalescingManager
        w.wait()
        return
    if how == "poll" and hasattr(w, "is_completed"):
        # Spin on is_completed() without wait(): the work must finish on its own (gloo's do, in its threads).
        deadline = time.monotonic() + POLL_LIMIT_S
        while not w.is_completed():
            if time.monotonic() > deadline:
                w.wait()   # keep the ranks in step, then say what happened
                raise RuntimeError(f"work.is_completed() stayed False for {POLL_LIMIT_S:.0f}s without wait()")
            time.sleep(0.0002)
        w.wait()
        return
    if how == "future" and hasattr(w, "get_future"):
        try:
            fut = w.get_future()
        except Exception:   # a Work without a future: wait() is the only way
            w.wait()
            return
        fut.wait()
        return
    w.wait()


def _gloo_settle(outcomes):
    """After a gloo call failed: a gloo barrier waits for, and rethrows the error of, any earlier work that gloo's
    worker thread still holds, which it briefly does after wait() has already returned the error. A barrier issued
    in that window fails on that rank only (and the group loses step). A short pause lets the worker let go."""
    if any(o is not None and o.raised for o in outcomes):
        time.sleep(0.05)


def issue(x, s, be):
    """Starts one call; returns (work, collect) where the caller waits on work and then calls collect()."""
    return RUN[s["kind"]](x, s, be)


def call(x, s, be, mode):
    def go():
        with _mode(mode):
            w, collect = issue(x, s, be)
            if mode != "inference_issue":
                _wait(w, s.get("wait"))
        if mode == "inference_issue":
            _wait(w, s.get("wait"))
        return collect()
    return _capture(go)


def _bits(t):
    torch, _ = _t()
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


EPS = {"float32": 1.2e-7, "float64": 2.3e-16, "float16": 9.8e-4, "bfloat16": 7.9e-3, "complex64": 1.2e-7}


def _tol(s, dt, k):
    """(rtol, atol) for a reduction result, or None for exact comparison."""
    if dt not in EPS:
        return None
    op, flavor = s.get("op"), s.get("flavor")
    if flavor != "noisy" and op != "AVG":
        return None
    eps = EPS[dt]
    scale = 4.0 * k * abs(s.get("factor") or 1.0)
    base_r = {"float32": 1e-5, "float64": 1e-12, "complex64": 1e-5}.get(dt, 2e-2)
    base_a = {"float32": 1e-6, "float64": 1e-12, "complex64": 1e-6}.get(dt, 2e-2)
    return max(base_r, 4 * eps), max(base_a, 2 * k * eps * scale)


def _fmt_tensor(t, limit=12):
    torch, _ = _t()
    flat = t.detach().reshape(-1)
    vals = flat[:limit].tolist()
    more = f", ... ({flat.numel()} elements)" if flat.numel() > limit else ""
    return f"tensor(dtype={str(t.dtype).replace('torch.', '')}, shape={list(t.shape)}, " \
           f"stride={list(t.stride())}, values={vals}{more})"


def fmt_outcome(o):
    if o is None:
        return "<not run>"
    if isinstance(o, Raises):
        return "<must raise>"
    if o.raised:
        return f"raised {o.exc[1]} ({o.exc[0]} family): {o.exc[2]}"
    parts = []
    for label, v in o.items:
        parts.append(f"{label}={_fmt_tensor(v) if _is_tensor(v) else _short_obj(v)}")
    return "returned " + ("; ".join(parts) if parts else "(nothing to compare)")


def _short_obj(v):
    r = repr(v)
    return r if len(r) < 300 else r[:300] + "...(%d chars)" % len(r)


def _is_tensor(v):
    torch, _ = _t()
    return isinstance(v, torch.Tensor)


def compare_items(a, b, s, k):
    """None when equal, else a description of the first difference (a: t3d, b: the other side)."""
    torch, _ = _t()
    la = [l for l, _ in a]
    lb = [l for l, _ in b]
    if la != lb:
        return f"different result items: {la} vs {lb}"
    for (label, va), (_, vb) in zip(a, b):
        if _is_tensor(va) != _is_tensor(vb):
            return f"{label}: {type(va).__name__} vs {type(vb).__name__}"
        if not _is_tensor(va):
            if va != vb:
                return f"{label}: {_short_obj(va)} != {_short_obj(vb)}"
            continue
        va, vb = va.detach(), vb.detach()
        if va.dtype != vb.dtype:
            return f"{label}: dtype {va.dtype} vs {vb.dtype}"
        if list(va.shape) != list(vb.shape):
            return f"{label}: shape {list(va.shape)} vs {list(vb.shape)}"
        dt = str(va.dtype).replace("torch.", "")
        reduction = s.get("op") is not None and not label.startswith(("in", "sent"))
        if not reduction:
            ba, bb = _bits(va), _bits(vb)
            if torch.equal(ba, bb):
                continue
            bad = (ba != bb).any(-1) if va.is_complex() else (ba != bb)
        else:
            tol = _tol(s, dt, k)
            if tol is None:
                if torch.equal(va, vb):
                    continue
                bad = va != vb
            else:
                ok = torch.isclose(va, vb, rtol=tol[0], atol=tol[1], equal_nan=True)
                if bool(ok.all()):
                    continue
                bad = ~ok
        idx = bad.reshape(-1).nonzero().flatten()
        i = int(idx[0]) if idx.numel() else 0
        fa, fb = va.detach().reshape(-1), vb.detach().reshape(-1)
        return (f"{label}: {idx.numel()} of {va.numel()} elements differ; first at flat index {i}: "
                f"{fa[i].item()!r} vs {fb[i].item()!r}")
    return None


def compare(ta, tb, s, k, against):
    """Compares two outcomes (ta from t3d). Returns None or a description."""
    if isinstance(tb, Raises):
        return None if ta.raised else f"t3d returned where {against} says the call must raise"
    if ta.raised != tb.raised:
        who = "t3d" if ta.raised else against
        return f"only {who} raised"
    if ta.raised:
        return None if ta.exc[0] == tb.exc[0] else f"exception families differ: {ta.exc[0]} vs {tb.exc[0]}"
    return compare_items(ta.items, tb.items, s, k)


class Rank:
    """Executes specs on one rank and records what differs."""

    def __init__(self, x, inject=None):
        self.x = x
        self.mismatches = []
        self.stats = {}
        self.inject = inject
        self.raised_last = False

    def count(self, key):
        self.stats[key] = self.stats.get(key, 0) + 1

    def record(self, s, what, t3d, other, against):
        if not self.mismatches:
            # Said at once: if the world hangs later (a desynchronised group), this is what the log shows.
            print(f"[difftest rank {self.x.rank}] MISMATCH seed {self.x.seed} world {self.x.ws} call {s['i']}: {what}\n"
                  f"    spec: {short(s)}\n    t3d: {fmt_outcome(t3d)[:600]}\n    {against}: "
                  f"{fmt_outcome(other)[:600]}", file=sys.stderr, flush=True)
        self.mismatches.append({"call": s["i"] if not isinstance(s["i"], str) else int(str(s["i"]).split(".")[0]),
                                "sub_call": s["i"], "rank": self.x.rank, "what": what, "against": against,
                                "spec": short(s), "t3d": fmt_outcome(t3d), "other": fmt_outcome(other)})

    def _maybe_inject(self, s, o):
        """Self-test of the harness (--inject): alters t3d's result of a call after the fact, on rank 0."""
        if self.inject is None or self.inject == "done" or self.x.rank != 0 or o.raised:
            return
        if self.inject == "first" or self.inject == s["i"]:
            torch, _ = _t()
            for label, v in o.items:
                if _is_tensor(v) and v.numel() and v.dtype.is_floating_point and not v.is_sparse:
                    idx = tuple(0 for _ in v.shape)
                    with torch.inference_mode(v.is_inference()), torch.no_grad():
                        v[idx] += 1
                    self.inject = "done"
                    self.injected_at = s["i"]
                    return

    def check(self, s, t3d, gloo_fn):
        """Compares t3d's outcome of spec s with gloo's (gloo_fn runs it) and the reference."""
        try:
            self._check(s, t3d, gloo_fn)
        except Exception:   # a harness error: reported like a mismatch, so that the ranks stay in step
            self.record(s, "harness error while checking:\n" + traceback.format_exc(), t3d, None, "harness")

    def _check(self, s, t3d, gloo_fn):
        x = self.x
        k = len(x.members(s))
        kd = known_difference(s)
        self._maybe_inject(s, t3d)
        if kd is not None and kd.check == "gloo_with":   # gloo_fn already runs the changed spec: compare as usual
            self.count("known:" + kd.name)
            kd = None
        # gloo first, and on every rank alike: what follows may return early on one rank only.
        wants_gloo = kd is None or kd.check in ("both_raise", "gloo_or_reference") or kd.gloo == "raises"
        gloo = gloo_fn() if (wants_gloo and gloo_fn is not None) else None
        _gloo_settle([gloo])
        ref = _capture(lambda: REF[s["kind"]](x, s))
        if not ref.raised and isinstance(ref.items, Raises):
            ref = ref.items
        elif ref.raised:
            self.record(s, "the reference itself raised (harness bug)", t3d, ref, "reference")
            return
        self.count(s["kind"])
        if kd is None:
            if gloo is None:   # a batch sub-call that gloo did not run: the reference decides
                d = compare(t3d, ref, s, k, "reference")
                if d:
                    self.record(s, d, t3d, ref, "reference")
                return
            d = compare(t3d, gloo, s, k, "gloo")
            if d:
                self.record(s, d, t3d, gloo, "gloo")
                return
            if not gloo.raised:
                d = compare(gloo, ref, s, k, "reference")
                if d:   # gloo and t3d agree on something the reference does not: the harness is wrong
                    self.record(s, "gloo and t3d agree but differ from the reference (harness bug?): " + d,
                                gloo, ref, "reference")
            return
        self.count("known:" + kd.name)
        if kd.check == "both_raise":
            if gloo is not None and not (t3d.raised and gloo.raised):
                self.record(s, f"known difference {kd.name}: both should raise", t3d, gloo, "gloo")
            return
        if kd.check == "gloo_or_reference" and gloo is not None and not gloo.raised:
            d = compare(t3d, gloo, s, k, "gloo")
            if d:
                self.record(s, d, t3d, gloo, "gloo")
            return
        if kd.check == "gloo_or_reference" and gloo is not None:
            self.count("known-gloo-raised:" + kd.name)
        d = compare(t3d, ref, s, k, "reference")
        if d:
            self.record(s, f"[{kd.name}] " + d, t3d, ref, "reference")
            return
        if kd.check == "reference" and kd.gloo == "raises" and gloo is not None and not gloo.raised:
            self.record(s, f"stale KNOWN_DIFFERENCES entry {kd.name}: gloo no longer raises", t3d, gloo, "gloo")

    def run_spec(self, s):
        x = self.x
        self.raised_last = False
        if s["kind"] == "async_batch":
            return self.run_batch(s)
        if s.get("skip"):
            self.count("skipped:" + s["skip"])
            return
        if s["kind"] != "p2p" and not x.member(s):
            return
        kd = known_difference(s)
        t3d = call(x, s, "t3d", s["mode"])
        gs = gloo_spec(s)
        gloo_fn = (lambda: call(x, gs, "gloo", s["mode"])) if not (kd and kd.gloo == "skip") else None
        self.raised_last = t3d.raised
        self.check(s, t3d, gloo_fn)

    def run_batch(self, s):
        """Several calls in flight (on possibly different groups), waited in a per-rank random order."""
        x = self.x
        calls = [c for c in s["calls"] if not c.get("skip") and x.member(c)]
        for c in s["calls"]:
            if c.get("skip"):
                self.count("skipped:" + c["skip"])
        rnd = random.Random(f"wait:{x.seed}:{s['i']}:{x.rank}")
        order = list(range(len(calls)))
        rnd.shuffle(order)

        def run_all(be):
            started = []
            specs = [gloo_spec(c) for c in calls] if be == "gloo" else calls
            with _mode(s["mode"]):
                for c in specs:
                    kd = known_difference(c)
                    if be == "gloo" and kd is not None and kd.check != "gloo_with":
                        # Not issued on gloo inside a batch: a failed gloo work fails a later gloo barrier too (the
                        # barrier waits for all earlier work). Such calls are checked against the reference.
                        started.append(None)
                        continue
                    try:
                        started.append(issue(x, c, be))
                    except Exception as e:  # noqa: BLE001
                        started.append(e)
            outs = [None] * len(calls)

            def finish(j):
                st = started[j]
                if st is None:
                    return None
                if isinstance(st, Exception):
                    raise st
                w, collect = st
                _wait(w, specs[j].get("wait"))
                return collect()
            with _mode(s["mode"] if s["mode"] != "inference_issue" else "plain"):
                for j in order:
                    if started[j] is not None:
                        outs[j] = _capture(lambda: finish(j))
            return outs
        t3d = run_all("t3d")
        gloo = run_all("gloo")
        _gloo_settle(gloo)
        self.raised_last = any(o.raised for o in t3d)
        for c, a, b in zip(calls, t3d, gloo):
            self.check(c, a, (lambda b=b: b) if b is not None else None)


# ----------------------------------------------------------------------------------------------------------------
# The rank entry point
# ----------------------------------------------------------------------------------------------------------------

def _progress(rank, label):
    # The launcher shows the last "start" of each rank when a world hangs: that names the call.
    _dist._put(("start", rank, label))


def _make_groups(ws, sub):
    import datetime
    _, dist = _t()
    t3d_all = dist.new_group(list(range(ws)), backend="t3d")
    t3d_sub = dist.new_group(sub, backend="t3d")
    gloo_sub = dist.new_group(sub, backend="gloo", timeout=datetime.timedelta(seconds=60))
    return t3d_all, t3d_sub, gloo_sub


def run_seed(rank, ws, seed, ncalls, gloo_world, ctl, only=None, inject=None, verbose=False, keep_going=False):
    """Runs one seed's sequence on this rank; returns a summary dict."""
    torch, dist = _t()
    sub, specs = generate(seed, ws, ncalls)
    t0 = time.monotonic()
    t3d_all, t3d_sub, gloo_sub = _make_groups(ws, sub)
    if verbose and rank == 0:
        print(f"[difftest] groups made in {time.monotonic() - t0:.3f}s", flush=True)
    groups = {("t3d", "world"): None, ("t3d", "all"): t3d_all, ("t3d", "sub"): t3d_sub,
              ("gloo", "world"): gloo_world, ("gloo", "all"): gloo_world, ("gloo", "sub"): gloo_sub}
    x = X(rank, ws, seed, sub, groups)
    rk = Rank(x, inject=inject)
    done = 0
    for s in specs:
        if only is not None and s["i"] != only:
            continue
        earlier = f" [after a mismatch at call {rk.mismatches[0]['sub_call']}: {rk.mismatches[0]['what'][:200]}]" \
            if rk.mismatches else ""
        _progress(rank, f"seed {seed} (world {ws}) call {short(s)}{earlier}")
        if verbose and rank == 0:
            print(f"[difftest {time.monotonic() - t0:7.3f}s] {short(s)}", flush=True)
        n_before = len(rk.mismatches)
        rk.run_spec(s)
        done += 1
        if s["sync"] or s is specs[-1] or only is not None:
            first = min((m["call"] for m in rk.mismatches), default=-1)
            flags = torch.tensor([first if first >= 0 else 1 << 40, int(rk.raised_last)], dtype=torch.int64)
            allf = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)]
            dist.all_gather(allf, flags, group=ctl)
            if min(int(f[0]) for f in allf) < (1 << 40) and not keep_going:
                break
            if any(int(f[1]) for f in allf):
                # t3d raised (identically everywhere, else some rank would have a mismatch): the t3d group the call
                # used must still work (members only). Not done on gloo: see _gloo_settle.
                for c in (s["calls"] if s["kind"] == "async_batch" else [s]):
                    if x.member(c) or c["kind"] == "p2p":
                        try:
                            dist.barrier(group=x.group(c, "t3d"))
                        except Exception as e:
                            raise RuntimeError(f"seed {seed} world {ws}: the t3d group {c['group']!r} no longer works "
                                               f"after call {short(c)} raised: {e}") from e
        elif len(rk.mismatches) > n_before and verbose:
            print(f"[difftest] rank {rank}: mismatch at {s['i']}", flush=True)
    for g in (t3d_all, t3d_sub, gloo_sub):
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return {"seed": seed, "ws": ws, "rank": rank, "sub": sub, "calls": done,
            "mismatches": rk.mismatches[:200 if keep_going else 20],
            "stats": rk.stats, "seconds": time.monotonic() - t0, "injected_at": getattr(rk, "injected_at", None)}


def rank_main(rank, ws, cfg):
    """Entry point in every rank: runs cfg['seeds'] one after the other, or seeds from cfg['seed'] on until
    cfg['until'] (time.time()) in long mode. Returns a list of per-seed summaries."""
    warnings.filterwarnings("ignore")
    torch, dist = _t()
    import datetime
    gloo_world = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    ctl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
    out = []
    seeds = cfg.get("seeds")
    seed = cfg.get("seed", 0)
    while True:
        if seeds is not None:
            if not seeds:
                break
            cur = seeds.pop(0)
        else:
            # Long mode: every rank must agree whether to start another seed.
            go = torch.tensor([int(time.time() < cfg["until"])], dtype=torch.int64)
            dist.all_reduce(go, op=dist.ReduceOp.MIN, group=ctl)
            if not int(go):
                break
            cur = seed
            seed += 1
        res = run_seed(rank, ws, cur, cfg["calls"], gloo_world, ctl, only=cfg.get("only"),
                       inject=cfg.get("inject"), verbose=cfg.get("verbose", False),
                       keep_going=cfg.get("keep_going", False))
        out.append(res)
        # Every rank stops after the same seed (the sync that found a mismatch was collective).
        bad = torch.tensor([len(res["mismatches"])], dtype=torch.int64)
        dist.all_reduce(bad, group=ctl)
        if int(bad) and not cfg.get("keep_going"):
            break
    return out


# ----------------------------------------------------------------------------------------------------------------
# The parent: launching worlds, merging the ranks' reports
# ----------------------------------------------------------------------------------------------------------------

def merge(per_rank):
    """Per-seed reports merged over ranks: {seed: {"calls", "mismatches" (sorted), "stats"}}."""
    seeds = {}
    for rank_list in per_rank:
        for r in rank_list:
            e = seeds.setdefault(r["seed"], {"seed": r["seed"], "ws": r["ws"], "calls": 0, "mismatches": [],
                                             "stats": {}, "seconds": 0.0, "sub": r["sub"], "injected_at": None})
            e["calls"] = max(e["calls"], r["calls"])
            e["seconds"] = max(e["seconds"], r["seconds"])
            e["mismatches"] += r["mismatches"]
            if r["injected_at"] is not None:
                e["injected_at"] = r["injected_at"]
            if r["rank"] == 0:
                e["stats"] = r["stats"]
    for e in seeds.values():
        e["mismatches"].sort(key=lambda m: (m["call"], str(m["sub_call"]), m["rank"]))
    return seeds


def reproducer(seed, ws, call):
    return (f"python tests/python/difftest.py --seed {seed} --world {ws} --calls {call + 1}   "
            f"# or --only {call} for that call alone")


def format_mismatches(e, limit=6):
    lines = []
    ms = e["mismatches"]
    if not ms:
        return ""
    first = ms[0]
    lines.append(f"difftest MISMATCH: seed {e['seed']}, world {e['ws']}, call {first['call']} "
                 f"(subgroup ranks {e['sub']})")
    lines.append("reproduce: " + reproducer(e["seed"], e["ws"], first["call"]))
    for m in ms[:limit]:
        lines.append(f"- call {m['sub_call']} rank {m['rank']}: {m['what']}")
        lines.append(f"    spec:  {m['spec']}")
        lines.append(f"    t3d:   {m['t3d']}")
        lines.append(f"    {m['against']}: {m['other']}")
    if len(ms) > limit:
        lines.append(f"({len(ms) - limit} more mismatch records)")
    return "\n".join(lines)


def run_world_seeds(ws, seeds, calls=DEFAULT_CALLS, timeout=150.0, idle=45.0, only=None, inject=None,
                    verbose=False):
    """Runs the seeds in one world; returns the merged per-seed reports. Raises _dist.WorldFailure on a hang or
    crash (the message names the call each rank was in)."""
    cfg = {"seeds": list(seeds), "calls": calls, "only": only, "inject": inject, "verbose": verbose}
    res = _dist.run_world(rank_main, ws, cfg, timeout=timeout, idle=idle, backend="t3d")
    return merge(res)


def _main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--world", type=int, default=None, help="ranks (default 2; --long: cycles 2, 3, 4)")
    ap.add_argument("--calls", type=int, default=DEFAULT_CALLS, help="calls per seed")
    ap.add_argument("--only", type=int, default=None, help="run only this call index of the sequence")
    ap.add_argument("--long", action="store_true", help="soak: new seeds until --hours pass or a mismatch")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--world-seconds", type=float, default=300.0, help="--long: seconds per world")
    ap.add_argument("--timeout", type=float, default=300.0, help="hard limit per world (seconds)")
    ap.add_argument("--verbose", action="store_true", help="print every call (rank 0)")
    ap.add_argument("--list", action="store_true", help="print the generated specs and exit")
    ap.add_argument("--keep-going", action="store_true", help="do not stop at the first mismatch (triage)")
    ap.add_argument("--inject", default=None, help="self-test: corrupt t3d's result of this call index on rank 0")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.list:
        sub, specs = generate(a.seed, a.world or 2, a.calls)
        print(f"subgroup ranks {sub}")
        for s in specs:
            print(short(s))
        return 0
    inject = None if a.inject is None else ("first" if a.inject == "first" else int(a.inject))
    import difftest as me   # the children import the function from this module, not from __main__
    if not a.long:
        ws = a.world or 2
        t0 = time.time()
        try:
            res = _dist.run_world(me.rank_main, ws, {"seeds": [a.seed], "calls": a.calls, "only": a.only,
                                                     "inject": inject, "verbose": a.verbose,
                                                     "keep_going": a.keep_going},
                                  timeout=a.timeout, idle=60.0, backend="t3d")
        except _dist.WorldFailure as e:
            print(f"difftest FAILURE (hang or crash): seed {a.seed}, world {ws}\n{e}\n"
                  f"reproduce: python tests/python/difftest.py --seed {a.seed} --world {ws} --calls {a.calls}")
            return 2
        e = merge(res)[a.seed]
        print(f"seed {a.seed} world {ws}: {e['calls']} calls in {time.time() - t0:.1f}s; "
              f"counts: {json.dumps(e['stats'], sort_keys=True)}")
        if e["mismatches"]:
            print(format_mismatches(e, limit=20))
            return 1
        print("no mismatches")
        return 0
    deadline = time.time() + a.hours * 3600
    seed = a.seed
    worlds = [a.world] if a.world else [2, 3, 4]
    n = 0
    total_calls = 0
    while time.time() < deadline:
        ws = worlds[n % len(worlds)]
        n += 1
        until = min(deadline, time.time() + a.world_seconds)
        cfg = {"seed": seed, "until": until, "calls": a.calls, "inject": inject}
        t0 = time.time()
        try:
            res = _dist.run_world(me.rank_main, ws, cfg, timeout=a.world_seconds + 120, idle=90.0, backend="t3d")
        except _dist.WorldFailure as e:
            print(f"difftest FAILURE (hang or crash) in a world of {ws} running seeds from {seed}:\n{e}\n"
                  f"the call named above belongs to the seed in its label; reproduce with "
                  f"python tests/python/difftest.py --seed <that seed> --world {ws} --calls {a.calls}", flush=True)
            return 2
        merged = merge(res)
        for sd in sorted(merged):
            total_calls += merged[sd]["calls"]
            if merged[sd]["mismatches"]:
                print(format_mismatches(merged[sd], limit=20), flush=True)
                return 1
        done = sorted(merged)
        print(f"[{time.strftime('%H:%M:%S')}] world {ws}: seeds {done[0]}..{done[-1]} ok "
              f"({sum(merged[s]['calls'] for s in done)} calls, {time.time() - t0:.0f}s); total {total_calls} calls",
              flush=True)
        seed = done[-1] + 1
    print(f"soak done: {total_calls} calls, no mismatches")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
