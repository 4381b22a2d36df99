"""`t3d-bench attention`: torch.ops.t3d.attention vs torch SDPA (F.scaled_dot_product_attention) on CPU.

Both run in the same process on the same inputs with the same intra-op thread count; each cell is the median of
several timed runs after a warm-up. Reports forward and forward+backward times, their ratio (torch / t3d: above 1
means t3d is faster), the largest output difference, and the load average before and after (the numbers are only as
quiet as the machine). Writes docs/benchmarks/attention.json and attention.md unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

FULL_SEQS = (512, 1024, 2048, 4096, 8192)
QUICK_SEQS = (512, 2048)


def add_parser(sub) -> None:
    p = sub.add_parser("attention", help="t3d attention vs torch SDPA on CPU (or CUDA: --device cuda)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: t3d's CPU kernels vs SDPA; cuda: t3d's CUDA kernels vs SDPA's flash, efficient and cuDNN "
                        "backends (attention-cuda.json/.md; refuses in one line without a GPU) [cpu]")
    p.add_argument("--quick", action="store_true", help="a small subset (CPU: seq 512 and 2048, head_dim 64; "
                                                        "CUDA: seq 1024 and 4096 at head_dim 128, 1024 at 64)")
    p.add_argument("--seqs", type=int, nargs="*", help="sequence lengths (default 512..8192, quick: 512 2048)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's default)")
    p.add_argument("--min-time", type=float, default=0.4, help="seconds of timed runs per cell (at least 2 runs)")
    p.add_argument("--max-reps", type=int, default=5)
    p.add_argument("--out-dir", default=None, help="where to write attention.json/.md (default docs/benchmarks "
                                                   "of the source tree, else the current directory)")
    p.add_argument("--no-save", action="store_true", help="print only")


def _heads_for(seq: int) -> int:
    # Keep heads * seq^2 about constant up to 2048 so the long sequences do not dominate the run.
    return max(1, min(16, (8 * 1024 * 1024) // (seq * seq)))


def _configs(args):
    seqs = args.seqs or (QUICK_SEQS if args.quick else FULL_SEQS)
    dims = (64,) if args.quick else (64, 128)
    out = []
    for dtype in ("float32", "bfloat16"):
        for causal in (True, False):
            for d in dims:
                for s in seqs:
                    h = _heads_for(s)
                    out.append(dict(dtype=dtype, causal=causal, seq=s, heads=h, kv_heads=h, head_dim=d, batch=1))
    # Grouped-query attention (4 q heads per kv head), causal, the head_dim of large models.
    gqa_seqs = (2048,) if args.quick else (512, 2048)
    for dtype in ("float32", "bfloat16"):
        for s in gqa_seqs:
            h = max(4, _heads_for(s))
            out.append(dict(dtype=dtype, causal=True, seq=s, heads=h, kv_heads=h // 4, head_dim=128, batch=1))
    return out


def _time(fn, min_time: float, max_reps: int) -> float:
    fn()  # warm-up
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < 2 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bench_one(cfg, args):
    import torch
    import torch.nn.functional as F

    import t3d.ops  # noqa: F401

    dt = getattr(torch, cfg["dtype"])
    g = torch.Generator().manual_seed(0)
    b, h, hk, s, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["seq"], cfg["head_dim"]
    q = torch.randn(b, h, s, d, generator=g).to(dt)
    k = torch.randn(b, hk, s, d, generator=g).to(dt)
    v = torch.randn(b, hk, s, d, generator=g).to(dt)
    dout = torch.randn(b, h, s, d, generator=g).to(dt)
    causal = cfg["causal"]
    gqa = hk != h

    def t3d_fwd(q_, k_, v_):
        return torch.ops.t3d.attention(q_, k_, v_, causal, None, 0, 0)[0]

    def torch_fwd(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)

    res = {}
    outs = {}
    for name, f in (("t3d", t3d_fwd), ("torch", torch_fwd)):
        with torch.inference_mode():
            outs[name] = f(q, k, v)
            res[f"fwd_{name}_ms"] = 1e3 * _time(lambda: f(q, k, v), args.min_time, args.max_reps)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def step():
            qg.grad = kg.grad = vg.grad = None
            f(qg, kg, vg).backward(dout)

        res[f"fwdbwd_{name}_ms"] = 1e3 * _time(step, args.min_time, args.max_reps)
    res["max_abs_diff"] = (outs["t3d"].float() - outs["torch"].float()).abs().max().item()
    res["fwd_ratio"] = res["fwd_torch_ms"] / res["fwd_t3d_ms"]
    res["fwdbwd_ratio"] = res["fwdbwd_torch_ms"] / res["fwdbwd_t3d_ms"]
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    res["fwd_t3d_gflops"] = flops / (res["fwd_t3d_ms"] * 1e6)
    return res


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _kernel_paths() -> dict:
    """The CPU kernel path each dtype takes (t3d_attn_isa_describe of libt3d_kernels), e.g. avx512 / amx."""
    try:
        import ctypes

        import t3d

        lib = ctypes.CDLL(str(Path(t3d.__file__).resolve().parent / "libt3d_kernels.so"))
        lib.t3d_attn_isa_describe.restype = ctypes.c_char_p
        lib.t3d_attn_isa_describe.argtypes = [ctypes.c_int, ctypes.c_int]
        return {name: lib.t3d_attn_isa_describe(0, code).decode() for name, code in (("float32", 0), ("bfloat16", 1))}
    except (OSError, AttributeError):
        return {}


def _row(c, r) -> str:
    shape = f"{c['heads']}/{c['kv_heads']}"
    return (f"| {c['dtype']:<8} | {'yes' if c['causal'] else 'no ':<3} | {c['seq']:>5} | {shape:>5} | {c['head_dim']:>3} "
            f"| {r['fwd_t3d_ms']:>9.2f} | {r['fwd_torch_ms']:>9.2f} | {r['fwd_ratio']:>5.2f} "
            f"| {r['fwdbwd_t3d_ms']:>9.2f} | {r['fwdbwd_torch_ms']:>9.2f} | {r['fwdbwd_ratio']:>5.2f} "
            f"| {r['fwd_t3d_gflops']:>6.1f} | {r['max_abs_diff']:.1e} |")


HEADER = ("| dtype    | causal | seq | heads q/kv | d | fwd t3d ms | fwd torch ms | fwd torch/t3d "
          "| fwd+bwd t3d ms | fwd+bwd torch ms | fwd+bwd torch/t3d | t3d fwd GFLOP/s | max abs diff |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _geomean(xs):
    import math

    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def run(args) -> int:
    if getattr(args, "device", "cpu") == "cuda":
        from . import attention_cuda

        return attention_cuda.run(args)
    import torch

    import t3d

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = _configs(args)
    load_before = os.getloadavg()
    meta = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "t3d": t3d.__version__,
        "cpu_features": t3d._cpu_features(),
        "t3d_kernel_paths": _kernel_paths(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "quick": bool(args.quick),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"t3d-bench attention: {meta['cpu']}, {meta['cores']} cores, {meta['threads']} threads, torch "
          f"{meta['torch']}; load average before {meta['load_avg_before']}")
    print("ratio = torch time / t3d time (above 1: t3d faster)")
    print(HEADER)
    rows = []
    t0 = time.time()
    for c in configs:
        r = _bench_one(c, args)
        rows.append({**c, **r})
        print(_row(c, r), flush=True)
    meta["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.time() - t0, 1)
    summary = {
        "fwd_ratio_geomean": _geomean([r["fwd_ratio"] for r in rows]),
        "fwdbwd_ratio_geomean": _geomean([r["fwdbwd_ratio"] for r in rows]),
    }
    for key in ("float32", "bfloat16"):
        sel = [r for r in rows if r["dtype"] == key]
        summary[f"fwd_ratio_geomean_{key}"] = _geomean([r["fwd_ratio"] for r in sel])
        summary[f"fwdbwd_ratio_geomean_{key}"] = _geomean([r["fwdbwd_ratio"] for r in sel])
    print(f"load average after {meta['load_avg_after']}; {meta['wall_s']} s")
    print("geometric mean of ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    if not args.no_save:
        out_dir = Path(args.out_dir) if args.out_dir else _default_out_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows},
                                                           indent=1) + "\n")
        (out_dir / "attention.md").write_text(_markdown(meta, summary, rows))
        png = _plot(rows, out_dir / "attention.png")
        print(f"wrote {out_dir / 'attention.json'}, {out_dir / 'attention.md'}" + (f" and {png}" if png else ""))
    return 0


def _plot(rows, path: Path):
    """torch's time over t3d's for every row, forward and forward+backward, one panel per dtype; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    most = max(sum(r["dtype"] == dt for r in rows) for dt in dtypes)
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(max(6.0, 0.7 * most + 1.5), 3.2 * len(dtypes)),
                             squeeze=False, dpi=100)
    for ax, dt in zip(axes[:, 0], dtypes):
        sel = [r for r in rows if r["dtype"] == dt]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [r["fwd_ratio"] for r in sel], width=0.4, label="forward")
        ax.bar([x + 0.2 for x in xs], [r["fwdbwd_ratio"] for r in sel], width=0.4, label="forward+backward")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(xs), [f"{'c' if r['causal'] else 'nc'}{' gqa' if r['kv_heads'] != r['heads'] else ''} d{r['head_dim']}\n{r['seq']}"
                                for r in sel], fontsize=7)
        ax.set_ylabel("torch SDPA time / t3d time")
        ax.set_title(f"{dt} (above 1: t3d faster; c = causal, d = head dim, sequence)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _default_out_dir() -> Path:
    src = Path(__file__).resolve().parents[3]
    if (src / "docs").is_dir() and (src / "python" / "t3d").is_dir():
        return src / "docs" / "benchmarks"
    return Path.cwd()


def _markdown(meta, summary, rows) -> str:
    lines = [
        "# Attention: t3d vs torch SDPA on CPU",
        "",
        "Generated by `t3d-bench attention" + (" --quick" if meta["quick"] else "") + "` "
        f"({meta['date']}). Same process, same inputs, same intra-op thread count; median of timed runs after a "
        "warm-up. Ratio = torch time / t3d time (above 1: t3d faster). torch runs "
        "`F.scaled_dot_product_attention` (its CPU flash kernel; `enable_gqa=True` for the GQA rows); t3d runs "
        "`torch.ops.t3d.attention` and its autograd (`attention_backward`). Batch 1; heads scale down with the "
        "sequence so the long ones stay affordable.",
        "",
        f"- CPU: {meta['cpu']}, {meta['cores']} cores, {meta['threads']} threads; features {meta['cpu_features']}",
        f"- torch {meta['torch']}, t3d {meta['t3d']}; t3d CPU kernel paths "
        + (", ".join(f"{k} {v}" for k, v in meta.get("t3d_kernel_paths", {}).items()) or "unknown"),
        f"- load average before {meta['load_avg_before']}, after {meta['load_avg_after']} "
        "(1, 5, 15 min; other work shared the machine when above the core count); run took "
        f"{meta['wall_s']} s",
        "",
        HEADER,
    ]
    lines += [_row(r, r) for r in rows]
    lines += ["", "Geometric means of the ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()), ""]
    return "\n".join(lines)
