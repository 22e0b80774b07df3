"""PyTorch's CPU flash-attention op run on chunks of heads, one chunk per worker thread.

Differential attention (:mod:`attnscale.kernels.differential`) hands the flash op rewritten q
and k (each map's half, zero-padded to v's width).  Written for the whole (B, H, N, d) input,
those copies and the op's own gradients are as large as the input each, and alive together in
the backward.  Cut into chunks of a few heads of one batch element, each copy is written into a
buffer of its worker's (:class:`CallerScratch`, reused from chunk to chunk, still in cache when
the op reads it), and only the chunk's part of the op's outputs exists at a time.

The chunks run side by side on worker threads of one intra-op thread each
(:func:`attnscale.kernels.team.team_map`), not one op call after another on torch's own threads:
the op's OpenMP team splits a call's (batch, head) pairs statically, and on the shared 2-core
machine a call per batch element on 2 threads took 1.3x the time of one call on the whole input,
while 4 chunks of B1 H8 N1024 (head size 68) on 2 single-threaded workers took 0.92x of it
(causal flash forward + backward; medians of 11 interleaved rounds at load 4).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch import Tensor

from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Scratch
from attnscale.workers import workers_for

# The CPU flash-attention op and its backward (None where this torch lacks them).
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(torch.ops.aten,
                         "_scaled_dot_product_flash_attention_for_cpu_backward", None)
# Values of the chunks in flight at once, each worker's copy of q (heads · N · d): 2^18 float32 =
# 1 MiB, shared by the workers: at N = 1024, d = 64, chunks of 2 heads on 2 threads and of 4 on
# one.  On 2 threads chunks of 2^17 values ran as fast as 2^18 (differential attention's forward
# + backward at B4 H8 N1024 d64, load 4) on less memory; on one thread chunks of 2^18 ran 3%
# faster than of 2^17 (load 3.5).
IN_FLIGHT_ELEMENTS = 2**18


def flash_available() -> bool:
    """Whether this torch has the CPU flash op and its backward."""
    return FLASH is not None and FLASH_BACKWARD is not None


def head_chunks(n_b: int, n_h: int, per_head: int,
                workers: int) -> list[tuple[int, slice]]:
    """(b, heads) of every chunk: each batch element's heads cut into near-equal groups of at
    most ``IN_FLIGHT_ELEMENTS // workers // per_head`` heads (at least one), ``per_head`` the
    values of one head of q (N · d), ``workers`` the threads the chunks run on."""
    most = max(1, IN_FLIGHT_ELEMENTS // max(workers, 1) // max(per_head, 1))
    groups = math.ceil(n_h / most)               # as few groups as fit, of near-equal sizes
    size = math.ceil(n_h / groups)
    return [(b, slice(h0, min(h0 + size, n_h))) for b in range(n_b)
            for h0 in range(0, n_h, size)]


def chunks_of(q: Tensor) -> list[tuple[int, slice]]:
    """The chunks of q (B, H, N, d): :func:`head_chunks` of its heads, for as many workers as
    torch has intra-op threads."""
    return head_chunks(q.shape[0], q.shape[1], q.shape[-2] * q.shape[-1],
                       workers_for(q.device, q.shape[0] * q.shape[1]))


def scratch(chunks: list[tuple[int, slice]], q: Tensor, k: Tensor, width: int,
            count: int) -> Scratch:
    """``count`` buffers per worker thread, each the size of the largest chunk's
    (heads, max(Nq, Nk), width) copy of q (B, H, Nq, ·) or k (B, H, Nk, ·)."""
    heads = max(h.stop - h.start for _, h in chunks)
    return CallerScratch(heads * max(q.shape[-2], k.shape[-2]) * width, q.dtype, count,
                         q.device, workers_for(q.device, len(chunks)))


class CallerScratch(Scratch):
    """:class:`attnscale.kernels.tiles.Scratch` whose buffers the calling thread allocates, one
    set per worker, handed out to the workers at their first block.  Memory a worker thread
    allocates comes from its own malloc arena and, freed, serves only that thread again; the
    caller's serves the tensors the caller makes next (a norm of the output, the gradients):
    measured at B4 H8 N1024 d64, 2 threads, peak extra memory of differential attention's
    forward + backward 100 -> 84 MiB (1 thread: 65)."""

    def __init__(self, elements: int, dtype: torch.dtype, count: int,
                 device: torch.device | str, workers: int):
        super().__init__(elements, dtype, count, device)
        self._sets = [[torch.empty(elements, dtype=dtype, device=device) for _ in range(count)]
                      for _ in range(workers)]
        self._lock = threading.Lock()

    def block(self, slot: int, shape: tuple[int, ...]) -> Tensor:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            with self._lock:  # this thread's set; a thread beyond the workers makes its own
                buffers = self._sets.pop() if self._sets else None
            if buffers is None:
                return super().block(slot, shape)
            self._local.buffers = buffers
        return buffers[slot][:math.prod(shape)].view(shape)


def run_chunks(fn: Callable[[int, slice], None], chunks: list[tuple[int, slice]],
               device: torch.device) -> None:
    """``fn(b, heads)`` for every chunk, on as many worker threads as torch has intra-op
    threads (fewer for fewer chunks)."""
    team_map(lambda chunk: fn(*chunk), chunks, workers_for(device, len(chunks)))
