# torch.ops.t3d.attention / attention_backward / attention_merge_ against a float64 softmax reference: values, lse
# and gradients; causal offsets, GQA, odd lengths, fully masked rows, bfloat16; argument errors; torch.compile; CUDA
# (skipped without a device).
import math

import pytest
import torch

import t3d.ops  # noqa: F401

ops = torch.ops.t3d
CUDA = torch.cuda.is_available() and t3d.ops.CUDA_AVAILABLE
NO_CUDA = "no CUDA device" if not torch.cuda.is_available() else "t3d built without CUDA kernels"


def reference(q, k, v, causal=False, scale=None, q_start=0, k_start=0):
    """Plain softmax attention in float64 (autograd-capable); out rows with no visible key are 0, lse -inf."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    g = q.size(1) // k.size(1)
    k64 = k64.repeat_interleave(g, dim=1)
    v64 = v64.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        qpos = torch.arange(q.size(2)) + q_start
        kpos = torch.arange(k.size(2)) + k_start
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse)[..., None], 0.0))
    p = p.masked_fill(torch.isinf(lse)[..., None], 0.0)
    return p @ v64, lse


def make(b, hq, hk, sq, sk, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(b, hk, sk, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
GTOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
        torch.float16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

CASES = [
    # b, hq, hk, sq, sk, d, causal, q_start, k_start
    (1, 1, 1, 1, 1, 8, False, 0, 0),
    (2, 2, 2, 7, 7, 16, True, 0, 0),
    (1, 4, 2, 129, 129, 64, True, 0, 0),
    (2, 4, 1, 33, 70, 32, False, 0, 0),
    (1, 2, 2, 40, 64, 128, True, 24, 0),      # queries are the tail of the keys (decode-like)
    (1, 2, 1, 31, 47, 24, True, 16, 20),       # offsets cut the diagonal inside the block
    (1, 2, 2, 20, 30, 16, True, 0, 10),        # rows 0..9 see no key: out 0, lse -inf
    (1, 2, 2, 9, 9, 256, False, 0, 0),
    (1, 2, 2, 16, 16, 40, True, 0, 100),       # every row fully masked
]


def _id(c):
    return "b{}h{}kv{}q{}k{}d{}{}{}".format(*c[:6], "c" if c[6] else "", f"o{c[7]}_{c[8]}" if c[7] or c[8] else "")


def _check_case(case, dtype, device):
    b, hq, hk, sq, sk, d, causal, qs, ks = case
    q, k, v = make(b, hq, hk, sq, sk, d, dtype, device)
    scale = None if d != 24 else 0.3
    out, lse = ops.attention(q, k, v, causal, scale, qs, ks)
    ref_q, ref_k, ref_v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(ref_q, ref_k, ref_v, causal, scale, qs, ks)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    torch.testing.assert_close(out.cpu().double(), ref_out.detach(), **TOL[dtype])
    torch.testing.assert_close(lse.cpu().double(), ref_lse.detach(), **TOL[dtype])
    # Gradients through autograd against the reference's autograd.
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o2, _ = ops.attention(qg, kg, vg, causal, scale, qs, ks)
    dout = torch.randn(o2.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    o2.backward(dout)
    ref_out.backward(dout.cpu().double())
    for got, want in ((qg.grad, ref_q.grad), (kg.grad, ref_k.grad), (vg.grad, ref_v.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().double(), want, **GTOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_backward_cpu(case, dtype):
    _check_case(case, dtype, "cpu")


def test_backward_op_direct_matches_autograd():
    q, k, v = make(1, 4, 2, 19, 23, 16)
    out, lse = ops.attention(q, k, v, True, None, 4, 0)
    dout = torch.randn_like(out)
    dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse, True, None, 4, 0)
    rq, rk, rv = (x.double().requires_grad_() for x in (q, k, v))
    ro, _ = reference(rq, rk, rv, True, None, 4, 0)
    ro.backward(dout.double())
    for got, want in ((dq, rq.grad), (dk, rk.grad), (dv, rv.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_double_reference_small():
    # gradcheck-style: finite differences of the float32 op agree with its analytic gradient.
    q, k, v = make(1, 2, 1, 5, 6, 8, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def f(q_, k_, v_):
        return ops.attention(q_, k_, v_, True, None, 2, 0)[0]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-2, atol=5e-3, rtol=5e-3, nondet_tol=1e-6)


def test_noncontiguous_inputs():
    q, k, v = make(2, 3, 3, 11, 11, 16)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, BSHD memory
    assert not qt.is_contiguous()
    out, lse = ops.attention(qt, k[:, :, :, :], v, True)
    ref, ref_lse = reference(q, k, v, True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_matches_sdpa():
    q, k, v = make(2, 4, 4, 64, 64, 32)
    out = t3d.ops.sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               atol=1e-5, rtol=1e-5)


def test_empty_shapes():
    q, k, v = make(1, 2, 2, 0, 5, 8)
    out, lse = ops.attention(q, k, v)
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    q, k, v = make(1, 2, 2, 3, 0, 8)
    out, lse = ops.attention(q, k, v)
    assert torch.all(out == 0) and torch.all(torch.isinf(lse))


@pytest.mark.parametrize("nsplit", [2, 3, 5])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_of_random_splits_equals_whole(nsplit, out_dtype):
    g = torch.Generator().manual_seed(nsplit)
    q, k, v = make(2, 4, 2, 37, 90, 32, seed=nsplit)
    whole, whole_lse = ops.attention(q, k, v, True, None, 60, 0)
    cuts = sorted(torch.randperm(89, generator=g)[: nsplit - 1].add(1).tolist())
    bounds = [0] + cuts + [90]
    out = torch.zeros_like(q, dtype=out_dtype)
    lse = torch.full(q.shape[:3], float("-inf"))
    for a, b in zip(bounds[:-1], bounds[1:]):
        bo, bl = ops.attention(q, k[:, :, a:b], v[:, :, a:b], True, None, 60, a)
        ops.attention_merge_(out, lse, bo, bl)
    tol = TOL[out_dtype]
    torch.testing.assert_close(out.float(), whole, **tol)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_merge_masked_blocks():
    out = torch.randn(1, 1, 3, 4)
    lse = torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    bo = torch.randn(1, 1, 3, 4)
    bl = torch.tensor([[[float("-inf"), 1.0, float("-inf")]]])
    o0 = out.clone()
    ops.attention_merge_(out, lse, bo, bl)
    torch.testing.assert_close(out[0, 0, 0], o0[0, 0, 0])   # -inf block leaves the row
    torch.testing.assert_close(out[0, 0, 1], bo[0, 0, 1])   # -inf running row takes the block
    assert lse[0, 0, 1].item() == 1.0 and math.isinf(lse[0, 0, 2].item())


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q.double(), k, v), "'q' must be float32, bfloat16 or float16"),
    (lambda q, k, v: (q, k.bfloat16(), v), "'k' has dtype"),
    (lambda q, k, v: (q[0], k, v), "'q' must be 4-D"),
    (lambda q, k, v: (q[:, :3], k, v), "multiple of 'k'/'v' heads"),
    (lambda q, k, v: (q, k, v[:, :, :5]), "'k' .* and 'v' .* must have the same shape"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "head_dim"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch"),
])
def test_argument_errors(bad, match):
    q, k, v = make(2, 4, 2, 6, 6, 16)
    with pytest.raises(RuntimeError, match=match):
        ops.attention(*bad(q, k, v))


def test_argument_errors_other():
    q, k, v = make(1, 2, 2, 6, 6, 16)
    with pytest.raises(RuntimeError, match="'scale' must be a positive"):
        ops.attention(q, k, v, False, -1.0)
    with pytest.raises(RuntimeError, match="'q' is on meta"):
        ops.attention(q.to("meta"), k, v)
    out, lse = ops.attention(q, k, v)
    with pytest.raises(RuntimeError, match="'lse' must be float32"):
        ops.attention_backward(out, q, k, v, out, lse.double())
    with pytest.raises(RuntimeError, match="'out' must be contiguous"):
        ops.attention_merge_(out.transpose(2, 3).contiguous().transpose(2, 3), lse, out, lse)
    with pytest.raises(RuntimeError, match="'block_lse' has shape"):
        ops.attention_merge_(out, lse, out, lse[:, :, :3])


def test_meta_shapes():
    q, k, v = (x.to("meta") for x in make(2, 4, 2, 10, 12, 16))
    out, lse = ops.attention(q, k, v, True)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 4, 10)
    assert lse.dtype == torch.float32
    dq, dk, dv = ops.attention_backward(out, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()

    def f(q, k, v, o, l):
        out, lse = torch.ops.t3d.attention(q, k, v, True, None, 0, 0)
        torch.ops.t3d.attention_merge_(o, l, out, lse)
        return (out * 2).sum() + o.sum()

    cf = torch.compile(f, fullgraph=True, backend=backend)
    q, k, v = make(1, 2, 1, 9, 9, 16)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    qb, kb, vb = (x.clone().requires_grad_() for x in (q, k, v))
    o1, l1 = torch.zeros(1, 2, 9, 16), torch.full((1, 2, 9), float("-inf"))
    o2, l2 = o1.clone(), l1.clone()
    y1 = f(qa, ka, va, o1, l1)
    y2 = cf(qb, kb, vb, o2, l2)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    y1.backward()
    y2.backward()
    for a, b in ((qa, qb), (ka, kb), (va, vb)):
        torch.testing.assert_close(a.grad, b.grad)


def test_opcheck():
    q, k, v = make(1, 2, 1, 5, 7, 8)
    torch.library.opcheck(torch.ops.t3d.attention.default, (q, k, v, True, None, 2, 0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ---- CUDA (skipped without a device) -------------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_backward_cuda(case, dtype):
    _check_case(case, dtype, "cuda")


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_merge_cuda_matches_cpu():
    q, k, v = make(2, 4, 2, 37, 90, 32)
    whole, whole_lse = ops.attention(q, k, v, True, None, 60, 0)
    out = torch.zeros_like(q, device="cuda")
    lse = torch.full(q.shape[:3], float("-inf"), device="cuda")
    for a, b in ((0, 30), (30, 31), (31, 90)):
        bo, bl = ops.attention(q.cuda(), k[:, :, a:b].cuda(), v[:, :, a:b].cuda(), True, None, 60, a)
        ops.attention_merge_(out, lse, bo, bl)
    torch.testing.assert_close(out.cpu(), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), whole_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
def test_cuda_device_mismatch_error():
    q, k, v = make(1, 2, 2, 4, 4, 8)
    with pytest.raises(RuntimeError, match="'k' is on cpu"):
        ops.attention(q.cuda(), k, v.cuda())


# Larger shapes on the GPU: t3d's CUDA kernels and torch's SDPA (same device, same inputs) against the float64
# reference. t3d's error must stay within a small multiple of SDPA's own error (or under an absolute floor), for the
# output and for the three gradients; GQA goes to SDPA as repeated k/v heads.
SDPA_CASES = [
    # b, hq, hk, s, d, causal
    (2, 8, 8, 256, 64, True),
    (1, 8, 2, 300, 128, True),
    (2, 4, 4, 1024, 64, False),
    (1, 4, 1, 513, 32, True),
]
SDPA_FLOOR = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: "b{}h{}kv{}s{}d{}{}".format(*c[:5], "c" if c[5] else ""))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_matches_sdpa_and_float64(case, dtype):
    b, hq, hk, s, d, causal = case
    q, k, v = make(b, hq, hk, s, s, d, dtype, "cuda", seed=7)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(device="cuda", dtype=dtype)

    def run_t3d():
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out, _ = ops.attention(qg, kg, vg, causal)
        out.backward(dout)
        return out, qg.grad, kg.grad, vg.grad

    def run_sdpa():
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        g = hq // hk
        out = torch.nn.functional.scaled_dot_product_attention(
            qg, kg.repeat_interleave(g, dim=1), vg.repeat_interleave(g, dim=1), is_causal=causal)
        out.backward(dout)
        return out, qg.grad, kg.grad, vg.grad

    rq, rk, rv = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference(rq, rk, rv, causal)
    ref_out.backward(dout.cpu().double())
    ref = (ref_out.detach(), rq.grad, rk.grad, rv.grad)
    got, sdpa = run_t3d(), run_sdpa()
    for name, g, s_, r in zip(("out", "dq", "dk", "dv"), got, sdpa, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        err = (g.cpu().double() - r).abs().max().item()
        sdpa_err = (s_.cpu().double() - r).abs().max().item()
        assert err <= max(4 * sdpa_err, SDPA_FLOOR[dtype]), (
            f"{name}: t3d max error {err:.3g} vs float64, SDPA's {sdpa_err:.3g} ({dtype}, {case})")
