"""Command line of t3d-train: the knobs, the launcher (--nproc), and the backend comparison mode."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

DESCRIPTION = """\
The 3D-parallel (dp x tp x cp) training workflow of transformers' examples/3D_parallel.py on backend t3d, on CPU
or CUDA, with an embedded tiny Llama and generated data (nothing from a hub).

  t3d-train                              # dp 2 x tp 2 x cp 2 on 8 ranks (launches them itself)
  t3d-train --dp 1 --tp 2 --cp 1         # any layout; world size = pp*dp*tp*cp
  t3d-train --pp 2 --dp 2 --tp 2 --cp 1 --schedule interleaved-1f1b   # 4D: pipeline stages too
  t3d-train --pp 1 --dp 4 --dp-shard 2 --tp 1 --cp 1                # HSDP (FSDP2 replicate 2 x shard 2)
  torchrun --nproc-per-node 4 -m t3d.train --dp 2 --tp 2 --cp 1
  t3d-train --resume --ckpt-dir DIR --dp 4 --tp 1 --cp 2 --steps 80   # continue under another layout
  t3d-train --compare-backends           # t3d vs gloo, taking turns, on every layout
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t3d-train", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("layout")
    g.add_argument("--dp", type=int, default=2, help="data-parallel degree (FSDP NO_SHARD) [2]")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (model's TP plan) [2]")
    g.add_argument("--cp", type=int, default=2, help="context-parallel degree (torch context_parallel) [2]")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel degree: the model's layers in pp stages (torch.distributed.pipelining) [1]")
    g.add_argument("--dp-shard", type=int, default=1,
                   help="shard the dp dimension with FSDP2: --dp-shard = --dp is ZeRO-3 (fully_shard over dp), "
                        "a divisor in between HSDP (replicate dp/S x shard S); 1 keeps FSDP1 NO_SHARD [1]")
    g.add_argument("--cp-rotate", choices=["allgather", "alltoall"], default="allgather",
                   help="how context parallelism passes key/value shards (torch set_rotate_method) [allgather]")
    g.add_argument("--nproc", type=int, default=None,
                   help="launch this many ranks (must equal pp*dp*tp*cp; default: pp*dp*tp*cp when not already "
                        "under torchrun or another launcher)")
    g = p.add_argument_group("pipeline (with --pp > 1)")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], default="1f1b",
                   help="pipeline schedule [1f1b]")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step; must divide the per-replica batch [largest divisor <= 2*pp]")
    g.add_argument("--stages-per-rank", type=int, default=None,
                   help="stages per pipeline rank (interleaved-1f1b: >= 2) [2 for interleaved-1f1b, else 1]")
    g.add_argument("--compare-schedules", action="store_true",
                   help="run this layout with each schedule (gpipe, 1f1b, interleaved-1f1b) and print step time, "
                        "compute and bubble per schedule")
    g = p.add_argument_group("training")
    g.add_argument("--global-batch", type=int, default=8, help="sequences per step over all dp ranks [8]")
    g.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence [64]")
    g.add_argument("--steps", type=int, default=100, help="total optimizer steps (a resumed run counts on) [100]")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate [3e-3]")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm [1.0]")
    g.add_argument("--seed", type=int, default=0, help="data generation and shuffling seed [0]")
    g.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N steps after the first (torch.profiler, CPU) and print where rank 0's step time "
                        "goes: compute (aten ops), communication (c10d ops and waits), Python and the rest [0: off]")
    g.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the tiny Llama (more allow more pipeline stages) [2]")
    g.add_argument("--grad-reduce", choices=["avg", "premul_sum"], default="avg",
                   help="how gradients are averaged over dp and cp: ReduceOp.AVG, or PREMUL_SUM(1/n) (FSDP2: a "
                        "divide factor over dp x cp) [avg]")
    g.add_argument("--model-seed", type=int, default=0, help="seed of the cached tiny model's initial weights [0]")
    g.add_argument("--num-sequences", type=int, default=1024, help="packed sequences in the generated dataset")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model dtype [float32]")
    g = p.add_argument_group("system")
    g.add_argument("--backend", choices=["t3d", "gloo", "nccl"], default="t3d", help="process group backend [t3d]")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="[auto: cuda if present]")
    g.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds [300]")
    g.add_argument("--model-cache", default=None,
                   help="folder of the saved tiny model [$T3D_MODEL_CACHE or ~/.cache/t3d/models]")
    g = p.add_argument_group("checkpoint and output")
    g.add_argument("--ckpt-dir", default=None, help="DCP checkpoints, metrics.json and loss.png "
                                                   "[./t3d-train-ckpt/<layout>]")
    g.add_argument("--ckpt-interval", type=int, default=0, help="also save every N steps (0: only at the end)")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from a checkpoint: the latest in --ckpt-dir, or the given step folder / dir")
    g.add_argument("--no-save", action="store_true", help="skip the final checkpoint")
    g.add_argument("--no-plot", action="store_true", help="skip the loss curve PNG")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar (per-step lines still print)")
    g.add_argument("--metrics-json", default=None, help="write per-step metrics here [<ckpt-dir>/metrics.json]")
    g = p.add_argument_group("comparison")
    g.add_argument("--compare-backends", action="store_true",
                   help="time t3d against gloo on each layout, taking turns, and print a table with the ratio")
    g.add_argument("--compare-layouts", default="1x2x1,1x4x1,2x2x2",
                   help="dp x tp x cp layouts for --compare-backends [1x2x1,1x4x1,2x2x2]")
    g.add_argument("--compare-rounds", type=int, default=2,
                   help="runs of each backend per layout for --compare-backends, alternating t3d, gloo, t3d, ... "
                        "(the table shows medians) [2]")
    g.add_argument("--compare-out", default=None,
                   help="--compare-backends also writes its table, every run's numbers and a plot here "
                        "(compare-backends.md, .json, .png)")
    return p


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def _child_env(nproc: int) -> dict:
    env = dict(os.environ)
    # More ranks than cores (8 on 2 here): intra-op threads would only fight over the cores.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "t3d.train", *argv]


