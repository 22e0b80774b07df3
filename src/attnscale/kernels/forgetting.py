"""Forgetting Attention (FoX; Lin et al. 2025, arXiv 2503.02130) on the fused kernels:
softmax(scale · q kᵀ + c_i − c_j, causal) v without the (B, H, Nq, Nk) logits.

c is the cumulative sum of the log forget gates, so it falls steadily along the sequence: −700 at
1024 tokens with gates at σ(0) = 1/2.  SDPA takes no per-(row, key) bias short of a float mask as
large as the logits, but c_i − c_j is a sum of a query term and a key term, so it folds into q
and k as extra channels (a scale of 1 on the augmented vectors)::

    q'_i = [hi_i, 1, lo_i, 1, scale · q_i]
    k'_j = [1, −hi_j, 1, −lo_j, k_j]
    v'_j = [0, 0, 0, 0, v_j]

with c = hi + lo split into float32 halves.  Folded naively (one channel −c_j), a logit of a
query deep in the sequence would be a small score added to a large −c_j and lose float32's
precision: measured 3.5e-5 output error at 1024 tokens and 8e-4 at 16384, against SDPA's own
5e-7.  With the channels first, the dot product's running sum is hi_i − hi_j, exact for the keys
that carry weight (within a factor 2 of each other, Sterbenz), then the low parts and the score:
the logits keep SDPA's precision at any length (measured 9e-7 at 1024 and 1.3e-6 at 16384
tokens, float32 on the CPU, whose GEMMs add a dot product's terms in order).  The gradient
reaches c through the channels (Σ_i dZ_ij on the key side; the query side's row sums, zero for a
softmax, are kept).  The CPU flash kernel needs one head size for q, k and v, hence v's zero
channels; fp16 and bf16 run in float32 (a bf16 channel would round c by whole units).  On the
CPU without a mask the flash op runs under an autograd node of its own (:class:`_FoldedFlashCPU`)
on chunks of a few heads, side by side on worker threads (:mod:`attnscale.kernels.chunked`): it
writes each chunk's q', k', v' into its worker's reused buffers, keeps only the output and the
log-sum-exp, and writes them again in the backward, so no augmented copy of the whole input
exists (peak extra memory of a forward + backward at B4 H8 N1024 d64 with the gates' input:
64 MiB, down from 81 MiB for the copies of the whole input; SDPA's 43 MiB).

The channels' precision rests on the CPU GEMM adding a dot product's terms in order; a GPU's
need not, so on CUDA :func:`attnscale.kernels.flex.forget_attention` adds the same bias inside
FlexAttention with a ``score_mod`` (exact per logit, no channels), and without FlexAttention the
blockwise kernel of :mod:`attnscale.kernels.biased` does; under tracing (``torch.jit.trace``,
``torch.compile``, ``torch.export``) the formula runs materialised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels import chunked, flex
from attnscale.kernels.biased import ForgetBias, biased_attention, nan_query_rows
from attnscale.kernels.tiles import Scratch
from attnscale.precision import all_finite, upcast

# The extra channels of q' and k': c's high and low float32 halves, each a (query, key) pair.
FOLD_CHANNELS = 4
# SDPA's fused CUDA kernels need the head size to be a multiple of 8.
CUDA_HEAD_MULTIPLE = 8



def forget_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: ForgetBias,
                     mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(scale · q kᵀ + c_i − c_j, masked) v: (B, H, Nq, d_v) in v's dtype.

    q, k (B, H, N·, d) float32 or float64; ``bias.c`` (B, H, N) with N >= Nq, Nk (float64 for
    float32 work, so that its low half is exact); ``mask`` bool broadcastable to (B, H, Nq, Nk)
    leaving every query a key; ``causal`` top-left.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return _materialised(q, k, v, scale, bias, mask, causal)
    if flex.usable(q):
        return flex.forget_attention(q, k, v, scale, bias.c, mask, causal)
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        return _materialised(q, k, v, scale, bias, mask, causal)
    if q.device.type != "cpu":  # no FlexAttention: the blockwise kernel, exact in any GEMM order
        return biased_attention(q, k, v, scale, bias, mask, causal)
    return _folded(q, k, v, scale, bias.c, mask, causal)


def _materialised(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: ForgetBias,
                  mask: Tensor | None, causal: bool) -> Tensor:
    """The same attention with the (B, H, Nq, Nk) logits written out, on plain torch ops."""
    z = (q * scale) @ k.transpose(-2, -1) + bias.dense(q.shape[-2], k.shape[-2]).to(q.dtype)
    if causal:
        tri = torch.ones(z.shape[-2:], dtype=torch.bool, device=z.device).tril()
        mask = tri if mask is None else mask & tri
    if mask is not None:
        z = z.masked_fill(~mask, -math.inf)
    return (torch.softmax(z, dim=-1) @ upcast(v).to(q.dtype)).to(v.dtype)


def _folded(q: Tensor, k: Tensor, v: Tensor, scale: float, c: Tensor, mask: Tensor | None,
            causal: bool) -> Tensor:
    """SDPA on the augmented q', k', v' of the module doc."""
    if (mask is None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and chunked.flash_available()):
        hi, lo = _split(c, q.dtype)
        finite: list[bool] = []  # each chunk's q finite, found where the chunk reads it
        out = _FoldedFlashCPU.apply(q.contiguous(), k.contiguous(),
                                    upcast(v).to(q.dtype).contiguous(), lo, hi, float(scale),
                                    causal, finite)
        return _nan_rows(out, q, c, all(finite)).to(v.dtype)
    work = q.dtype
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    q_parts, k_parts = [], []
    for part in _split(c, work):
        q_parts += [part[..., :n_q], torch.ones_like(part[..., :n_q])]
        k_parts += [torch.ones_like(part[..., :n_k]), -part[..., :n_k]]
    front = len(q_parts)
    q2 = torch.cat([torch.stack(q_parts, -1), q * scale], dim=-1)          # (B, H, Nq, 4 + d)
    k2 = torch.cat([torch.stack(k_parts, -1), k], dim=-1)                  # (B, H, Nk, 4 + d)
    v2 = upcast(v).to(work)
    width = max(q2.shape[-1], front + d_v)
    if q.device.type == "cuda":
        width = -(-width // CUDA_HEAD_MULTIPLE) * CUDA_HEAD_MULTIPLE
    # The CPU flash kernel needs one head size: pad q', k' at the end, v' in front (its output
    # channels [front:] are then the output).
    q2 = F.pad(q2, (0, width - q2.shape[-1]))
    k2 = F.pad(k2, (0, width - k2.shape[-1]))
    v2 = F.pad(v2, (front, width - front - d_v))
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, is_causal=causal, scale=1.0)
    return _nan_rows(out[..., front:front + d_v], q, c).to(v.dtype)


