# t3d.nn.ring_attention on 2, 3 and 4 ranks (backend t3d, P2P around the ring), both layouts, causal and not, GQA:
# forward and backward equal full attention on the gathered sequence (computed by every rank on its own).
import pytest
import torch

import _dist
from t3d.nn import ring as ring_mod


def _full_reference(q, k, v, causal):
    g = q.size(1) // k.size(1)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=causal)


def _ring_checks(rank, ws):
    import torch.distributed as dist

    import t3d.nn as tnn

    results = []
    for layout in ("zigzag", "contiguous"):
        for causal in (True, False):
            for (hq, hk, d, dtype) in ((4, 2, 16, torch.float32), (2, 2, 32, torch.bfloat16)):
                seq = 2 * ws * 5 + (0 if layout == "zigzag" else 0)
                g = torch.Generator().manual_seed(1234 + hq + d)
                q = torch.randn(2, hq, seq, d, generator=g)
                k = torch.randn(2, hk, seq, d, generator=g)
                v = torch.randn(2, hk, seq, d, generator=g)
                dout = torch.randn(2, hq, seq, d, generator=g)
                # Full attention in float64 with autograd: the reference every rank computes alone.
                rq, rk, rv = (x.double().requires_grad_() for x in (q, k, v))
                ref = _full_reference(rq, rk, rv, causal)
                ref.backward(dout.double())

                def local(x):
                    return tnn.shard_sequence(x, rank, ws, layout).to(dtype)

                lq, lk, lv = (local(x).requires_grad_() for x in (q, k, v))
                out = tnn.ring_attention(lq, lk, lv, causal=causal, layout=layout)
                out.backward(local(dout))
                got = {"out": tnn.gather_sequence(out.detach(), layout=layout),
                       "dq": tnn.gather_sequence(lq.grad, layout=layout),
                       "dk": tnn.gather_sequence(lk.grad, layout=layout),
                       "dv": tnn.gather_sequence(lv.grad, layout=layout)}
                want = {"out": ref.detach(), "dq": rq.grad, "dk": rk.grad, "dv": rv.grad}
                tol = 2e-5 if dtype == torch.float32 else 4e-2
                for name in got:
                    err = (got[name].double() - want[name]).abs().max().item()
                    scale = want[name].abs().max().item()
                    assert err <= tol * max(1.0, scale), \
                        f"{layout} causal={causal} {dtype} {name}: max error {err} (tolerance {tol})"
                    results.append((layout, causal, str(dtype), name, err))
    # A sub-group ring (all ranks but the last) while the world stays idle.
    if ws >= 3:
        sub = dist.new_group(list(range(ws - 1)))
        if rank < ws - 1:
            g = torch.Generator().manual_seed(7)
            n = 2 * (ws - 1) * 3
            q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
            out = tnn.ring_attention(tnn.zigzag_shard(q, rank, ws - 1), tnn.zigzag_shard(k, rank, ws - 1),
                                     tnn.zigzag_shard(v, rank, ws - 1), group=sub, causal=True)
            full = tnn.gather_sequence(out, group=sub)
            torch.testing.assert_close(full, _full_reference(q, k, v, True), atol=2e-5, rtol=2e-5)
        dist.barrier()
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ws", [2, 3, 4])
def test_ring_attention_matches_full(ws):
    results = _dist.run_world(_ring_checks, ws, timeout=120)
    assert all(len(r) == 32 for r in results)


def test_shard_unshard_roundtrip():
    x = torch.arange(2 * 3 * 24).reshape(2, 3, 24)
    for layout in ("zigzag", "contiguous"):
        parts = [ring_mod.shard_sequence(x, r, 3, layout, dim=2) for r in range(3)]
        assert torch.equal(ring_mod.unshard_sequence(parts, layout, dim=2), x)
    parts = [ring_mod.zigzag_shard(x, r, 3) for r in range(3)]
    assert parts[0][0, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def test_layout_errors():
    x = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match="divisible by 8"):
        ring_mod.shard_sequence(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_mod.shard_sequence(x, 0, 2, "stripe")
