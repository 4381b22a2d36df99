"""What rank 0 shows: a tqdm bar with per-step lines, the final summary, and the loss curve PNG."""

from __future__ import annotations

import statistics
import sys


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
                leave=False)


def write(msg: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stdout)
    except ImportError:
        print(msg)
    sys.stdout.flush()


def summarize(records: list[dict], args, layout: str, world: int) -> dict:
    if not records:
        return {"layout": layout, "steps": 0}
    times = [r["step_time"] for r in records]
    # The first step pays for lazy initialisation (allocator, DTensor sharding propagation caches): leave it out.
    steady = times[1:] if len(times) > 1 else times
    mean_t = statistics.fmean(steady)
    return {
        "layout": layout,
        "backend": args.backend,
        "ranks": world,
        "steps": len(records),
        "first_step": records[0]["step"],
        "loss_first": records[0]["loss"],
        "loss_last": records[-1]["loss"],
        "grad_norm_last": records[-1]["grad_norm"],
        "step_time_mean_s": mean_t,
        "step_time_median_s": statistics.median(steady),
        "tokens_per_s": args.global_batch * args.seq_len / mean_t,
        "train_time_s": sum(times),
    }


def print_summary(s: dict, png: str | None, metrics: str | None) -> None:
    if not s.get("steps"):
        write("no steps run")
        return
    write("")
    write(f"summary: {s['layout']} on {s['ranks']} rank(s), backend {s['backend']}")
    write(f"  steps {s['first_step']}..{s['first_step'] + s['steps'] - 1}: loss {s['loss_first']:.4f} -> "
          f"{s['loss_last']:.4f}, last grad norm {s['grad_norm_last']:.4f}")
    write(f"  step time {s['step_time_mean_s'] * 1000:.1f} ms mean ({s['step_time_median_s'] * 1000:.1f} ms median, "
          f"first step excluded), {s['tokens_per_s']:.0f} tokens/s, {s['train_time_s']:.1f} s in the loop")
    for t in s.get("pipeline") or []:
        ms = {k: t[k] * 1000 for k in ("step", "fwd", "bwd", "wait", "reduce", "optim")}
        rest = max(0.0, ms["step"] - sum(ms[k] for k in ("fwd", "bwd", "wait", "reduce", "optim")))
        write(f"  pipeline rank {t['pp_rank']} (stages {', '.join(map(str, t['stages']))}), {s['schedule']}, "
              f"{s['microbatches']} microbatches: step {ms['step']:.1f} ms = forward {ms['fwd']:.1f} + backward "
              f"{ms['bwd']:.1f} + waiting for other stages (bubble, transfers) {ms['wait']:.1f} + gradient and loss "
              f"reductions {ms['reduce']:.1f} + clipping and optimizer {ms['optim']:.1f} + the rest {rest:.1f}")
    if png:
        write(f"  loss curve: {png}")
    if metrics:
        write(f"  metrics: {metrics}")


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(losses: list[float], resumed_at: int, path: str, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, marker=".", linewidth=1)
    if resumed_at:
        ax.axvline(resumed_at + 0.5, color="grey", linestyle="--", linewidth=0.8, label=f"resumed at {resumed_at}")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
