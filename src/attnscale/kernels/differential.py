"""Differential attention's two softmax maps on one SDPA call (Ye et al. 2024, arXiv 2410.05258):
(softmax(scale · q1 k1ᵀ) − λ softmax(scale · q2 k2ᵀ)) v, without the (B, H, Nq, Nk) logits.

The two maps of H heads are 2H heads of one call: q = [q1 | q2] and k = [k1 | k2] are split
along the head dimension and stacked along the heads, v is shared (repeated), and the output's
two halves are combined as o1 − λ o2.  The CPU flash kernel needs one head size for q, k and v,
so the halves of q and k (d/2) are padded with zeros to v's size (which doubles their share of
the matmuls; without it SDPA falls back to its materialising math backend).  fp16 and bf16 run
SDPA in their own type, which accumulates in float32, and combine the maps in float32.

On the CPU without a mask (float32 and float64, q's and v's head sizes equal) the flash op runs
under an autograd node of its own (:class:`_TwoMapsFlashCPU`), one call per map on v itself (no
copy of v), on chunks of a few heads side by side on worker threads
(:mod:`attnscale.kernels.chunked`): each map's padded q and k are written into the worker's
reused buffers, and the node keeps the output, the second map's output and both log-sum-exps.
At B4 H8 N1024 d64 (causal, 2 threads, load 4) that took forward + backward from 2.46x to 2.1x
SDPA's time and the peak extra memory from 170 to about 100 MiB (SDPA's: 43 MiB); with the
output's RMSNorm on the compiled kernels (the mechanism's gain) it measured 71-75 MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels import chunked
from attnscale.kernels.biased import nan_query_rows
from attnscale.kernels.tiles import Scratch
from attnscale.precision import all_finite, upcast


def split_maps(x: Tensor) -> tuple[Tensor, Tensor]:
    """[x1 | x2] (..., d) -> x1, x2 (..., d/2): the two maps' halves of q or k."""
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def differential_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, lam: Tensor,
                           mask: Tensor | None, causal: bool) -> Tensor:
    """(softmax(scale q1 k1ᵀ) − λ softmax(scale q2 k2ᵀ)) v masked: (B, H, Nq, d_v) in v's dtype.

    q, k (B, H, N·, d) float32 or float64 (d even: [first map | second map]); ``lam`` a 0-d
    tensor (or broadcastable to (B, H, 1, 1)); ``mask`` bool broadcastable to (B, H, Nq, Nk)
    leaving every query a key; ``causal`` top-left.
    """
    h = q.shape[1]
    if (mask is None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and q.shape[-2] > 0 and k.shape[-2] > 0  # the flash op fails on an empty sequence
            and q.dtype == v.dtype and q.dtype in (torch.float32, torch.float64)
            and chunked.flash_available()
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling()
            and type(q) is torch.Tensor):
        finite: list[bool] = []  # each chunk's q finite, found where the chunk reads it
        o = _TwoMapsFlashCPU.apply(q.contiguous(), k.contiguous(), v.contiguous(), lam.to(q.dtype),
                                   float(scale), causal, finite)
        return nan_query_rows(o, q, all(finite))
    q1, q2 = split_maps(q)
    k1, k2 = split_maps(k)
    qs = torch.cat([q1, q2], dim=1)                                        # (B, 2H, Nq, d/2)
    ks = torch.cat([k1, k2], dim=1)                                        # (B, 2H, Nk, d/2)
    vs = torch.cat([v, v], dim=1)                                          # (B, 2H, Nk, d_v)
    d_v = v.shape[-1]
    if q.device.type == "cpu" and qs.shape[-1] != d_v:  # zeros change no dot product
        width = max(qs.shape[-1], d_v)
        qs, ks = F.pad(qs, (0, width - qs.shape[-1])), F.pad(ks, (0, width - ks.shape[-1]))
        vs = F.pad(vs, (0, width - d_v))
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.shape[1] > 1:  # one per head: the same for both maps of a head
            mask = torch.cat([mask, mask], dim=1)
    o = F.scaled_dot_product_attention(qs.to(v.dtype), ks.to(v.dtype), vs, attn_mask=mask,
                                       is_causal=causal, scale=scale)
    o = upcast(o[..., :d_v])
    return nan_query_rows(o[:, :h] - lam.to(o.dtype) * o[:, h:], q).to(v.dtype)


def _half_into(scratch: Scratch, slot: int, x: Tensor, m: int) -> Tensor:
    """Map m's half of one chunk's q or k, x (h, N, d), zero-padded to d in this worker's scratch
    buffer ``slot``: (1, h, N, d)."""
    half = x.shape[-1] // 2
    out = scratch.block(slot, (1, *x.shape))
    out[0, ..., :half] = x[..., m * half:(m + 1) * half]
    out[..., half:] = 0.0
    return out


