"""Ring attention: exact context-parallel softmax attention over a process group.

Each rank holds a piece of the sequence. Layout "contiguous": the global sequence is cut into W chunks and rank r
holds chunk r. Layout "zigzag": the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r, concatenated
(the same order as torch context_parallel's load balancing), which evens out causal work across ranks.

Forward: key/value blocks travel around the ring (send to rank+1, receive from rank-1, posted before the current
block is computed); every (query piece, key piece) pair runs torch.ops.t3d.attention with the pieces' global
positions, so causal masking is exact, and the partial results are merged by log-sum-exp (attention_merge_).
Backward: key/value travel the ring again with a float32 dk/dv accumulator that follows its block and returns to
the block's owner after the last step; dq stays local. Both use the final out and lse, so gradients are exact.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import ops as _t3d_ops  # noqa: F401  (loads torch.ops.t3d)

_ops = torch.ops.t3d
LAYOUTS = ("zigzag", "contiguous")

# Tags keep the two streams of a backward step (key/value and dk/dv accumulators) apart on the wire.
_TAG_KV = 7301
_TAG_DKV = 7302


# ---- layouts -----------------------------------------------------------------------------------------------------

def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"t3d ring attention: layout must be one of {LAYOUTS}, got {layout!r}")


def _pieces(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, world_size: int, layout: str = "zigzag") -> list[int]:
    """Indices of the global chunks rank holds, in local order (2W chunks for zigzag, W for contiguous)."""
    _check_layout(layout)
    return [rank, 2 * world_size - 1 - rank] if layout == "zigzag" else [rank]


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag",
                   dim: int = 2) -> torch.Tensor:
    """This rank's part of the full sequence x (cut along dim) in the given layout."""
    n_chunks = _pieces(layout) * world_size
    if x.size(dim) % n_chunks:
        raise ValueError(f"t3d ring attention: sequence length {x.size(dim)} (dim {dim}) must be divisible by "
                         f"{n_chunks} for layout {layout!r} on {world_size} ranks")
    chunks = x.chunk(n_chunks, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world_size, layout)], dim=dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's part (parts[r] from rank r), inverse of shard_sequence."""
    world_size = len(parts)
    p = _pieces(layout)
    chunks: list[Optional[torch.Tensor]] = [None] * (p * world_size)
    for r, part in enumerate(parts):
        for i, piece in zip(chunk_ids(r, world_size, layout), part.chunk(p, dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    return shard_sequence(x, rank, world_size, "zigzag", dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    return unshard_sequence(parts, "zigzag", dim)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """All-gathers every rank's part of a sequence and returns the full sequence in global order."""
    ws = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, layout, dim)


# ---- ring plumbing -----------------------------------------------------------------------------------------------

class _Ring:
    def __init__(self, group):
        self.group = group
        self.ws = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.ws) if group is not None else \
            (self.rank + 1) % self.ws
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.ws) if group is not None else \
            (self.rank - 1) % self.ws

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        """Posts send -> rank+1 and recv <- rank-1; returns the requests."""
        op_list = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
                   dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(op_list)


def _wait(reqs) -> None:
    for r in reqs or ():
        r.wait()


class _Geometry:
    """Global positions of the pieces of each rank's sequence part."""

    def __init__(self, ws: int, layout: str, q_len: int, k_len: int):
        self.ws, self.layout, self.p = ws, layout, _pieces(layout)
        if q_len % self.p or k_len % self.p:
            raise ValueError(f"t3d ring attention: local sequence lengths ({q_len}, {k_len}) must be even for the "
                             f"zigzag layout")
        self.cq, self.ck = q_len // self.p, k_len // self.p

    def q_start(self, rank: int, i: int) -> int:
        return chunk_ids(rank, self.ws, self.layout)[i] * self.cq

    def k_start(self, rank: int, j: int) -> int:
        return chunk_ids(rank, self.ws, self.layout)[j] * self.ck

    def visible(self, causal: bool, qs: int, ks: int) -> tuple[bool, bool]:
        """(any key visible, mask needed) for a query piece at qs and a key piece at ks."""
        if not causal:
            return True, False
        if ks > qs + self.cq - 1:
            return False, False
        return True, ks + self.ck - 1 > qs


def _split(x: torch.Tensor, p: int) -> list[torch.Tensor]:
    return [c.contiguous() for c in x.chunk(p, dim=2)] if p > 1 else [x.contiguous()]


def _pack_kv(k: torch.Tensor, v: torch.Tensor, p: int) -> torch.Tensor:
    """[2, p, B, Hkv, c, D]: each key/value piece contiguous, the pair one buffer for one exchange."""
    return torch.stack([torch.stack(k.chunk(p, dim=2)), torch.stack(v.chunk(p, dim=2))]).contiguous()