def launch(nproc: int, argv: list[str], device: str = "auto") -> int:
    """Starts nproc ranks of this run: as forks of a server that imported the training stack once (CPU runs), or
    through torchrun (CUDA runs: a process whose imports may have touched CUDA must not be forked)."""
    argv = _strip_nproc(argv)
    if _forks_ok(device):
        return _launch_forks(nproc, argv, quiet=False)
    cmd = torchrun_command(nproc, argv)
    print("t3d-train: launching " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    try:
        return subprocess.call(cmd, env=_child_env(nproc))
    except KeyboardInterrupt:
        return 130


def _forks_ok(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def _fork_worker(argv: list[str], quiet: bool) -> None:
    """A rank started by _launch_forks: the launcher's environment variables (RANK, WORLD_SIZE, ...) are set; quiet:
    its standard output goes to /dev/null."""
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    rc = main(argv)
    if rc:
        sys.exit(rc)


def _server_ready() -> None:
    pass


def _start_fork_server(nproc: int, wait: bool = False) -> None:
    """The server the ranks are forked from: started once per process, with this environment, after importing
    t3d.train.preload (torch, transformers, datasets, t3d: about 6 s of one core). wait: until it has, and with the
    launcher's own modules imported here too."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    os.environ.update(_child_env(nproc))
    mp.set_forkserver_preload(["t3d.train.preload"])
    forkserver.ensure_running()
    if wait:
        import torch.distributed.launcher.api  # noqa: F401

        p = mp.get_context("forkserver").Process(target=_server_ready)
        p.start()
        p.join()


def _launch_forks(nproc: int, argv: list[str], quiet: bool, ranks_quiet: bool = False) -> int:
    """torch's elastic launcher (torchrun's, with the same rendezvous and environment variables) with a function
    entry point and the forkserver start method: every rank starts as a fork of the server, with the training stack
    imported, instead of importing it itself. An 8-rank run on 2 cores starts in about 9 s instead of 28."""
    import uuid

    _start_fork_server(nproc)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not quiet:
        print(f"t3d-train: launching {nproc} ranks (torch elastic launcher; each rank a fork of a server that "
              "imported torch, transformers and t3d once)", file=sys.stderr, flush=True)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"t3d-train-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="forkserver")
    try:
        elastic_launch(config, _fork_worker)(argv, ranks_quiet)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        print(f"t3d-train: rank {failure.local_rank} exited with code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except KeyboardInterrupt:
        return 130
    return 0


def _run_single(args) -> int:
    # One rank without torchrun: give init_process_group the env:// variables a launcher would set.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)
    from .loop import run

    return run(args)


def _parse_layout(text: str):
    from .loop import Layout

    dp, tp, cp = (int(x) for x in text.lower().split("x"))
    return Layout(dp, tp, cp)


def _clean_argv(argv: list[str], drop: set[str]) -> list[str]:
    """argv without --nproc and without the options in `drop` (with their values; --resume's is optional)."""
    cleaned, skip = [], False
    for a in _strip_nproc(argv):
        if skip:
            skip = False
            continue
        key = a.split("=", 1)[0]
        if key in drop:
            skip = "=" not in a and key not in ("--resume", "--compare-backends", "--compare-schedules")
            continue
        cleaned.append(a)
    return cleaned


def _run_once(world: int, run_argv: list[str], out: str, forks: bool):
    """One t3d-train run, quiet: forked from this process's server (forks), else under torchrun; (its metrics
    summary, wall seconds) or (None, why it failed)."""
    t0 = time.perf_counter()
    if forks:
        rc = _launch_forks(world, run_argv, quiet=True, ranks_quiet=True)
    else:
        rc = subprocess.call(torchrun_command(world, run_argv), env=_child_env(world), stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if rc != 0:
        return None, f"failed (exit {rc})"
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)["summary"], wall


def _run_rounds(rounds: int, variants: list, prefix: str, device: str) -> dict:
    """Runs every variant (key, world, argv) once per round, the variants taking turns in each round (so that a
    slow minute of the machine does not land on one only); key -> [(summary, wall) or (None, why)]. On CPU the
    runs' ranks are forks of one server, started before the first run, so that every run's wall time counts alike."""
    work = tempfile.mkdtemp(prefix=prefix)
    runs: dict = {}
    forks = _forks_ok(device)
    if forks:
        _start_fork_server(max(world for _, world, _ in variants), wait=True)
    try:
        for r in range(rounds):
            for i, (key, world, run_argv) in enumerate(variants):
                out = os.path.join(work, f"{i}-{r}")
                s, wall = _run_once(world, run_argv + ["--ckpt-dir", out, "--no-save", "--no-plot", "--no-progress"],
                                    out, forks)
                runs.setdefault(key, []).append((s, wall))
                if s is not None:
                    print(f"  {' '.join(map(str, key)) if isinstance(key, tuple) else key} run {r + 1}/{rounds}: "
                          f"{s['step_time_mean_s'] * 1000:.1f} ms/step", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


def compare_backends(args, argv: list[str]) -> int:
    """Run each layout on t3d and on gloo, taking turns (t3d, gloo, t3d, gloo, ... so that a slow minute of the
    machine does not land on one backend only), and print a markdown table of median step times and their ratio;
    with --compare-out, also save it with every run's numbers and a plot."""
    cleaned = _clean_argv(argv, {"--compare-backends", "--dp", "--tp", "--cp", "--backend", "--ckpt-dir",
                                 "--metrics-json", "--compare-layouts", "--resume", "--compare-rounds",
                                 "--compare-out"})
    rounds = max(1, args.compare_rounds)
    layouts = [_parse_layout(text) for text in args.compare_layouts.split(",")]
    runs = _run_rounds(rounds, [((str(layout), backend), layout.world,
                                 cleaned + ["--dp", str(layout.dp), "--tp", str(layout.tp), "--cp", str(layout.cp),
                                            "--backend", backend])
                                for layout in layouts for backend in ("t3d", "gloo")], "t3d-compare-", args.device)
    header = (f"t3d vs gloo: {args.steps} steps, global batch {args.global_batch} x seq {args.seq_len}, "
              f"{os.cpu_count()} cores; {rounds} alternating run(s) of each; median of the runs' mean step time "
              f"(first step left out)")
    lines = [header, "",
             "| layout | ranks | backend | step time (ms) | tokens/s | gloo / t3d | loss first -> last | wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    rows, failed = [], False
    for layout in layouts:
        med = {}
        for backend in ("t3d", "gloo"):
            ok = [s for s, _ in runs.get((str(layout), backend), []) if s is not None]
            if len(ok) == rounds:
                med[backend] = statistics.median(s["step_time_mean_s"] for s in ok)
        for backend in ("t3d", "gloo"):
            got = runs.get((str(layout), backend), [])
            bad = [why for s, why in got if s is None]
            if bad or backend not in med:
                failed = True
                lines.append(f"| {layout} | {layout.world} | {backend} | - | - | - | "
                             f"{bad[0] if bad else 'not run'} | - |")
                continue
            s = [s for s, _ in got][0]
            step = med[backend]
            tokens = args.global_batch * args.seq_len / step
            ratio = med["gloo"] / med["t3d"] if backend == "gloo" and "t3d" in med else None
            wall = statistics.median(w for _, w in got)
            rows.append({"layout": str(layout), "ranks": layout.world, "backend": backend, "step_time_s": step,
                         "tokens_per_s": tokens, "gloo_over_t3d": ratio, "loss_first": s["loss_first"],
                         "loss_last": s["loss_last"], "wall_s": wall,
                         "runs_step_time_s": [s["step_time_mean_s"] for s, _ in got]})
            lines.append(f"| {layout} | {layout.world} | {backend} | {step * 1000:.1f} | {tokens:.0f} | "
                         f"{'' if ratio is None else f'{ratio:.2f}'} | "
                         f"{s['loss_first']:.4f} -> {s['loss_last']:.4f} | {wall:.1f} |")
    print()
    print("\n".join(lines))
    if args.compare_out:
        _save_comparison(args.compare_out, lines, rows, args, "t3d-train " + " ".join(argv))
    return 1 if failed else 0


def _save_comparison(out: str, lines: list[str], rows: list[dict], args, command: str) -> None:
    """compare-backends.md (the table), .json (its rows with every run's step time) and .png (_plot_comparison)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "compare-backends")
    when = time.strftime("%Y-%m-%d %H:%M")
    with open(stem + ".md", "w") as f:
        f.write(f"# t3d-train --compare-backends\n\nCommand: `{command}` ({when}, load average at the end "
                f"{os.getloadavg()[0]:.1f})\n\n" + "\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "when": when, "steps": args.steps, "global_batch": args.global_batch,
                   "seq_len": args.seq_len, "cores": os.cpu_count(), "rounds": max(1, args.compare_rounds),
                   "rows": rows}, f, indent=1)
    png = _plot_comparison(rows, stem + ".png")
    print(f"saved {stem}.md, .json" + (", .png" if png else ""))


def _plot_comparison(rows: list[dict], path: str) -> bool:
    """Step time per layout, the two backends side by side, gloo / t3d above each pair; False without matplotlib
    or rows."""
    from .report import pyplot

    plt = pyplot()
    if plt is None or not rows:
        return False
    by = {(r["layout"], r["backend"]): r for r in rows}
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(layouts), 3.4), dpi=110)
    for k, backend in enumerate(("t3d", "gloo")):
        got = [(i, by[(lay, backend)]) for i, lay in enumerate(layouts) if (lay, backend) in by]
        ax.bar([i + (k - 0.5) * 0.38 for i, _ in got], [r["step_time_s"] * 1000 for _, r in got], width=0.38,
               label=backend)
    for i, lay in enumerate(layouts):
        gloo = by.get((lay, "gloo"))
        if gloo is not None and gloo["gloo_over_t3d"] is not None:
            top = max(r["step_time_s"] for r in rows if r["layout"] == lay) * 1000
            ax.annotate(f"{gloo['gloo_over_t3d']:.2f}x", (i, top), ha="center", va="bottom", fontsize=8)
    ranks = {r["layout"]: r["ranks"] for r in rows}
    ax.set_xticks(range(len(layouts)), [f"{lay}\n({ranks[lay]} ranks)" for lay in layouts])
    ax.set_ylim(0, max(r["step_time_s"] for r in rows) * 1000 * 1.15)
    ax.set_ylabel("ms per step (median)")
    ax.set_title("t3d-train step time; gloo / t3d above each pair", fontsize=9)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def compare_schedules(args, argv: list[str], layout) -> int:
    """Run one pipeline layout with each schedule (taking turns over --compare-rounds rounds) and print a markdown
    table: median step time, and on the last pipeline rank's stages compute, waiting (bubble and transfers) and the
    reductions after the schedule."""
    from .pipeline import SCHEDULES

    if layout.pp < 2:
        print("t3d-train: --compare-schedules needs --pp >= 2", file=sys.stderr)
        return 2
    cleaned = _clean_argv(argv, {"--compare-schedules", "--schedule", "--stages-per-rank", "--ckpt-dir",
                                 "--metrics-json", "--resume", "--compare-rounds"})
    rounds = max(1, args.compare_rounds)
    runs = _run_rounds(rounds, [(name, layout.world, cleaned + ["--schedule", name]) for name in SCHEDULES],
                       "t3d-schedules-", args.device)
    print()
    print(f"pipeline schedules on {layout} ({layout.world} ranks, backend {args.backend}): {args.steps} steps, "
          f"global batch {args.global_batch} x seq {args.seq_len}, {os.cpu_count()} cores; median over {rounds} "
          f"run(s) of the mean step (first step left out); per pipeline rank (of dp/tp/cp coordinate 0): compute "
          f"= its stages' forward+backward, wait = the rest of the schedule (bubble and transfers)")
    print()
    print("| schedule | microbatches | step time (ms) | tokens/s | per pipeline rank: compute / wait (ms) | "
          "loss first -> last |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name in SCHEDULES:
        ok = [s for s, _ in runs.get(name, []) if s is not None]
        if len(ok) != rounds:
            failed = True
            why = next((w for s, w in runs.get(name, []) if s is None), "not run")
            print(f"| {name} | - | - | - | - | {why} |")
            continue
        step = statistics.median(s["step_time_mean_s"] for s in ok)
        pipe = ok[0].get("pipeline") or []
        per_rank = ", ".join(f"{statistics.median(o['pipeline'][i]['compute'] for o in ok) * 1000:.1f} / "
                             f"{statistics.median(o['pipeline'][i]['wait'] for o in ok) * 1000:.1f}"
                             for i in range(len(pipe)))
        print(f"| {name} | {ok[0].get('microbatches', '-')} | {step * 1000:.1f} | "
              f"{args.global_batch * args.seq_len / step:.0f} | {per_rank} | "
              f"{ok[0]['loss_first']:.4f} -> {ok[0]['loss_last']:.4f} |")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from .loop import layout_of

    layout = layout_of(args)
    why = layout.check()
    if why is None and args.pp > 1 and not args.compare_schedules:
        from .pipeline import check_args

        why = check_args(args, layout)
    if why:
        print(f"t3d-train: {why}", file=sys.stderr)
        return 2
    if args.compare_backends:
        return compare_backends(args, argv)
    if args.compare_schedules:
        return compare_schedules(args, argv, layout)
    if args.ckpt_dir is None:
        args.ckpt_dir = os.path.join("t3d-train-ckpt", str(layout))
        argv += ["--ckpt-dir", args.ckpt_dir]
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc is not None or (not under_launcher and layout.world > 1):
        nproc = args.nproc if args.nproc is not None else layout.world
        if nproc != layout.world:
            print(f"t3d-train: --nproc {nproc} but pp*dp*tp*cp = {layout.world} ({layout})", file=sys.stderr)
            return 2
        return launch(nproc, argv, args.device)
    if under_launcher:
        from .loop import run

        return run(args)
    return _run_single(args)
