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
from . import pipeline as pipeline_mod
from . import report
from .data import build_packed_dataset, collate
from .model import ensure_model, load_model


class Layout:
    """pp x dp x tp x cp; dp = dp_rep x dp_shard (dp_shard 1: FSDP1 NO_SHARD, or plain gradient all-reduce under
    pipelining; dp_shard = dp: FSDP2 over dp; in between: HSDP, FSDP2 over a (replicate, shard) mesh)."""

    def __init__(self, dp: int, tp: int, cp: int, pp: int = 1, dp_shard: int = 1):
        self.dp, self.tp, self.cp, self.pp, self.dp_shard = dp, tp, cp, pp, dp_shard

    @property
    def dp_rep(self) -> int:
        return self.dp // self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    def check(self) -> str | None:
        """Why this layout cannot run, or None."""
        if min(self.dp, self.tp, self.cp, self.pp, self.dp_shard) < 1:
            return "--pp, --dp, --tp, --cp and --dp-shard must be >= 1"
        if self.dp % self.dp_shard:
            return f"--dp-shard {self.dp_shard} must divide --dp {self.dp}"
        return None

    def __str__(self) -> str:
        pp = f"pp{self.pp}x" if self.pp > 1 else ""
        shard = f"sh{self.dp_shard}" if self.dp_shard > 1 else ""
        return f"{pp}dp{self.dp}{shard}xtp{self.tp}xcp{self.cp}"


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


def all_reduce_grads(parts, grad_mesh, how: str = "avg") -> None:
    """Reduce gradients over `grad_mesh` (cp when FSDP already reduced over dp, else dp_cp), as upstream does.

    how: "avg" averages (ReduceOp.AVG; a DTensor gradient's local shard, whose mesh the dp/cp group is not part of,
    is summed, divided and wrapped back with from_local); "premul_sum" averages with ReduceOp.PREMUL_SUM(1/n), in
    place; "sum" sums (FSDP2 with a divide factor that already covers this group).
    """
    from torch.distributed.tensor import DTensor

    if grad_mesh is None or grad_mesh.size() == 1:
        return
    group, n = grad_mesh.get_group(), grad_mesh.size()
    for param in (p for part in parts for p in part.parameters()):
        if param.grad is None:
            continue
        if how in ("premul_sum", "sum"):
            g = torch_compat.dtensor_local(param.grad) if isinstance(param.grad, DTensor) else param.grad
            op = torch_compat.premul_sum_op(1.0 / n) if how == "premul_sum" else dist.ReduceOp.SUM
            dist.all_reduce(g, op=op, group=group)
        elif isinstance(param.grad, DTensor):
            local = param.grad.to_local()
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
            local = local / n
            param.grad = DTensor.from_local(local, device_mesh=param.grad.device_mesh,
                                            placements=param.grad.placements)
        else:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=group)


