"""One rank of the 3D-parallel workflow: the eight steps of transformers' examples/3D_parallel.py (process group and
(dp, tp, cp) mesh, TP model load, FSDP, sampler, context parallel step, gradient sync, optimizer and loss all-reduce,
DCP checkpoint), device-agnostic, on backend t3d by default.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import torch_compat
from . import ckpt as ckpt_mod
from . import report
from .data import build_packed_dataset, collate
from .model import ensure_model, load_model


class Layout:
    def __init__(self, dp: int, tp: int, cp: int):
        self.dp, self.tp, self.cp = dp, tp, cp

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp

    def __str__(self) -> str:
        return f"dp{self.dp}xtp{self.tp}xcp{self.cp}"


class StepProfile:
    """torch.profiler over `count` steps from step index `first` on; report() says where their time went.

    Self CPU time of every profiled op, summed by kind: communication (c10d ops, which for synchronous calls
    include the collective itself, and the waits of asynchronous ones: c10d::wait, _c10d_functional wait_tensor;
    with more ranks than cores, mostly waiting for the other ranks to be scheduled), the DTensor and FSDP machinery
    (Python: dispatch of tensor subclasses, redistribution, FSDP's hooks), compute (every other op) and the rest of
    the steps' wall time (the training loop's Python, the data loader, the profiler's own cost). Self times do not
    overlap, so the four add up to the wall time."""

    COMM = ("c10d", "wait_tensor", "record_param_comms", "t3d::", "all_reduce", "all_gather", "reduce_scatter",
            "broadcast", "all_to_all")
    FRAMEWORK = ("PythonSubclass", "FromTorchTensor", "ToTorchTensor", "Redistribute", "FullyShardedDataParallel",
                 "FSDP", "DTensor")

    def __init__(self, count: int, first: int):
        self.first, self.last = first, first + count - 1
        self.prof = None
        self.wall = 0.0
        self.steps = 0

    def before(self, step: int) -> None:
        if step == self.first and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()

    def after(self, step: int, dt: float) -> None:
        if self.prof is not None and self.first <= step <= self.last:
            self.wall += dt
            self.steps += 1
            if step == self.last:
                self.close()

    def close(self) -> None:
        if self.prof is not None and self.steps and not getattr(self, "closed", False):
            self.prof.__exit__(None, None, None)
            self.closed = True

    def report(self) -> list[str]:
        if not self.steps or self.prof is None:
            return ["profile: no step was profiled (--steps too small?)"]
        comm = frame = compute = 0.0
        top = []
        for e in self.prof.key_averages():
            t = e.self_cpu_time_total / 1e6
            if any(k in e.key for k in self.COMM):
                comm += t
            elif any(k in e.key for k in self.FRAMEWORK):
                frame += t
            else:
                compute += t
            top.append((t, e.key))
        rest = max(0.0, self.wall - comm - frame - compute)
        n, w = self.steps, self.wall

        def part(name, t):
            return f"{name} {t / n * 1000:.1f} ms ({t / w:.0%})"

        lines = [f"profile, rank 0, {n} step(s) after the first: {w / n * 1000:.1f} ms per step = "
                 + ", ".join([part("compute", compute), part("communication", comm),
                              part("DTensor/FSDP machinery", frame), part("Python and the rest", rest)]),
                 "  largest self times per step: " + ", ".join(
                     f"{k} {t / n * 1000:.1f} ms" for t, k in sorted(top, reverse=True)[:8])]
        return lines


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if torch.cuda.device_count() == 0:
            raise RuntimeError("--device cuda but no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def all_reduce_grads(model, grad_mesh) -> None:
    """Average gradients over `grad_mesh` (cp when FSDP already averaged over dp, else dp_cp), as upstream does.

    A DTensor gradient lives on the TP mesh, which the dp/cp group does not belong to, so its local shard is
    all-reduced (SUM, then divided) and wrapped back with from_local; plain gradients use ReduceOp.AVG.
    """
    from torch.distributed.tensor import DTensor

    if grad_mesh is None or grad_mesh.size() == 1:
        return
    group = grad_mesh.get_group()
    for param in model.parameters():
        if param.grad is None:
            continue
        if isinstance(param.grad, DTensor):
            local = param.grad.to_local()
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
            local = local / grad_mesh.size()
            param.grad = DTensor.from_local(local, device_mesh=param.grad.device_mesh,
                                            placements=param.grad.placements)
        else:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)


class GradNorm:
    """Global L2 gradient norm and clipping that are right for every layout.

    Each gradient element is weighted 1 when it is a TP shard (its square is summed over the TP group) and 1/tp when
    it is replicated over TP (the same value on every TP rank), so one all-reduce over TP gives the norm of the full
    gradient. FSDP1 flattens parameters into FlatParameters; their elements are weighted by the names recorded
    before wrapping. (Upstream calls FSDP's clip_grad_norm_, whose norm under TP is that of the local shards only:
    its own comment that the reported grad norm still needs fixing.)
    """

    def __init__(self, model, tp_mesh):
        from torch.distributed.tensor import DTensor

        self.tp = tp_mesh.size()
        self.tp_group = tp_mesh.get_group() if self.tp > 1 else None
        self.sharded = {name for name, p in model.named_parameters()
                        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
        self._weights: dict[int, torch.Tensor] = {}

    def _flat_weights(self, flat) -> torch.Tensor:
        w = self._weights.get(id(flat))
        if w is None:
            parts = []
            for fqn, numel, _ in torch_compat.flat_param_layout(flat):
                if fqn is None:  # padding
                    parts.append(torch.zeros(numel, device=flat.device))
                else:
                    full = next((n for n in self.sharded if n == fqn or n.endswith("." + fqn) or
                                 fqn.endswith("." + n)), None)
                    parts.append(torch.full((numel,), 1.0 if full else 1.0 / self.tp, device=flat.device))
            w = torch.cat(parts)
            self._weights[id(flat)] = w
        return w

    def clip_(self, model, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        grads, sq = [], None
        for p in model.parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                g = p.grad.to_local()
                w = 1.0 if any(pl.is_shard() for pl in p.grad.placements) else 1.0 / self.tp
                term = g.detach().float().pow(2).sum() * w
            elif torch_compat.flat_param_layout(p) is not None:  # FSDP1 FlatParameter
                g = p.grad
                w = self._flat_weights(p)
                if w.numel() != g.numel():
                    raise RuntimeError(f"FlatParameter grad has {g.numel()} elements, its layout {w.numel()}")
                term = (g.detach().float().pow(2) * w).sum()
            else:
                g = p.grad
                term = g.detach().float().pow(2).sum() / self.tp
            grads.append(g)
            sq = term if sq is None else sq + term
        if sq is None:
            return 0.0
        if self.tp_group is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.tp_group)
        norm = sq.sqrt().item()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
        return norm


def _quiet_libraries(rank: int) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*torch.distributed.*_flatten.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*FSDP.state_dict_type.*")
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # inside torch's DCP writer
    if rank != 0:
        warnings.filterwarnings("ignore")


def run(args) -> int:
    """Train on this rank (started by torchrun, or in-process for one rank). Returns an exit code."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout = Layout(args.dp, args.tp, args.cp)
    is_main = rank == 0

    def log(msg: str) -> None:
        if is_main:
            report.write(msg)

    if world != layout.world:
        if is_main:
            print(f"t3d-train: world size {world} != dp*tp*cp = {layout.world} ({layout})", file=sys.stderr)
        return 2
    if args.global_batch % layout.dp:
        if is_main:
            print(f"t3d-train: --global-batch {args.global_batch} is not divisible by dp={layout.dp}",
                  file=sys.stderr)
        return 2
    if args.seq_len % layout.cp:
        if is_main:
            print(f"t3d-train: --seq-len {args.seq_len} is not divisible by cp={layout.cp}", file=sys.stderr)
        return 2

    _quiet_libraries(rank)
    torch.manual_seed(args.seed)
    if os.environ.get("OMP_NUM_THREADS") is None and world > (os.cpu_count() or 1):
        torch.set_num_threads(1)

    # Step 1: process group and the (dp, tp, cp) mesh, plus the flattened dp_cp mesh.
    device = pick_device(args.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.backend == "t3d":
        import t3d  # noqa: F401  (registers the backend; the entry point would too)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        return _train(args, layout, device, rank, log)
    finally:
        dist.destroy_process_group()


def _train(args, layout: Layout, device: torch.device, rank: int, log) -> int:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    world = layout.world
    mesh = torch.arange(world).reshape(layout.dp, layout.tp, layout.cp)
    world_mesh = DeviceMesh(device_type=device.type, mesh=mesh, mesh_dim_names=("dp", "tp", "cp"))
    tp_mesh, dp_mesh, cp_mesh = world_mesh["tp"], world_mesh["dp"], world_mesh["cp"]
    dp_cp_mesh = torch_compat.flatten_mesh(world_mesh["dp", "cp"], "dp_cp")
    log(f"t3d-train: {layout} on {world} rank(s), backend {args.backend}, device {device.type}, "
        f"global batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps")

    # Step 2: the model, sharded over the TP mesh.
    path = ensure_model(args.model_seed, args.model_cache)
    t_load = time.perf_counter()
    model = load_model(path, tp_mesh, device, dtype=getattr(torch, args.dtype), log=log)

    # Step 3: data parallelism with FSDP1 NO_SHARD over dp (gradient averaging only, as upstream).
    use_fsdp = dp_mesh.size() > 1
    grad_norm = GradNorm(model, tp_mesh)
    layouts = ckpt_mod.param_layouts(model)
    if use_fsdp:
        # FSDP1 refuses a CPU module ("needs a non-CPU accelerator device") unless device_id says CPU explicitly.
        model = FSDP(model, device_mesh=dp_mesh, sharding_strategy=ShardingStrategy.NO_SHARD,
                     device_id=device if device.type == "cpu" else device.index)
    model.train()
    loss_fn, vocab = model.loss_function, model.config.vocab_size
    log(f"model: tiny Llama from {path} ({sum(p.numel() for p in model.parameters()):,} local parameters), "
        f"loaded in {time.perf_counter() - t_load:.1f}s")

    # Step 4: packed dataset and a DistributedSampler over dp. With shuffle=False it hands dp rank r the rows
    # r, r+dp, r+2dp, ...; so batch b on all dp ranks together is rows [b*G, (b+1)*G) for every dp: each layout
    # sees the same global batch at every step.
    local_batch = args.global_batch // layout.dp
    dataset = build_packed_dataset(args.num_sequences, args.seq_len, args.seed, args.global_batch)
    sampler = DistributedSampler(dataset, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(),
                                 shuffle=False)
    loader = DataLoader(dataset, batch_size=local_batch, sampler=sampler, shuffle=False, collate_fn=collate,
                        pin_memory=device.type == "cuda")
    steps_per_epoch = len(loader)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    # Step 8 (load side): resume model, optimizer and step from a DCP checkpoint, whatever layout wrote it.
    start_step, history = 0, []
    if args.resume:
        src = ckpt_mod.resolve(args.resume, args.ckpt_dir)
        meta = ckpt_mod.load(src, model, optimizer, layouts)
        start_step, history = int(meta["step"]), list(meta.get("history", []))
        log(f"resumed from {src} at step {start_step} (written by {meta.get('layout', '?')})")

    if layout.cp > 1:
        from torch.distributed.tensor.experimental import context_parallel

        torch_compat.set_cp_load_balance(False)  # as upstream: contiguous sequence shards
        if not torch_compat.set_cp_rotate_method(args.cp_rotate) and args.cp_rotate != "allgather":
            log(f"warning: this torch has no set_rotate_method; --cp-rotate {args.cp_rotate} ignored")
        import t3d.cp  # noqa: F401  (CPU SDPA handlers for torch's context_parallel; raises one line if missing)
    sdpa_backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    tokens_per_step = args.global_batch * args.seq_len
    bar = report.progress(args.steps, start_step, enabled=rank == 0 and not args.no_progress)
    records = []
    epoch, batches = None, None
    step = start_step
    prof = StepProfile(args.profile, start_step + 1) if args.profile > 0 else None
    while step < args.steps:
        if prof is not None:
            prof.before(step)
        e, within = divmod(step, steps_per_epoch)
        if e != epoch:
            sampler.set_epoch(e)
            batches = iter(loader)
            for _ in range(within):  # resuming mid-epoch: skip what the checkpointed run already consumed
                next(batches)
            epoch = e
        t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in next(batches).items()}
        optimizer.zero_grad()
        # Step 5: forward/backward, with the batch sharded along the sequence over cp.
        bsz = batch["input_ids"].shape[0]
        batch["position_ids"] = torch.arange(args.seq_len, dtype=torch.long, device=device).unsqueeze(0).expand(
            bsz, -1).contiguous()
        with sdpa_kernel(sdpa_backends):
            cp_ctx = nullcontext() if layout.cp == 1 else context_parallel(
                cp_mesh, buffers=[batch["input_ids"], batch["labels"], batch["position_ids"]],
                buffer_seq_dims=[1, 1, 1])
            with cp_ctx:
                labels = batch.pop("labels")
                outputs = model(**batch)
                if step == start_step:
                    log(f"step {step + 1} on rank 0: input_ids {tuple(batch['input_ids'].shape)} "
                        f"(local batch x seq/cp), logits {tuple(outputs.logits.shape)}")
                loss = loss_fn(logits=outputs.logits, labels=None, shift_labels=labels, vocab_size=vocab)
                loss.backward()
        # Step 6: gradient averaging over cp (FSDP did dp) or dp_cp, then clipping.
        all_reduce_grads(model, cp_mesh if use_fsdp else dp_cp_mesh)
        gnorm = grad_norm.clip_(model, args.max_grad_norm)
        # Step 7: optimizer, and the loss averaged over dp_cp for logging.
        optimizer.step()
        loss_avg = loss.detach().clone()
        if layout.dp > 1 or layout.cp > 1:
            dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG, group=dp_cp_mesh.get_group())
        loss_value = loss_avg.item()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.after(step, dt)
        step += 1
        rec = {"step": step, "loss": loss_value, "grad_norm": gnorm, "step_time": dt,
               "tokens_per_s": tokens_per_step / dt}
        records.append(rec)
        if rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
            report.write(f"step {step:4d}/{args.steps} | loss {loss_value:.4f} | grad norm {gnorm:.4f} | "
                         f"{rec['tokens_per_s']:8.0f} tok/s | {dt * 1000:7.1f} ms")
        if not math.isfinite(loss_value):
            log("loss is not finite: stopping")
            break
        # Step 8: periodic DCP checkpoint.
        if args.ckpt_interval and step % args.ckpt_interval == 0 and step < args.steps:
            meta = _meta(args, layout, step, history, records)
            ckpt_mod.save(args.ckpt_dir, step, model, optimizer, layouts, meta)
    bar.close()
    if prof is not None:
        prof.close()
        if rank == 0:
            for line in prof.report():
                log(line)

    if not args.no_save and records:
        meta = _meta(args, layout, step, history, records)
        where = ckpt_mod.save(args.ckpt_dir, step, model, optimizer, layouts, meta)
        log(f"saved DCP checkpoint (model + optimizer) to {where}")
    if rank == 0:
        summary = report.summarize(records, args, str(layout), world)
        all_losses = history + [r["loss"] for r in records]
        out = {"layout": str(layout), "backend": args.backend, "world": world, "start_step": start_step,
               "records": records, "history": history, "summary": summary, "losses": all_losses}
        metrics_path = args.metrics_json or (os.path.join(args.ckpt_dir, "metrics.json") if args.ckpt_dir else None)
        if metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
            with open(metrics_path, "w") as f:
                json.dump(out, f, indent=1)
        png = None
        if args.ckpt_dir and not args.no_plot:
            png = report.plot(all_losses, start_step, os.path.join(args.ckpt_dir, "loss.png"),
                              f"t3d-train {layout} ({args.backend})")
        report.print_summary(summary, png, metrics_path)
    return 0


def _meta(args, layout: Layout, step: int, history: list, records: list) -> dict:
    return {"step": step, "layout": str(layout), "dp": layout.dp, "tp": layout.tp, "cp": layout.cp,
            "seed": args.seed, "global_batch": args.global_batch, "seq_len": args.seq_len, "lr": args.lr,
            "history": history + [r["loss"] for r in records]}
