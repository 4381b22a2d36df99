"""`t3d-bench attention --device cuda`: t3d's CUDA attention kernels against torch SDPA's CUDA backends.

Same inputs for every implementation: t3d (`torch.ops.t3d.attention` and its backward), and SDPA restricted to one
backend at a time (flash, memory-efficient, cuDNN; a backend that refuses a configuration shows why). float16 and
bfloat16, head_dim 64 and 128, causal or not, forward and forward+backward. Each cell is the median of timed runs
after a warm-up, each run between two device synchronisations. TFLOP/s counts 4*b*h*s^2*d for the forward (half of
it when causal) and 2.5 times that for the backward, and the table gives t3d's share of the GPU's dense peak where
the device is known. Without a CUDA device, or without t3d's CUDA kernels, it refuses in one line.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

# Dense float16/bfloat16 tensor-core peak, TFLOP/s, by a piece of torch.cuda.get_device_name() (vendor data sheets;
# SXM parts unless the name says PCIe). The first match wins.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0),
               ("L40S", 362.1), ("L4", 121.0), ("A10", 125.0))
SDPA_BACKENDS = ("flash", "efficient", "cudnn")
FULL_SEQS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQS = (1024, 4096)


def why_not(torch) -> str | None:
    """None when the CUDA benchmark can run here, else the one-line reason."""
    if not torch.cuda.is_available():
        return (f"t3d-bench attention: --device cuda needs a CUDA device; torch {torch.__version__} sees none "
                f"(torch.cuda.is_available() is False)")
    try:
        from t3d import ops
    except Exception as e:  # noqa: BLE001
        return f"t3d-bench attention: --device cuda: t3d's ops do not load: {e}"
    if not ops.CUDA_AVAILABLE:
        return ("t3d-bench attention: --device cuda: t3d's CUDA kernels (t3d._C_cuda) do not load: "
                f"{ops.CUDA_LOAD_ERROR}")
    return None


def peak_tflops(name: str) -> float | None:
    for key, peak in PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def configs(quick: bool, seqs=None) -> list[dict]:
    seqs = seqs or (QUICK_SEQS if quick else FULL_SEQS)
    # quick: head_dim 64 at the shortest sequence only
    shapes = [(d, s) for d in (64, 128) for s in seqs if not quick or d == 128 or s == min(seqs)]
    out = []
    for dtype in ("bfloat16", "float16"):
        for causal in (True, False):
            for d, s in shapes:
                # batch 4 x 16 heads up to 4096 tokens, fewer heads beyond (the work grows with s^2)
                h = max(1, min(16, 16 * 4096 * 4096 // (s * s)))
                out.append(dict(dtype=dtype, causal=causal, seq=s, heads=h, head_dim=d, batch=4))
    return out


def _time(torch, fn, min_time: float, max_reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(torch, cfg: dict, min_time: float, max_reps: int) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    dt = getattr(torch, cfg["dtype"])
    g = torch.Generator(device=dev).manual_seed(0)
    b, h, s, d, causal = cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"], cfg["causal"]
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, device=dev, dtype=dt) for _ in range(4))
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION}

    def t3d_fwd(q_, k_, v_):
        return torch.ops.t3d.attention(q_, k_, v_, causal, None, 0, 0)[0]

    def sdpa(kind):
        def f(q_, k_, v_):
            with sdpa_kernel([kinds[kind]]):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
        return f

    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    res, outs = {}, {}
    for name, f in (("t3d", t3d_fwd), *((k_, sdpa(k_)) for k_ in SDPA_BACKENDS)):
        try:
            with torch.inference_mode():
                outs[name] = f(q, k, v)
                fwd = _time(torch, lambda: f(q, k, v), min_time, max_reps)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

            def step():
                qg.grad = kg.grad = vg.grad = None
                f(qg, kg, vg).backward(dout)

            both = _time(torch, step, min_time, max_reps)
        except RuntimeError as e:  # a backend that does not take this configuration
            res[name] = {"error": str(e).splitlines()[0][:160]}
            continue
        res[name] = {"fwd_ms": fwd * 1e3, "fwdbwd_ms": both * 1e3, "fwd_tflops": flops / fwd / 1e12,
                     "fwdbwd_tflops": 3.5 * flops / both / 1e12}
    ref = next((outs[k_] for k_ in SDPA_BACKENDS if k_ in outs), None)
    if "t3d" in outs and ref is not None:
        res["max_abs_diff"] = (outs["t3d"].float() - ref.float()).abs().max().item()
    return res


def _cell(r: dict, key: str) -> str:
    return f"{r[key]:.2f}" if key in r else "-"


def render(meta: dict, rows: list[dict]) -> str:
    peak = meta.get("peak_tflops")
    lines = [
        "# Attention on CUDA: t3d vs torch SDPA's backends",
        "",
        f"`t3d-bench attention --device cuda{' --quick' if meta['quick'] else ''}` ({meta['date']}), "
        f"{meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}. Milliseconds (median of runs between device "
        "synchronisations) and TFLOP/s (forward 4bhs^2d, halved when causal; backward 2.5x the forward)"
        + (f"; t3d's share of the {peak:.0f} TFLOP/s dense peak." if peak else "; peak unknown for this GPU."),
        "",
        "| dtype | causal | seq | b x h | d | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        for impl in ("t3d", *SDPA_BACKENDS):
            c = r["results"].get(impl, {})
            head = f"| {r['dtype']} | {'yes' if r['causal'] else 'no'} | {r['seq']} | {r['batch']}x{r['heads']} | " \
                   f"{r['head_dim']} | {impl} |"
            if "error" in c:
                lines.append(f"{head} refused: {c['error']} | | | |")
                continue
            share = f" ({c['fwd_tflops'] / peak:.0%})" if peak and impl == "t3d" and c else ""
            lines.append(f"{head} {_cell(c, 'fwd_ms')} | {_cell(c, 'fwd_tflops')}{share} | {_cell(c, 'fwdbwd_ms')} | "
                         f"{_cell(c, 'fwdbwd_tflops')} |")
        if "max_abs_diff" in r["results"]:
            lines.append(f"| | | | | | t3d vs SDPA: max abs diff {r['results']['max_abs_diff']:.1e} | | | | |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    import torch

    why = why_not(torch)
    if why:
        print(why)
        return 2
    name = torch.cuda.get_device_name()
    meta = {"gpu": name, "peak_tflops": peak_tflops(name), "torch": torch.__version__, "cuda": torch.version.cuda,
            "quick": bool(args.quick), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = []
    t0 = time.time()
    for c in configs(args.quick, args.seqs):
        r = bench_one(torch, c, args.min_time, args.max_reps)
        rows.append({**c, "results": r})
        t = r.get("t3d", {})
        print(f"{c['dtype']} causal={c['causal']} s={c['seq']} d={c['head_dim']}: t3d "
              + (f"{t['fwd_ms']:.2f} ms fwd, {t['fwdbwd_ms']:.2f} ms fwd+bwd" if "fwd_ms" in t else str(t)) + "; "
              + ", ".join(f"{k} {r[k]['fwd_ms']:.2f}/{r[k]['fwdbwd_ms']:.2f}" for k in SDPA_BACKENDS
                          if "fwd_ms" in r.get(k, {})), flush=True)
    meta["wall_s"] = round(time.time() - t0, 1)
    md = render(meta, rows)
    print(md)
    if not args.no_save:
        from .attention import _default_out_dir

        out_dir = Path(args.out_dir) if args.out_dir else _default_out_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention-cuda.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (out_dir / "attention-cuda.md").write_text(md)
        print(f"wrote {out_dir / 'attention-cuda.json'} and {out_dir / 'attention-cuda.md'}")
    return 0
