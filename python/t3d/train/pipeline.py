"""Pipeline parallelism for t3d-train: the tiny Llama cut into stages, run by torch.distributed.pipelining.

Where the cuts go (as torchtitan's default): the model is a row of units, the embeddings, each decoder layer, then
the final norm with the head, each unit weighing one; the row is cut into pp x stages-per-rank contiguous stages of
as equal weight as possible, the heavier stages first. So the embeddings are always on the first stage and the head
on the last, and 2 decoder layers make 4 units: up to 4 stages (pp4, or pp2 interleaved with 2 stages per rank).

Each stage is a `StageModule` whose attribute paths are the full model's (`model.embed_tokens`, `model.layers.<i>`,
`model.norm`, `lm_head`), holding the very modules of the loaded (and tensor-parallel) model: parameter names stay
global, so a DCP checkpoint written under one pipeline layout loads under any other.

Rank r of the pipeline holds stages r, r + pp, r + 2 pp, ... (the looped placement of the interleaved schedules).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .._compat import hf_compat, torch_compat

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def split_units(num_layers: int, num_stages: int) -> list[dict]:
    """Stage i -> {"first", "layers", "last"}: whether it holds the embeddings, which decoder layers, the head."""
    units = ["embed"] + list(range(num_layers)) + ["head"]
    if num_stages < 1 or num_stages > len(units):
        raise ValueError(f"{num_stages} pipeline stages but the model has only {len(units)} units (embeddings, "
                         f"{num_layers} decoder layers, head): use fewer stages or more --layers")
    base, extra = divmod(len(units), num_stages)
    stages, at = [], 0
    for i in range(num_stages):
        n = base + (1 if i < extra else 0)
        part = units[at:at + n]
        at += n
        stages.append({"first": "embed" in part, "layers": [u for u in part if isinstance(u, int)],
                       "last": "head" in part})
    return stages


def describe(stages: list[dict]) -> str:
    out = []
    for i, s in enumerate(stages):
        parts = (["embed"] if s["first"] else []) + [f"layer {l}" for l in s["layers"]] + (
            ["norm+head"] if s["last"] else [])
        out.append(f"stage {i}: " + ", ".join(parts))
    return "; ".join(out)


class StageModule(nn.Module):
    """One pipeline stage: a slice of a causal LM under the full model's attribute paths.

    Input: token ids (first stage) or hidden states; output: hidden states, or logits (last stage). Positions come
    from `position_ids` (1 x local sequence), which the training loop sets before each step (context parallelism
    shards it with the batch). With no attention mask the attention is causal (SDPA's is_causal), as in the whole
    model's forward over unpadded sequences.
    """

    def __init__(self, lm: nn.Module, spec: dict):
        super().__init__()
        inner = nn.Module()
        if spec["first"]:
            inner.embed_tokens = lm.model.embed_tokens
        inner.layers = nn.ModuleDict({str(i): lm.model.layers[i] for i in spec["layers"]})
        if spec["last"]:
            inner.norm = lm.model.norm
        self.model = inner
        if spec["last"]:
            self.lm_head = lm.lm_head
        # Not a submodule: it has no parameters and every stage of a rank shares it.
        self.__dict__["_rotary"] = lm.model.rotary_emb
        self.first, self.last = spec["first"], spec["last"]
        self.position_ids = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        pos = self.position_ids
        if pos is None or pos.shape[-1] != h.shape[1]:
            raise RuntimeError(f"stage: position_ids {None if pos is None else tuple(pos.shape)} do not match "
                               f"the sequence of length {h.shape[1]}")
        pe = self._rotary(h, pos)
        for layer in self.model.layers.values():
            h = hf_compat.run_decoder_layer(layer, h, pos, pe)
        if self.last:
            h = self.lm_head(self.model.norm(h))
        return h


class StageTimer:
    """Where a pipeline step's time goes on this rank: compute (the stage's forward and backward chunks, including
    the tensor- and context-parallel collectives inside them) against the schedule's whole step; the difference is
    time spent waiting for the neighbouring stages (the bubble, and the point-to-point transfers, which the waits
    also cover). On a GPU each timed call ends with a device synchronisation, so that its kernels count where
    they run (the schedule waits for each microbatch's transfers anyway)."""

    def __init__(self, sync=None):
        self.fwd = self.bwd = 0.0
        self.sync = sync

    @property
    def compute(self) -> float:
        return self.fwd + self.bwd

    def reset(self) -> None:
        self.fwd = self.bwd = 0.0

    def wrap(self, stage) -> None:
        def timed(fn, kind):
            def call(*a, **k):
                if self.sync is not None:
                    self.sync()
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if self.sync is not None:
                        self.sync()
                    setattr(self, kind, getattr(self, kind) + time.perf_counter() - t0)
            return call

        torch_compat.wrap_pipeline_stage(stage, timed(stage.forward_one_chunk, "fwd"),
                                         timed(stage.backward_one_chunk, "bwd"))


class Pipeline:
    """The stages this rank runs, their schedule, and the step that feeds it."""

    def __init__(self, lm: nn.Module, pp_group, pp_rank: int, pp: int, stages_per_rank: int, schedule: str,
                 microbatches: int, local_batch: int, seq_local: int, loss_fn, device: torch.device,
                 dtype: torch.dtype, log=print):
        n_stages = pp * stages_per_rank  # check_args() has vetted the combination
        self.specs = split_units(lm.config.num_hidden_layers, n_stages)
        self.stage_ids = [pp_rank + k * pp for k in range(stages_per_rank)]
        self.modules = [StageModule(lm, self.specs[i]) for i in self.stage_ids]
        self.has_last = any(self.specs[i]["last"] for i in self.stage_ids)
        self.pp_group, self.pp_size = pp_group, pp
        self.schedule_name, self.microbatches = schedule, microbatches
        self._lm_config = lm.config
        self._args = (n_stages, local_batch // microbatches, seq_local, device, dtype)
        self._loss_fn = loss_fn
        self.timer = StageTimer(torch.cuda.synchronize if device.type == "cuda" else None)
        self.stages = None
        self.schedule = None
        log(f"pipeline: {schedule}, {n_stages} stages over pp {pp}, {microbatches} microbatches of "
            f"{local_batch // microbatches} sequence(s); {describe(self.specs)}")

    def parts(self) -> list[nn.Module]:
        return self.modules

    def build(self, wrapped: list[nn.Module] | None = None) -> None:
        """Create the PipelineStages and the schedule over the (possibly FSDP-wrapped) stage modules."""
        from torch.distributed import pipelining

        mods = wrapped or self.modules
        n_stages, mb, seq, device, dtype = self._args
        hidden, vocab = self._lm_config.hidden_size, self._lm_config.vocab_size
        self.stages = []
        for sid, mod in zip(self.stage_ids, mods):
            spec = self.specs[sid]
            # Example tensors skip the stages' shape inference; requires_grad as in training (torch >= 2.15's static
            # metadata takes it from them).
            x = (torch.zeros(mb, seq, dtype=torch.long, device=device) if spec["first"] else
                 torch.zeros(mb, seq, hidden, dtype=dtype, device=device, requires_grad=True))
            y = torch.zeros(mb, seq, vocab if spec["last"] else hidden, dtype=dtype, device=device,
                            requires_grad=True)
            stage = pipelining.PipelineStage(mod, sid, n_stages, device, input_args=(x,), output_args=(y,),
                                             group=self.pp_group)
            self.timer.wrap(stage)
            self.stages.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        target = self.stages if self.schedule_name == "interleaved-1f1b" else self.stages[0]
        self.schedule = cls(target, n_microbatches=self.microbatches, loss_fn=self._loss_fn)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
        """One forward/backward of the whole local batch; returns the mean of the microbatch losses on the rank
        that holds the last stage, None elsewhere."""
        for m in self.modules:
            m.position_ids = position_ids
        holds_first = any(self.specs[i]["first"] for i in self.stage_ids)
        losses: list = []
        args = (input_ids,) if holds_first else ()
        if self.has_last:
            self.schedule.step(*args, target=labels, losses=losses)
        else:
            self.schedule.step(*args)
        if not self.has_last:
            return None
        if len(losses) != self.microbatches:
            raise RuntimeError(f"pipeline returned {len(losses)} microbatch losses, expected {self.microbatches}")
        return torch.stack([l.detach().float() for l in losses]).mean()


def default_microbatches(local_batch: int, pp: int) -> int:
    """The largest divisor of the per-replica batch up to 2 x pp (enough to fill the pipeline twice over)."""
    return max(d for d in range(1, min(local_batch, 2 * pp) + 1) if local_batch % d == 0)


def check_args(args, layout) -> str | None:
    """Fill in the pipeline defaults on `args` and say why they cannot run (None when they can)."""
    from .model import tiny_config

    if args.schedule not in SCHEDULES:
        return f"--schedule {args.schedule!r}: choose one of {', '.join(SCHEDULES)}"
    interleaved = args.schedule == "interleaved-1f1b"
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if interleaved else 1
    if interleaved and args.stages_per_rank < 2:
        return "--schedule interleaved-1f1b needs --stages-per-rank >= 2"
    if not interleaved and args.stages_per_rank != 1:
        return f"--stages-per-rank {args.stages_per_rank} needs --schedule interleaved-1f1b"
    if args.global_batch % layout.dp:
        return f"--global-batch {args.global_batch} is not divisible by dp={layout.dp}"
    local_batch = args.global_batch // layout.dp
    if args.microbatches is None:
        args.microbatches = default_microbatches(local_batch, layout.pp)
    m = args.microbatches
    if m < 1 or local_batch % m:
        return f"--microbatches {m} must divide the per-replica batch {local_batch} (--global-batch / dp)"
    if args.schedule == "1f1b" and m < layout.pp:
        return f"--schedule 1f1b needs --microbatches >= pp ({m} < {layout.pp})"
    if interleaved:
        rounds = max(1, m // layout.pp)
        if m % rounds:
            return (f"--schedule interleaved-1f1b needs --microbatches a multiple of its rounds (max(1, "
                    f"microbatches // pp) = {rounds}); {m} is not")
    layers = tiny_config(args.layers)["num_hidden_layers"]
    try:
        split_units(layers, layout.pp * args.stages_per_rank)
    except ValueError as e:
        return str(e)
    return None


def gather_stage_times(records: list[dict], pipe: Pipeline) -> list[dict] | None:
    """Every pipeline rank's mean step timing (steps after the first) on the ranks of dp/tp/cp coordinate 0, for
    rank 0's summary: per pipeline rank, its stages, the step, the schedule, compute (forward, backward), waiting
    for the other stages (the schedule minus compute: the bubble and the transfers), the gradient and loss
    reductions after it, and clipping with the optimizer step."""
    import torch.distributed as dist

    steady = [r["pipeline"] | {"step": r["step_time"]} for r in records[1:] or records]
    mine = None
    if steady:
        keys = ("step", "schedule", "compute", "fwd", "bwd", "reduce", "optim")
        mine = {k: sum(t[k] for t in steady) / len(steady) for k in keys}
        mine["wait"] = max(0.0, mine["schedule"] - mine["compute"])
        mine["stages"] = pipe.stage_ids
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # The pipeline ranks that share rank 0's dp/tp/cp coordinates: rank 0 plus k * (world / pp).
    stride = dist.get_world_size() // pipe.pp_size
    out = []
    for k in range(pipe.pp_size):
        t = everyone[k * stride]
        if t is not None:
            out.append(dict(t, pp_rank=k))
    return out or None