class _TwoMapsFlashCPU(torch.autograd.Function):
    """o = o1 − λ o2 from the CPU flash op, map by map on v itself (module doc), chunk by chunk
    of heads on worker threads (:mod:`attnscale.kernels.chunked`), each map's padded q and k
    written into the worker's reused buffers.  It keeps the output o, o2 and both maps'
    log-sum-exps (o1 = o + λ o2 again in the backward: the op reads its output only for
    δ = rowsum(dO ∘ O)); the backward runs the op's backward map by map (given g and −λ g):
    ∂L/∂λ = −Σ g·o2, each half of dq and dk from its map, dv the sum of both maps'."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, scale: float,
                causal: bool, finite: list[bool]) -> Tensor:
        # finite: receives whether each chunk's q is finite
        out, o2 = torch.empty_like(q), torch.empty_like(q)               # (B, H, Nq, d)
        lse = q.new_empty(2, *q.shape[:-1])                              # both maps' (B, H, Nq)
        neg_lam = -lam.detach().expand(*q.shape[:2], 1, 1)                # −λ per head
        chunks = chunked.chunks_of(q)
        scratch = chunked.scratch(chunks, q, k, q.shape[-1], 2)

        def chunk(b: int, heads: slice) -> None:
            finite.append(all_finite(q[b, heads]))
            v_c = v[b:b + 1, heads]
            o = []
            for m in (0, 1):
                o_m, lse_m = chunked.FLASH(_half_into(scratch, 0, q[b, heads], m),
                                           _half_into(scratch, 1, k[b, heads], m), v_c, 0.0,
                                           causal, scale=scale)
                lse[m, b, heads] = lse_m[0]
                o.append(o_m[0])
            o2[b, heads] = o[1]
            torch.addcmul(o[0], o[1], neg_lam[b, heads], out=out[b, heads])  # o1 − λ o2

        chunked.run_chunks(chunk, chunks, q.device)
        ctx.save_for_backward(q, k, v, lam, out, o2, lse)
        ctx.args = (scale, causal)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, v, lam, out, o2, lse = ctx.saved_tensors
        scale, causal = ctx.args
        half = q.shape[-1] // 2
        g = g.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_lam = q.new_empty(q.shape[:2])                                  # −Σ g·o2 per head
        lam_h = lam.detach().expand(*q.shape[:2], 1, 1)                   # λ per head
        chunks = chunked.chunks_of(q)
        scratch = chunked.scratch(chunks, q, k, q.shape[-1], 3)

        def chunk(b: int, heads: slice) -> None:
            v_c, g_c, o2_c = v[b:b + 1, heads], g[b:b + 1, heads], o2[b, heads]
            lam_c = lam_h[b, heads]                                        # (h, 1, 1)
            o1 = scratch.block(2, (1, *o2_c.shape))
            torch.addcmul(out[b, heads], o2_c, lam_c, out=o1[0])          # o1 = o + λ o2
            # map 2's gradient is −λ g: the op is linear in it, so it runs on g and its
            # results are scaled by −λ
            for m, o_m in enumerate((o1, o2_c[None])):
                dq_m, dk_m, dv_m = chunked.FLASH_BACKWARD(
                    g_c, _half_into(scratch, 0, q[b, heads], m),
                    _half_into(scratch, 1, k[b, heads], m), v_c, o_m, lse[m, b:b + 1, heads],
                    0.0, causal, scale=scale)
                at = slice(m * half, (m + 1) * half)
                if m == 0:
                    dq[b, heads, :, at] = dq_m[0, ..., :half]
                    dk[b, heads, :, at] = dk_m[0, ..., :half]
                    dv[b, heads] = dv_m[0]
                else:
                    torch.mul(dq_m[0, ..., :half], -lam_c, out=dq[b, heads, :, at])
                    torch.mul(dk_m[0, ..., :half], -lam_c, out=dk[b, heads, :, at])
                    dv[b, heads].addcmul_(dv_m[0], -lam_c)
            torch.sum(torch.linalg.vecdot(g_c[0], o2_c), -1, out=d_lam[b, heads]).neg_()

        chunked.run_chunks(chunk, chunks, q.device)
        return (dq, dk, dv, d_lam.view(*q.shape[:2], 1, 1).sum_to_size(lam.shape), None,
                None, None)


# Logits in one block of differential_row_stats: 2^20 floats, both maps of a run of queries of
# every head.
ROW_STATS_BLOCK_ELEMENTS = 2**20


def differential_row_stats(q: Tensor, k: Tensor, scale: float, lam: Tensor,
                           mask: Tensor | None, causal: bool, rows: Tensor,
                           row_stats: Callable[..., Tensor]) -> None:
    """Fill ``rows`` (float64 (B, H, Nq, columns)) with ``row_stats`` (:func:`attnscale.stats.
    row_stats`, normaliser ``"differential"``) of every query's two logit maps, block by block
    of queries (for the pipeline's observers).  ``mask`` bool (True = attend) broadcastable to
    (B, H, Nq, Nk), the keys each query attends; ``causal`` top-left; q, k prepared."""
    with torch.no_grad():
        (q1, q2), (k1, k2) = split_maps(q.detach()), split_maps(k.detach())
        b, h, n_q, _ = q.shape
        n_k = k.shape[-2]
        step = max(1, ROW_STATS_BLOCK_ELEMENTS // max(1, b * h * 2 * n_k))
        hidden = None if mask is None else ~mask.reshape((1,) * (4 - mask.dim()) + mask.shape)
        for i0 in range(0, n_q, step):
            i1 = min(i0 + step, n_q)
            z = torch.cat([scale * q1[..., i0:i1, :] @ k1.transpose(-2, -1),
                           scale * q2[..., i0:i1, :] @ k2.transpose(-2, -1)], dim=-1)
            off = torch.zeros(i1 - i0, n_k, dtype=torch.bool, device=q.device)
            if causal:
                off = torch.arange(n_k, device=q.device) > torch.arange(
                    i0, i1, device=q.device).unsqueeze(-1)
            if hidden is not None:
                off = off | (hidden[..., i0:i1, :] if hidden.shape[-2] > 1 else hidden)
            z = z.masked_fill(torch.cat([off, off], dim=-1), float("-inf"))
            rows[..., i0:i1, :] = row_stats(z, normaliser="differential", lam=lam.detach())
