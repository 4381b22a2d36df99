"""t3d.nn: context-parallel building blocks over torch.ops.t3d (ring attention and sequence layouts)."""

from .ring import (
    LAYOUTS,
    chunk_ids,
    gather_sequence,
    ring_attention,
    shard_sequence,
    unshard_sequence,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "LAYOUTS",
    "chunk_ids",
    "gather_sequence",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_shard",
    "zigzag_unshard",
]
