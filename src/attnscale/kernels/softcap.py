"""Soft-cap attention, softmax(c · tanh(scale · q kᵀ / c) masked) v, without the (B, H, Nq, Nk)
logits, forward and backward: a blockwise kernel on the CPU (its elementwise steps on attnscale's
compiled kernels where available), FlexAttention on CUDA (:mod:`attnscale.kernels.flex`).

:func:`attnscale.attention.attention` runs every capped mechanism (softcap) through
:func:`capped_attention`.  The blockwise kernel forms every logit block anyway, so when an observer
of the pipeline asks for the row statistics of a call (the monitor), the kernel computes them from
its own blocks (``rows=``) instead of the observer scoring q kᵀ a second time.  The kernel sits
below the statistics module (:mod:`attnscale.stats` runs the row kernel of this package), so the
caller hands it the reducer (``row_stats=``): the pipeline passes :func:`attnscale.stats.row_stats`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnscale.kernels import flex, native
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Scratch, Tiles
from attnscale.precision import upcast
from attnscale.workers import workers_for

# Logits in one block of the capped kernel: 2^19 float32 = 2 MiB, 512 queries of one head at
# Nk = 1024; the backward pass keeps three blocks alive.  Between 2^17 and 2^19 the speed is flat
# on CPU; the larger end halves the number of torch ops (less dispatch and threading overhead).
CAPPED_BLOCK_ELEMENTS = 2**19
# Queries per chunk when the kernel reduces its logits to row statistics for an observer: under
# causality each chunk scores only the keys it sees, so the diagonal square wastes little.
STATS_ROWS = 128

# Reduces masked logits (..., n) to row statistics (..., columns) like attnscale.stats.row_stats,
# called with ``limit=`` (keys each row sees, or None) and ``threads=``.
RowStats = Callable[..., Tensor]


def capped_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, cap: float,
                     mask: Tensor | None, causal: bool, *, rows: Tensor | None = None,
                     row_stats: RowStats | None = None) -> Tensor:
    """softmax(cap · tanh(scale · q kᵀ / cap) masked) v; q, k float32 (or float64) for half v.

    ``mask`` (broadcastable to (B, H, Nq, Nk), True = attend) must leave every query a key.
    Runs on FlexAttention on CUDA (:mod:`attnscale.kernels.flex`), else on the blockwise kernel
    below; under ``torch.jit.trace``, ``torch.compile`` or ``torch.export`` on the CPU it runs the
    materialised PyTorch formulation, which those can record (the blockwise kernel hands raw
    memory to C and runs blocks on worker threads).

    ``rows``: a float64 (B, H, Nq, columns) tensor that the blockwise kernel fills, in its
    forward, with ``row_stats`` (:func:`attnscale.stats.row_stats`) of each query's masked logits,
    taken from its own logit blocks (one extra elementwise pass and the row kernel per block; the
    output does not change by a bit).  Only where :func:`forms_logits` is true.
    """
    if rows is not None and not forms_logits(q):
        raise ValueError("rows: this call does not run the blockwise kernel (see forms_logits)")
    if rows is not None and row_stats is None:
        raise ValueError("rows needs row_stats, the reducer that fills it")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        # No query, or no key: the output is empty or all zeros (an empty softmax row weighs
        # nothing), and ``rows`` keeps its zeros (count 0).  The materialised formulation gives
        # exactly that, with gradients, on no memory; the blocked kernels need a block to cut.
        return _capped_materialised(q, k, upcast(v), scale, cap, mask, causal).to(v.dtype)
    if flex.usable(q):
        return flex.capped_attention(q, k, v, scale, cap, mask, causal)
    if _tracing(q):
        return _capped_materialised(q, k, upcast(v), scale, cap, mask, causal).to(v.dtype)
    q, k = q.contiguous(), k.contiguous()
    out = _CappedAttention.apply(q, k, upcast(v).contiguous(), mask, scale, cap, causal,
                                 CAPPED_BLOCK_ELEMENTS, rows, row_stats)
    return out.to(v.dtype)


def forms_logits(q: Tensor) -> bool:
    """Whether :func:`capped_attention` on ``q`` runs the blockwise kernel, which forms every
    logit block and so can fill ``rows`` (not FlexAttention on CUDA, not under tracing)."""
    return not flex.usable(q) and not _tracing(q)


def _tracing(q: Tensor) -> bool:
    """Whether a tracer, compiler or exporter records this call instead of running it: then the
    tensors may be fakes without memory, and only torch ops are recorded."""
    return (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.compiler.is_exporting() or type(q) is not torch.Tensor)


def _capped_materialised(q: Tensor, k: Tensor, v: Tensor, scale: float, cap: float,
                         mask: Tensor | None, causal: bool) -> Tensor:
    """The same attention with the (B, H, Nq, Nk) logits materialised, on plain torch ops."""
    z = torch.matmul(q * (scale / cap), k.transpose(-2, -1)).tanh() * cap   # (B, H, Nq, Nk)
    if causal:
        tri = torch.ones(z.shape[-2:], dtype=torch.bool, device=z.device).tril()
        mask = tri if mask is None else mask & tri
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf"))
    return torch.softmax(z, dim=-1) @ v


def _capped(s: Tensor, cap: float) -> Tensor:
    """c · tanh(x) in place on s = -2x, from one expm1: c tanh x = -c e / (e + 2), e = expm1(-2x).

    As accurate as tanh (nothing cancels for small |x|; e^60 is finite in float32 and e / (e + 2)
    is 1 to rounding well before it) and ~2x faster than torch.tanh on the CPU.  NaN stays NaN."""
    e = s.clamp_max_(60.0).expm1_()
    return e.div_(e + 2.0).mul_(-cap)


class _CappedAttention(torch.autograd.Function):
    """softmax(c · tanh(scale · q kᵀ / c) masked) v, blockwise, with recomputation in backward.

    A block is a few heads of one batch element times ``rows`` queries, against all their keys, so
    it holds whole softmax rows: the row max and sum are exact within the block and nothing is
    rescaled online.  Extra memory is two or three (heads, rows, Nk) blocks per worker, O(Nk ·
    rows), instead of the (B, H, Nq, Nk) logits, reused from block to block (a fresh block
    page-faults).  Blocks are sized to stay in cache while each torch op still amortises its
    dispatch, and the per-block views come from one ``split`` per head group.

    With x = (scale / c) q·k, the logit is z = c tanh(x), which keeps float32's relative accuracy
    however large c is (c tanh(x) → c x); d z / d(q·k) = scale · (1 - tanh² x).  A NaN in q, k
    or v reaches every output it feeds, as in the materialised reference.

    On the compiled kernels (float32 on the CPU) the forward keeps each row's largest logit m and
    1 / Σ e^{z - m} (8 bytes a query), forms O = (E V) / Σ from the unnormalised E, and the
    backward recomputes P from them in the same pass that forms dS = P ∘ (dP - δ) ∘ (1 - tanh²),
    with dP = dO Vᵀ computed first: one elementwise pass per block each way, the tanh from an odd
    polynomial for |x| < 0.625 (every logit below 31 at c = 50).  Elsewhere the same steps run on
    PyTorch ops (:func:`_capped`: c tanh from one expm1).

    Given ``rows`` (see :func:`capped_attention`), the forward also reduces each block's masked
    logits to row statistics: the PyTorch path's logits block exists anyway; the compiled path
    forms its logits inside the kernel, so it writes them out once more (c tanh of the block,
    masked), one block's extra memory.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                cap: float, causal: bool, block_elements: int, rows: Tensor | None,
                row_stats: RowStats | None = None) -> Tensor:
        # q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, d_v), contiguous, same float dtype;
        # rows: None, or float64 (B, H, Nq, columns) for row_stats to fill, one row per query.
        fused = _fused_softcap(q)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])  # (B, H, Nq, d_v)
        tiles = Tiles(q, k, mask, causal, block_elements)
        groups = list(tiles.groups())
        workers = workers_for(q.device, len(groups))
        # The row kernel runs inside a worker: one thread each when several workers run.
        threads = 1 if workers > 1 else None
        if fused:
            stats = q.new_empty(*q.shape[:-1], 2)      # (m, 1 / Σ e) per query, (B, H, Nq, 2)
            scratch = Scratch(tiles.block_elements(), q.dtype, 1, q.device)
            factor = scale / cap                       # q·k times this is x

            def group(where: tuple[int, slice]) -> None:
                b, heads = where
                k_g, v_g = k[b, heads], v[b, heads]    # (h, Nk, d), (h, Nk, d_v)
                blocks = zip(*tiles.split(b, heads, q, out, stats))
                for i, (q_blk, out_blk, st_blk) in enumerate(blocks):
                    n_k = tiles.n_keys(i)
                    s = scratch.scores(0, q_blk, k_g[:, :n_k], factor)   # x, (h, r, n_k)
                    if rows is not None:  # the logits, written out for the statistics only
                        _capped_row_stats(tiles, rows, row_stats, s, cap, b, heads, i, threads)
                    # E = exp(c tanh(x) - m) in place, causality as counts, then O = E V / Σ
                    e = native.softcap_exp(tiles.hide_masked(s, b, heads, i), cap, st_blk, out=s,
                                           limit=tiles.causal_counts(i, s.shape[1]))
                    torch.bmm(e, v_g[:, :n_k], out=out_blk).mul_(st_blk[..., 1:])
        else:
            stats = None
            q_x = q * (-2.0 * scale / cap)             # q·k of q_x is -2x, (B, H, Nq, d)

            def group(where: tuple[int, slice]) -> None:
                b, heads = where
                k_g, v_g = k[b, heads], v[b, heads]    # (h, Nk, d), (h, Nk, d_v)
                blocks = zip(*tiles.split(b, heads, q_x, out))
                for i, (q_blk, out_blk) in enumerate(blocks):
                    n_k = tiles.n_keys(i)
                    s = torch.bmm(q_blk, k_g[:, :n_k].transpose(1, 2))  # -2x, (h, r, n_k)
                    z = tiles.hide(_capped(s, cap), b, heads, i)   # masked logits, (h, r, n_k)
                    if rows is not None:
                        tiles.rows_of(rows, b, heads, i).copy_(
                            row_stats(z, limit=tiles.causal_counts(i, s.shape[1]),
                                      threads=threads))
                    torch.bmm(torch.softmax(z, dim=-1), v_g[:, :n_k], out=out_blk)

        # Head groups write disjoint slices of out: several run side by side on the CPU.
        team_map(group, groups, workers)
        ctx.save_for_backward(q, k, v, out, mask, stats)
        ctx.args = (scale, cap, causal, block_elements)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, out, mask, stats = ctx.saved_tensors
        scale, cap, causal, block_elements = ctx.args
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(-1, keepdim=True)  # δ = rowsum(dO ∘ O) = Σ_j p_j dP_j, (B,H,Nq,1)
        dq = torch.empty_like(q)
        # dK and dV are accumulated transposed: dKᵀ += Qᵀ dS reads dS untransposed, a gemm that
        # runs ~1.4x faster on CPU than dK += dSᵀ Q.  Without causality the first row block of
        # a head group covers every key, and its products overwrite instead of adding (beta 0):
        # no zero fill.
        fresh = k.new_zeros if causal else k.new_empty
        dk_t = fresh(*k.shape[:2], k.shape[-1], k.shape[-2])        # (B, H, d, Nk)
        dv_t = fresh(*v.shape[:2], v.shape[-1], v.shape[-2])        # (B, H, d_v, Nk)
        tiles = Tiles(q, k, mask, causal, block_elements)
        scratch = Scratch(tiles.block_elements(), q.dtype, 2, q.device)
        fused = stats is not None   # the compiled kernels, from the forward's (m, 1 / Σ) per row
        factor = scale / cap if fused else -2.0 * scale / cap   # q·k times this is x (or -2x)

        def weights_and_grads(s: Tensor, dz: Tensor, b: int, heads: slice, i: int,
                              st_blk: Tensor | None, delta_blk: Tensor) -> tuple[Tensor, Tensor]:
            """Block i's P and dS = P ∘ (dP - δ) ∘ (1 - tanh² x), in the memory of s and dz."""
            if fused:  # one pass over the block
                return native.softcap_backward(tiles.hide_masked(s, b, heads, i), dz, st_blk,
                                               delta_blk, cap,
                                               limit=tiles.causal_counts(i, s.shape[1]))
            t = _capped(s, 1.0)                                            # tanh x
            p = torch.softmax(tiles.hide(t * cap, b, heads, i), dim=-1)
            dz.sub_(delta_blk).mul_(p)                                     # P ∘ (dP - δ)
            return p, torch.ops.aten.tanh_backward(dz, t)                  # ∘ (1 - t²)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, v_g, dk_g, dv_g = k[b, heads], v[b, heads], dk_t[b, heads], dv_t[b, heads]
            rows = zip(*tiles.split(b, heads, q, d_out, delta, dq, *([stats] if fused else [])))
            for i, (q_blk, do_blk, delta_blk, dq_blk, *st_blk) in enumerate(rows):
                n_k = tiles.n_keys(i)
                s = scratch.scores(0, q_blk, k_g[:, :n_k], factor)   # x (or -2x), (h, r, n_k)
                dz = scratch.scores(1, do_blk, v_g[:, :n_k])         # dP = dO Vᵀ
                p, ds = weights_and_grads(s, dz, b, heads, i, st_blk[0] if fused else None,
                                          delta_blk)
                # d z / d(q·k) = scale · (1 - tanh²): the scale rides on the products
                keep = 0.0 if i == 0 and not causal else 1.0
                dv_g[..., :n_k].baddbmm_(do_blk.transpose(1, 2), p, beta=keep)  # dVᵀ += dOᵀ P
                torch.baddbmm(dq_blk, ds, k_g[:, :n_k], beta=0.0, alpha=scale,
                              out=dq_blk)                                    # dQ = s dS K
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), ds, beta=keep,
                                         alpha=scale)                       # dKᵀ += s Qᵀ dS

        # Head groups write disjoint slices of dq, dK and dV: several run side by side.
        groups = list(tiles.groups())
        team_map(group, groups, workers_for(q.device, len(groups)))
        return (dq, dk_t.transpose(-2, -1), dv_t.transpose(-2, -1),
                None, None, None, None, None, None, None)


