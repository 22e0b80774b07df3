"""Softmax attention that forms its logits once for both its output and their row statistics.

SDPA never hands out its logits, so an observer that wants the statistics of a softmax call
(the monitor) would score q kᵀ a second time beside it: on one core that second product and its
row reduction cost about a quarter of a small Llama's forward (benchmarks/bench_monitor.py).
:func:`softmax_rows_attention` computes the same attention blockwise instead: each block's logits
are formed once, one pass of the compiled row kernel (``attnscale_softmax_rows``) writes both the
block's unnormalised weights exp(z - m) and every row's statistics, and O = E V / Σ E.

Its output equals SDPA's to float32 rounding, not bit for bit (the sums run in another order).
The pipeline runs it only for a call whose observer asked for the row statistics and accepts
that (:attr:`attnscale.pipeline.Observation.rows_exact` is False then); an observer that needs
SDPA's very bits leaves the rows alone and scores q kᵀ itself.

Without a mask the whole block loop runs in C (``attnscale_softmax_rows_attention``): blocks of
:data:`attnscale.kernels.native.NATIVE_BLOCK_ROWS` queries of one head, both products on
PyTorch's sgemm, on PyTorch's own OpenMP threads (:mod:`attnscale.kernels.team`).  With a mask
it runs in Python: a block is a few heads of one batch element by a run of queries against every
key those queries can see (:class:`attnscale.kernels.tiles.Tiles`).  Either way a block holds
whole rows, so a row's maximum and sum are exact within it, and blocks are independent, so they
are spread over the threads one by one (not by head group: at B = 1 and 4 heads a head group
would leave a thread idle).  The forward only: with grad mode on, the call runs on SDPA
(:func:`forms_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.columns import ROW_STATS_COLUMNS
from attnscale.kernels import native
from attnscale.kernels.team import run_blocks, team_map
from attnscale.kernels.tiles import Scratch, Tiles
from attnscale.workers import workers_for

# Logits per block: 2^19 float32 (2 MiB), e.g. 256 queries of one head at Nk = 2048; two such
# blocks (logits and weights) per worker.  At B1 H4 N2048 d64 causal (the monitor benchmark's
# layer) on an AMD EPYC: on 1 thread 2^18 and 2^19 are alike (35 ms, SDPA 33); on 2 threads 2^19
# runs in 23.7 ms against 27.8 for 2^18 and 25.1 for 2^20 (fewer blocks, less of the GIL).
ROWS_BLOCK_ELEMENTS = 2**19


def forms_rows(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`softmax_rows_attention` can run a call: float32 CPU tensors with the
    compiled kernels, q and k of the same batch and heads, grad mode off (it has no backward, and
    a temperature beside q and k may be a parameter), not traced."""
    return (not torch.is_grad_enabled() and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == k.device.type == v.device.type == "cpu"
            and q.dim() == k.dim() == v.dim() == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]
            and type(q) is torch.Tensor and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling() and native.available())