class GradNorm:
    """Global L2 gradient norm and clipping that are right for every layout.

    Each rank sums the squares of its gradient elements, each weighted by 1 / (the number of ranks holding that same
    element), and one all-reduce over all ranks adds them up: every element of the full gradient counts once. The
    ranks of one pipeline stage (dp x tp x cp of them) hold its parameters; a parameter sharded over some mesh
    dimensions (TP shards, FSDP2 shards: a DTensor's placements other than Replicate) has that many distinct
    pieces among them. FSDP1 flattens parameters into FlatParameters; their elements are weighted by the TP sharding of the names
    recorded before wrapping. (Upstream calls FSDP's clip_grad_norm_, whose norm under TP is that of the local
    shards only: its own comment that the reported grad norm still needs fixing.)
    """

    def __init__(self, parts, tp: int, holders: int):
        from torch.distributed.tensor import DTensor

        self.tp, self.holders = tp, holders
        self.device = next((p.device for part in parts for p in part.parameters()), torch.device("cpu"))
        self.sharded = {name for part in parts for name, p in part.named_parameters()
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
                    parts.append(torch.full((numel,), (self.tp if full else 1.0) / self.holders,
                                            device=flat.device))
            w = torch.cat(parts)
            self._weights[id(flat)] = w
        return w

    def clip_(self, parts, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        grads, sq = [], None
        for p in (p for part in parts for p in part.parameters()):
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor):
                g = torch_compat.dtensor_local(p.grad)
                pieces = 1
                for i, pl in enumerate(p.grad.placements):
                    if not pl.is_replicate():  # Shard, and FSDP2's _StridedShard (whose is_shard() is False)
                        pieces *= p.grad.device_mesh.size(i)
                term = g.detach().float().pow(2).sum() * (pieces / self.holders)
            elif torch_compat.flat_param_layout(p) is not None:  # FSDP1 FlatParameter
                g = p.grad
                w = self._flat_weights(p)
                if w.numel() != g.numel():
                    raise RuntimeError(f"FlatParameter grad has {g.numel()} elements, its layout {w.numel()}")
                term = (g.detach().float().pow(2) * w).sum()
            else:
                g = p.grad
                term = g.detach().float().pow(2).sum() / self.holders
            grads.append(g)
            sq = term if sq is None else sq + term
        if sq is None:  # a rank without gradients still joins the all-reduce
            sq = torch.zeros((), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        norm = sq.sqrt().item()
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.detach().mul_(coef)
        return norm


def set_offline_env() -> None:
    """Nothing comes from a hub; transformers and datasets read these when imported."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        os.environ.setdefault(k, "1")


def _quiet_libraries(rank: int) -> None:
    set_offline_env()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*torch.distributed.*_flatten.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*FSDP.state_dict_type.*")
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # inside torch's DCP writer
    if rank != 0:
        warnings.filterwarnings("ignore")


def layout_of(args) -> Layout:
    return Layout(args.dp, args.tp, args.cp, getattr(args, "pp", 1), getattr(args, "dp_shard", 1))


def run(args) -> int:
    """Train on this rank (started by torchrun, or in-process for one rank). Returns an exit code."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout = layout_of(args)
    is_main = rank == 0

    def log(msg: str) -> None:
        if is_main:
            report.write(msg)

    why = layout.check() or (None if world == layout.world else
                             f"world size {world} != pp*dp*tp*cp = {layout.world} ({layout})")
    if why is None and args.pp > 1:
        why = pipeline_mod.check_args(args, layout)
    if why:
        if is_main:
            print(f"t3d-train: {why}", file=sys.stderr)
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


def build_mesh(layout: Layout, device_type: str):
    """The (pp, dp, tp, cp) DeviceMesh; dp is one dimension "dp" (replicated), "dp_shard" (FSDP2) or two,
    "dp_rep" x "dp_shard" (HSDP). A size-1 pp is left out, so the 3D layouts build the mesh they always did.
    Returns the mesh and the names of its dp dimensions."""
    from torch.distributed.device_mesh import DeviceMesh

    if layout.dp_shard > 1 and layout.dp_rep > 1:
        dp_dims = [("dp_rep", layout.dp_rep), ("dp_shard", layout.dp_shard)]
    else:
        dp_dims = [("dp_shard" if layout.dp_shard > 1 else "dp", layout.dp)]
    dims = ([("pp", layout.pp)] if layout.pp > 1 else []) + dp_dims + [("tp", layout.tp), ("cp", layout.cp)]
    names, sizes = tuple(n for n, _ in dims), tuple(k for _, k in dims)
    mesh = DeviceMesh(device_type=device_type, mesh=torch.arange(layout.world).reshape(*sizes),
                      mesh_dim_names=names)
    return mesh, tuple(n for n, _ in dp_dims)


def apply_fsdp2(parts, layers_of, dp_mesh, reshard: bool, divide_factor: float | None) -> None:
    """FSDP2 (fully_shard; HSDP on a 2-D mesh) on each decoder layer and then each model part as the root."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for part in parts:
        for layer in layers_of(part):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard)
        if divide_factor is not None:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(divide_factor)


def _train(args, layout: Layout, device: torch.device, rank: int, log) -> int:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    world = layout.world
    world_mesh, dp_dims = build_mesh(layout, device.type)
    tp_mesh, cp_mesh = world_mesh["tp"], world_mesh["cp"]
    dp_mesh = world_mesh[dp_dims if len(dp_dims) > 1 else dp_dims[0]]
    dp_rank = (world_mesh["dp_rep"].get_local_rank() * layout.dp_shard + world_mesh["dp_shard"].get_local_rank()
               if len(dp_dims) > 1 else dp_mesh.get_local_rank())
    dp_cp_mesh = torch_compat.flatten_mesh(world_mesh[(*dp_dims, "cp")], "dp_cp")
    fsdp2 = layout.dp_shard > 1
    log(f"t3d-train: {layout} on {world} rank(s), backend {args.backend}, device {device.type}, "
        f"global batch {args.global_batch} x seq {args.seq_len}, {args.steps} steps"
        + (f", gradients {args.grad_reduce}" if args.grad_reduce != "avg" else ""))

    # Step 2: the model, sharded over the TP mesh (and cut into pipeline stages).
    path = ensure_model(args.model_seed, args.model_cache, args.layers)
    t_load = time.perf_counter()
    model = load_model(path, tp_mesh, device, dtype=getattr(torch, args.dtype), log=log)
    loss_fn, vocab = model.loss_function, model.config.vocab_size

    def causal_loss(logits, labels):  # labels already shifted (the packed data's window[1:])
        return loss_fn(logits=logits, labels=None, shift_labels=labels, vocab_size=vocab)

    local_batch = args.global_batch // layout.dp
    pipe = None
    if layout.pp > 1:
        pp_mesh = world_mesh["pp"]
        pipe = pipeline_mod.Pipeline(model, pp_mesh.get_group(), pp_mesh.get_local_rank(), layout.pp,
                                     args.stages_per_rank, args.schedule, args.microbatches, local_batch,
                                     args.seq_len // layout.cp, causal_loss, device, getattr(torch, args.dtype), log)
        parts = pipe.parts()
        del model
    else:
        parts = [model]
    grad_norm = GradNorm(parts, layout.tp, layout.dp * layout.tp * layout.cp)
    layouts = ckpt_mod.param_layouts(parts)

    # Step 3: data parallelism. FSDP2 (ZeRO-3) or HSDP when asked (--dp-shard); else, as upstream, FSDP1 NO_SHARD
    # over dp (gradient averaging only), or under pipelining a plain gradient all-reduce after the schedule.
    use_fsdp1 = not fsdp2 and layout.pp == 1 and dp_mesh.size() > 1
    premul = args.grad_reduce == "premul_sum"
    if fsdp2:
        # A divide factor over dp x cp: FSDP2 reduce-scatters with PREMUL_SUM(1/factor) (torch picks AVG when the
        # factor equals its group's size) and the cp all-reduce below only sums.
        apply_fsdp2(parts, lambda part: (part.model.layers.values() if pipe else part.model.layers), dp_mesh,
                    reshard=pipe is None, divide_factor=float(layout.dp * layout.cp) if premul else None)
    elif use_fsdp1:
        # FSDP1 refuses a CPU module ("needs a non-CPU accelerator device") unless device_id says CPU explicitly.
        parts = [FSDP(parts[0], device_mesh=dp_mesh, sharding_strategy=ShardingStrategy.NO_SHARD,
                      device_id=device if device.type == "cpu" else device.index)]
    if pipe is not None:
        pipe.build(parts)
    for part in parts:
        part.train()
    log(f"model: tiny Llama from {path} ({sum(p.numel() for part in parts for p in part.parameters()):,} local "
        f"parameters), loaded in {time.perf_counter() - t_load:.1f}s")
    if use_fsdp1 or fsdp2:
        grad_mesh, grad_how = cp_mesh, ("sum" if fsdp2 and premul else args.grad_reduce)
    else:
        grad_mesh, grad_how = dp_cp_mesh, args.grad_reduce

    # Step 4: packed dataset and a DistributedSampler over dp. With shuffle=False it hands dp rank r the rows
    # r, r+dp, r+2dp, ...; so batch b on all dp ranks together is rows [b*G, (b+1)*G) for every dp: each layout
    # sees the same global batch at every step (and every stage of a pipeline the same rows).
    dataset = build_packed_dataset(args.num_sequences, args.seq_len, args.seed, args.global_batch)
    sampler = DistributedSampler(dataset, num_replicas=layout.dp, rank=dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=local_batch, sampler=sampler, shuffle=False, collate_fn=collate,
                        pin_memory=device.type == "cuda")
    steps_per_epoch = len(loader)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=args.lr, weight_decay=0.1)
    ckpt_model = parts if pipe is not None else parts[0]

    # Step 8 (load side): resume model, optimizer and step from a DCP checkpoint, whatever layout wrote it.
    start_step, history = 0, []
    if args.resume:
        src = ckpt_mod.resolve(args.resume, args.ckpt_dir)
        meta = ckpt_mod.load(src, ckpt_model, optimizer, layouts)
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
        timing = {}
        with sdpa_kernel(sdpa_backends):
            cp_ctx = nullcontext() if layout.cp == 1 else context_parallel(
                cp_mesh, buffers=[batch["input_ids"], batch["labels"], batch["position_ids"]],
                buffer_seq_dims=[1, 1, 1])
            with cp_ctx:
                labels = batch.pop("labels")
                if pipe is None:
                    outputs = parts[0](**batch)
                    if step == start_step:
                        log(f"step {step + 1} on rank 0: input_ids {tuple(batch['input_ids'].shape)} "
                            f"(local batch x seq/cp), logits {tuple(outputs.logits.shape)}")
                    loss = causal_loss(outputs.logits, labels)
                    loss.backward()
                else:
                    pipe.timer.reset()
                    t_sched = time.perf_counter()
                    loss = pipe.step(batch["input_ids"], labels, batch["position_ids"][:1])
                    timing["schedule"] = time.perf_counter() - t_sched
                    timing["compute"], timing["fwd"], timing["bwd"] = (pipe.timer.compute, pipe.timer.fwd,
                                                                       pipe.timer.bwd)
        # Step 6: gradient reduction over cp (FSDP did dp) or dp_cp, then clipping.
        t_reduce = time.perf_counter()
        all_reduce_grads(parts, grad_mesh, grad_how)
        t_optim = time.perf_counter()
        gnorm = grad_norm.clip_(parts, args.max_grad_norm)
        # Step 7: optimizer, and the loss averaged over dp_cp for logging (from the last stage of a pipeline).
        optimizer.step()
        t_loss = time.perf_counter()
        if pipe is not None:
            loss = torch.zeros((), device=device) if loss is None else loss.to(device)
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=world_mesh["pp"].get_group())
        loss_avg = loss.detach().clone()
        if layout.dp > 1 or layout.cp > 1:
            dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG, group=dp_cp_mesh.get_group())
        loss_value = loss_avg.item()
        dt = time.perf_counter() - t0
        if pipe is not None:  # the gradient and loss reductions; clipping (one scalar all-reduce) and AdamW
            timing["reduce"] = (t_optim - t_reduce) + (time.perf_counter() - t_loss)
            timing["optim"] = t_loss - t_optim
        if prof is not None:
            prof.after(step, dt)
        step += 1
        rec = {"step": step, "loss": loss_value, "grad_norm": gnorm, "step_time": dt,
               "tokens_per_s": tokens_per_step / dt}
        if timing:
            rec["pipeline"] = timing
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
            ckpt_mod.save(args.ckpt_dir, step, ckpt_model, optimizer, layouts, meta)
    bar.close()
    if prof is not None:
        prof.close()
        if rank == 0:
            for line in prof.report():
                log(line)
    stages = None
    if pipe is not None:
        stages = pipeline_mod.gather_stage_times(records, pipe)

    if not args.no_save and records:
        meta = _meta(args, layout, step, history, records)
        where = ckpt_mod.save(args.ckpt_dir, step, ckpt_model, optimizer, layouts, meta)
        log(f"saved DCP checkpoint (model + optimizer) to {where}")
    if rank == 0:
        summary = report.summarize(records, args, str(layout), world)
        if stages is not None:
            summary.update(pipeline=stages, schedule=args.schedule, microbatches=args.microbatches)
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
    return {"step": step, "layout": str(layout), "pp": layout.pp, "dp": layout.dp, "dp_shard": layout.dp_shard,
            "tp": layout.tp, "cp": layout.cp, "layers": args.layers, "seed": args.seed,
            "global_batch": args.global_batch, "seq_len": args.seq_len, "lr": args.lr,
            "history": history + [r["loss"] for r in records]}