def _nan_rows(out: Tensor, q: Tensor, c: Tensor, finite: bool | None = None) -> Tensor:
    """NaN on the rows whose query or c_i is not finite (:func:`nan_query_rows`; ``finite``:
    whether q is, if known): c_i enters every logit of row i."""
    out = nan_query_rows(out, q, finite)
    if all_finite(c):
        return out
    return out.masked_fill(~torch.isfinite(c[..., :q.shape[-2], None]), math.nan)


def _split(c: Tensor, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hi, lo) with c = hi + lo in ``work``: hi a constant, lo carrying c's gradient; hi = 0
    when c already is in the working precision."""
    if c.dtype == work:
        return torch.zeros_like(c), c
    hi = c.detach().to(work)
    return hi, (c - hi.to(c.dtype)).to(work)


def _augment_into(scratch: Scratch, q: Tensor, k: Tensor, v: Tensor, scale: float, hi: Tensor,
                  lo: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q', k', v' of the module doc for one chunk: q, k, v (h, N·, d) and hi, lo (h, N) views,
    each written once into this worker's scratch buffers 0, 1, 2 as (1, h, N·, 4 + d)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    q2 = scratch.block(0, (1, q.shape[0], n_q, FOLD_CHANNELS + q.shape[-1]))[0]
    q2[..., 0], q2[..., 1], q2[..., 2], q2[..., 3] = hi[..., :n_q], 1.0, lo[..., :n_q], 1.0
    torch.mul(q, scale, out=q2[..., FOLD_CHANNELS:])
    k2 = scratch.block(1, (1, k.shape[0], n_k, FOLD_CHANNELS + k.shape[-1]))[0]
    k2[..., 0], k2[..., 1], k2[..., 2], k2[..., 3] = 1.0, -hi[..., :n_k], 1.0, -lo[..., :n_k]
    k2[..., FOLD_CHANNELS:] = k
    return q2[None], k2[None], _zero_front(scratch, 2, v)


def _zero_front(scratch: Scratch, slot: int, x: Tensor) -> Tensor:
    """x (h, N, d) behind FOLD_CHANNELS zero channels, in scratch buffer ``slot``:
    (1, h, N, 4 + d)."""
    out = scratch.block(slot, (1, *x.shape[:-1], FOLD_CHANNELS + x.shape[-1]))
    out[..., :FOLD_CHANNELS] = 0.0
    out[0, ..., FOLD_CHANNELS:] = x
    return out


class _FoldedFlashCPU(torch.autograd.Function):
    """The CPU flash op on q', k', v' (module doc), chunk by chunk of heads on worker threads
    (:mod:`attnscale.kernels.chunked`), returning the (B, H, Nq, d) output; it keeps the output
    and the log-sum-exp.  Backward: per chunk, q', k', v' and the op's output (zero channels in
    front of the output) written again into the worker's buffers, the op's own backward, the
    gradients of q, k, v from its channels [4:], and c's low half's from the others:
    ∂L/∂lo_m = dq'_m[2] − dk'_m[3].  Extra memory: the chunks' copies, not the inputs'."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float,
                causal: bool, finite: list[bool]) -> Tensor:
        # finite: receives whether each chunk's q is finite
        out = torch.empty_like(q)                                        # (B, H, Nq, d)
        lse = q.new_empty(q.shape[:-1])                                  # (B, H, Nq)
        lo_ = lo.detach()
        chunks = chunked.chunks_of(q)
        scratch = chunked.scratch(chunks, q, k, FOLD_CHANNELS + q.shape[-1], 3)

        def chunk(b: int, heads: slice) -> None:
            finite.append(all_finite(q[b, heads]))
            q2, k2, v2 = _augment_into(scratch, q[b, heads], k[b, heads], v[b, heads], scale,
                                       hi[b, heads], lo_[b, heads])
            o2, l2 = chunked.FLASH(q2, k2, v2, 0.0, causal, scale=1.0)
            out[b, heads] = o2[0, ..., FOLD_CHANNELS:]
            lse[b, heads] = l2[0]

        chunked.run_chunks(chunk, chunks, q.device)
        ctx.save_for_backward(q, k, v, lo, hi, out, lse)
        ctx.args = (scale, causal)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, v, lo, hi, out, lse = ctx.saved_tensors
        scale, causal = ctx.args
        g = g.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_lo = torch.zeros_like(lo)                                      # (B, H, N)
        n_q, n_k = q.shape[-2], k.shape[-2]
        chunks = chunked.chunks_of(q)
        scratch = chunked.scratch(chunks, q, k, FOLD_CHANNELS + q.shape[-1], 5)

        def chunk(b: int, heads: slice) -> None:
            q2, k2, v2 = _augment_into(scratch, q[b, heads], k[b, heads], v[b, heads], scale,
                                       hi[b, heads], lo[b, heads])
            o2, g2 = _zero_front(scratch, 3, out[b, heads]), _zero_front(scratch, 4, g[b, heads])
            dq2, dk2, dv2 = chunked.FLASH_BACKWARD(g2, q2, k2, v2, o2, lse[b:b + 1, heads], 0.0,
                                                   causal, scale=1.0)
            torch.mul(dq2[0, ..., FOLD_CHANNELS:], scale, out=dq[b, heads])
            dk[b, heads] = dk2[0, ..., FOLD_CHANNELS:]
            dv[b, heads] = dv2[0, ..., FOLD_CHANNELS:]
            d_lo[b, heads, :n_q] += dq2[0, ..., 2]
            d_lo[b, heads, :n_k] -= dk2[0, ..., 3]

        chunked.run_chunks(chunk, chunks, q.device)
        return dq, dk, dv, d_lo, None, None, None, None