def softmax_rows_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None,
                           causal: bool, rows: Tensor) -> Tensor:
    """softmax(scale · q kᵀ masked) v, filling ``rows`` with every query's row statistics.

    q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v), float32 CPU (:func:`forms_rows`);
    ``mask`` boolean (True = attend) broadcastable to (B, H, Nq, Nk), or None; ``causal``: query
    i sees keys j <= i (top-left).  ``rows``: float64 (B, H, Nq, len(ROW_STATS_COLUMNS)) that
    receives :func:`attnscale.stats.row_stats` of each query's masked logits.  A query without a
    key gets a zero output and count 0.  Returns (B, H, Nq, d_v).
    """
    if rows.shape != (*q.shape[:-1], len(ROW_STATS_COLUMNS)) or rows.dtype != torch.float64:
        raise ValueError(f"rows must be float64 {(*q.shape[:-1], len(ROW_STATS_COLUMNS))}, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    # q, k and v as they come (a model's are often (B, N, H, d) transposed): the block matmuls
    # read strided rows, and a copy costs more than they lose (4 ms of 28 a layer on 2 threads)
    out = _like_queries(q, v.shape[-1])
    if q.shape[-2] == 0:
        return out
    if k.shape[-2] == 0:  # no key anywhere: zero weights, count 0
        rows.zero_()
        return out.zero_()
    if mask is None and native.blas_sgemm() is not None:
        return _native_blocks(q, k, v, scale, causal, rows, out)
    tiles = Tiles(q, k, mask, causal, ROWS_BLOCK_ELEMENTS)
    scratch = Scratch(tiles.block_elements(), torch.float32, 2, q.device)
    n_blocks = -(-q.shape[-2] // tiles.rows)
    items = [(b, heads, i) for b, heads in tiles.groups() for i in range(n_blocks)]

    limits = [tiles.causal_counts(i, tiles.rows) for i in range(n_blocks)]

    def block(item: tuple[int, slice, int]) -> None:
        # Few torch calls per block: the workers share the GIL for everything but the ops.
        b, heads, i = item
        n_k = tiles.n_keys(i)
        q_blk = tiles.rows_of(q, b, heads, i)                        # (h, r, d)
        z = scratch.scores(0, q_blk, k[b, heads, :n_k], scale)       # (h, r, n_k) logits
        tiles.hide_masked(z, b, heads, i)
        e = scratch.block(1, z.shape)
        stats = z.new_empty(*z.shape[:-1], 2)                        # (m, 1 / Σ e) per row
        target = tiles.rows_of(rows, b, heads, i)                    # (h, r, columns)
        found = target if target.is_contiguous() else torch.empty(target.shape,
                                                                  dtype=torch.float64)
        limit = limits[i]
        native.softmax_rows(z, e, stats, found,
                            limit=None if limit is None else limit[:z.shape[1]])
        if found is not target:
            target.copy_(found)
        out_blk = tiles.rows_of(out, b, heads, i)
        torch.bmm(e, v[b, heads, :n_k], out=out_blk).mul_(stats[..., 1:])

    team_map(block, items, workers_for(q.device, len(items)))
    return out


def _like_queries(q: Tensor, width: int) -> Tensor:
    """An empty (B, H, Nq, width) output in q's order of dimensions: a model's q is often a
    (B, Nq, H, d) tensor transposed, and SDPA returns its output the same way, so the model's
    transpose back is free (a contiguous output cost 3 ms of 21 a layer on 2 threads, at B1 H4
    N2048 d64)."""
    order = sorted(range(3), key=lambda i: -q.stride(i))
    shape = [q.shape[i] for i in order] + [width]
    return q.new_empty(shape).permute(*[order.index(i) for i in range(3)], 3)


def _native_blocks(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, rows: Tensor,
                   out: Tensor) -> Tensor:
    """The block loop in C (:func:`attnscale.kernels.native.softmax_rows_attention`), in one call
    on the calling thread's OpenMP team: no block returns to Python, and the threads are those
    PyTorch's own ops run on (a second pool of threads lost about 9 ms a layer on 2 cores to the
    team's spin-wait after the projections).  Blocks are one head by
    :data:`attnscale.kernels.native.NATIVE_BLOCK_ROWS` queries, handed out largest first."""
    q, k, v = (native.block_operand(t) for t in (q, k, v))
    found = rows if rows.stride(-1) == 1 else torch.empty(rows.shape, dtype=torch.float64)
    n_q = q.shape[2]
    run_blocks(lambda blocks, threads: native.softmax_rows_attention(
        q, k, v, out, found, scale, causal, blocks, threads=threads),
        (*q.shape[:3], k.shape[2]), min(native.NATIVE_BLOCK_ROWS, n_q), causal,
        workers_for(q.device, q.shape[0] * q.shape[1] * n_q))
    if found is not rows:
        rows.copy_(found)
    return out