def _fused_softcap(q: Tensor) -> bool:
    """Whether the soft-cap kernel's elementwise steps run in attnscale's compiled kernels."""
    return q.dtype == torch.float32 and q.device.type == "cpu" and native.available()


def _capped_row_stats(tiles: Tiles, rows: Tensor, row_stats: RowStats, s: Tensor, cap: float,
                      b: int, heads: slice, i: int, threads: int | None) -> None:
    """Fill block i's rows of ``rows`` with the row statistics of its logits c · tanh(s),
    from ``s`` = x before the mask; ``STATS_ROWS`` queries at a time, each chunk against
    only the keys its queries can see (under causality a block's diagonal square is half
    hidden, so whole blocks would waste a third of the tanh work)."""
    out = tiles.rows_of(rows, b, heads, i)
    i0, n_r, n_k = i * tiles.rows, s.shape[1], s.shape[2]
    for j0 in range(0, n_r, STATS_ROWS):
        j1 = min(j0 + STATS_ROWS, n_r)
        hi = min(n_k, i0 + j1) if tiles.causal else n_k
        z = tiles.hide_masked(torch.tanh(s[:, j0:j1, :hi]).mul_(cap), b, heads, i, j0)
        limit = tiles.causal_counts(i, j1)  # keys of the block's first j1 queries, or None
        out[:, j0:j1].copy_(row_stats(z, limit=None if limit is None else limit[j0:],
                                      threads=threads))
