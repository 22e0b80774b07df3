"""PyTorch's CPU flash-attention op run on chunks of heads, one chunk per worker thread.

Forgetting attention (:mod:`attnscale.kernels.forgetting`) and differential attention
(:mod:`attnscale.kernels.differential`) hand the flash op rewritten q, k and v (extra channels,
zero-padded halves).  Written for the whole (B, H, N, ·) input, those copies and the op's own
gradients of them are as large as the input each, and alive together in the backward.  Cut into
chunks of a few heads of one batch element, each copy is written into a buffer of its worker's
(:class:`attnscale.kernels.tiles.Scratch`, reused from chunk to chunk, still in cache when the op
reads it), and only the chunk's part of the op's outputs exists at a time.

The chunks run side by side on worker threads of one intra-op thread each
(:func:`attnscale.workers.parallel_map`), not one op call after another on torch's own threads:
the op's OpenMP team splits a call's (batch, head) pairs statically, and on the shared 2-core
machine a call per batch element on 2 threads took 1.3x the time of one call on the whole input,
while 4 chunks of B1 H8 N1024 d68 on 2 single-threaded workers took 0.92x of it (causal flash
forward + backward; medians of 11 interleaved rounds at load 4).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnscale.workers import parallel_map, workers_for

# The CPU flash-attention op and its backward (None where this torch lacks them).
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten,
                         "_scaled_dot_product_flash_attention_for_cpu_backward", None)
# Values in one chunk's copy of q (heads · N · width): 2^18 float32 = 1 MiB, 4 heads at N = 1024,
# d = 64, so that a worker's few copies and the op's blocks stay in its share of the cache.
CHUNK_ELEMENTS = 2**18


def flash_available() -> bool:
    """Whether this torch has the CPU flash op and its backward."""
    return FLASH is not None and FLASH_BACKWARD is not None


def head_chunks(n_b: int, n_h: int, per_head: int) -> list[tuple[int, slice]]:
    """(b, heads) of every chunk: each batch element's heads cut into near-equal groups of at
    most ``CHUNK_ELEMENTS // per_head`` heads (at least one), ``per_head`` the values of one
    head of q (N · d)."""
    most = max(1, CHUNK_ELEMENTS // max(per_head, 1))
    groups = math.ceil(n_h / most)               # as few groups as fit, of near-equal sizes
    size = math.ceil(n_h / groups)
    return [(b, slice(h0, min(h0 + size, n_h))) for b in range(n_b)
            for h0 in range(0, n_h, size)]


def run_chunks(fn: Callable[[int, slice], None], chunks: list[tuple[int, slice]],
               device: torch.device) -> None:
    """``fn(b, heads)`` for every chunk, on as many worker threads as torch has intra-op
    threads (fewer for fewer chunks)."""
    parallel_map(lambda chunk: fn(*chunk), chunks, workers_for(device, len(chunks)))