def ring_forward(q, k, v, group, causal: bool, layout: str, scale: Optional[float]):
    """(out like q, lse float32 [B, H, S_local]) of attention over the whole ring; no autograd."""
    ring = _Ring(group)
    geo = _Geometry(ring.ws, layout, q.size(2), k.size(2))
    p = geo.p
    qp = _split(q, p)
    outs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qp]
    lses = [torch.full(x.shape[:3], float("-inf"), dtype=torch.float32, device=q.device) for x in qp]
    cur = _pack_kv(k, v, p)
    for step in range(ring.ws):
        reqs, nxt = None, None
        if step < ring.ws - 1:
            nxt = torch.empty_like(cur)
            reqs = ring.exchange(cur, nxt, _TAG_KV)
        src = (ring.rank - step) % ring.ws
        for i in range(p):
            qs = geo.q_start(ring.rank, i)
            for j in range(p):
                ks = geo.k_start(src, j)
                any_visible, masked = geo.visible(causal, qs, ks)
                if not any_visible:
                    continue
                o, lse = _ops.attention(qp[i], cur[0, j], cur[1, j], masked, scale, qs, ks)
                _ops.attention_merge_(outs[i], lses[i], o, lse)
        _wait(reqs)
        if nxt is not None:
            cur = nxt
    out = torch.cat(outs, dim=2).to(q.dtype) if p > 1 else outs[0].to(q.dtype)
    lse = torch.cat(lses, dim=2) if p > 1 else lses[0]
    return out, lse


def ring_backward(dout, q, k, v, out, lse, group, causal: bool, layout: str, scale: Optional[float]):
    """(dq, dk, dv) of ring_forward for dout, given its out and lse; no autograd."""
    ring = _Ring(group)
    geo = _Geometry(ring.ws, layout, q.size(2), k.size(2))
    p = geo.p
    qp, dop, op_, lp = _split(q, p), _split(dout.to(q.dtype), p), _split(out, p), [
        c.contiguous() for c in lse.chunk(p, dim=2)]
    dqs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qp]
    cur = _pack_kv(k, v, p)
    dkv_shape = cur.shape
    dkv_reqs, dkv_in = None, None
    for step in range(ring.ws):
        reqs, nxt = None, None
        if step < ring.ws - 1:
            nxt = torch.empty_like(cur)
            reqs = ring.exchange(cur, nxt, _TAG_KV)
        src = (ring.rank - step) % ring.ws
        part = torch.zeros(dkv_shape, dtype=torch.float32, device=q.device)
        for i in range(p):
            qs = geo.q_start(ring.rank, i)
            for j in range(p):
                ks = geo.k_start(src, j)
                any_visible, masked = geo.visible(causal, qs, ks)
                if not any_visible:
                    continue
                dq, dk, dv = _ops.attention_backward(dop[i], qp[i], cur[0, j], cur[1, j], op_[i], lp[i], masked,
                                                     scale, qs, ks)
                dqs[i] += dq
                part[0, j] += dk
                part[1, j] += dv
        # The accumulator of block src arrives from rank-1, which computed its share one step earlier.
        if dkv_reqs is not None:
            _wait(dkv_reqs)
            part += dkv_in
        dkv_in = torch.empty(dkv_shape, dtype=torch.float32, device=q.device)
        # Steps 0..W-2 pass the accumulator on with its block; the last step returns it to the block's owner.
        dkv_reqs = ring.exchange(part, dkv_in, _TAG_DKV) if ring.ws > 1 else None
        if ring.ws == 1:
            dkv_in = part
        _wait(reqs)
        if nxt is not None:
            cur = nxt
    _wait(dkv_reqs)
    dq = torch.cat(dqs, dim=2) if p > 1 else dqs[0]
    dk = torch.cat(list(dkv_in[0].unbind(0)), dim=2) if p > 1 else dkv_in[0, 0]
    dv = torch.cat(list(dkv_in[1].unbind(0)), dim=2) if p > 1 else dkv_in[1, 0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):
        out, lse = ring_forward(q, k, v, group, causal, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.causal, ctx.layout, ctx.scale)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   layout: str = "zigzag", scale: Optional[float] = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys of every rank in group (default: the world).

    q [B, H, S_local, D], k/v [B, Hkv, S_local, D] (H % Hkv == 0), each rank's part of the global sequence in
    `layout` (see shard_sequence). Returns this rank's part of the output, [B, H, S_local, D]. Equal, forward and
    backward, to full attention on the gathered sequence. Every rank of group must call it with the same shapes.
    """
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("t3d ring attention: q, k and v must be 4-D [batch, heads, seq, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"t3d ring attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    return _RingAttention.apply(q, k, v, group, causal, layout, scale)
