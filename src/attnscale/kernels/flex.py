"""Soft-cap attention on PyTorch FlexAttention: the CUDA path of
:func:`attnscale.kernels.softcap.capped_attention`.

FlexAttention computes softmax(score_mod(scale · q kᵀ)) v blockwise in one fused kernel that
``torch.compile`` generates from a ``score_mod``, forward and backward, without materialising
the logits (Dong et al. 2024, arXiv 2412.05496).  Here the score_mod is the soft-cap,
cap · tanh(score / cap), with a boolean mask folded in as -inf; causality is a block mask, so
blocks above the diagonal are skipped.  The cap and the mask enter as captured tensors, so a new
cap or mask does not recompile.

On CUDA (and not under ``torch.jit.trace``), :func:`usable` is True and the compiled kernel runs;
elsewhere :func:`capped_attention` runs FlexAttention eagerly (materialised, for tests).

Forgetting Attention (FoX, arXiv 2503.02130) runs here too on CUDA (:func:`forget_attention`):
its score_mod adds c_i − c_j, the cumulative log forget gates of query and key, from two float32
halves of c so that the bias keeps its precision far down a sequence; c's gradient flows through
the captured halves.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attnscale.precision import upcast

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return flex_attention is not None


def usable(q: Tensor) -> bool:
    """Whether soft-cap attention on ``q`` runs on compiled FlexAttention: on CUDA, with
    FlexAttention present, and not under ``torch.jit.trace`` (which cannot record it)."""
    return q.device.type == "cuda" and available() and not torch.jit.is_tracing()


def softcap_score_mod(cap: Tensor, mask: Tensor | None = None):
    """The score_mod cap · tanh(score / cap), and -inf where the boolean ``mask`` (B|1, H|1,
    Nq|1, Nk|1), True = attend, hides a key.  ``cap`` is a 0-d tensor on the scores' device."""
    if mask is None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return score_mod

    def masked_score_mod(score, b, h, q_idx, kv_idx):
        keep = mask[b, h, q_idx, kv_idx]
        return torch.where(keep, cap * torch.tanh(score / cap), -float("inf"))
    return masked_score_mod


def causal_mask_mod(b, h, q_idx, kv_idx):
    """Top-left causality: query i sees keys j <= i."""
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=32)
def causal_block_mask(n_q: int, n_k: int, device: str):
    """The causal BlockMask for (Nq, Nk) on ``device``, shared by every batch element and head."""
    return create_block_mask(causal_mask_mod, None, None, n_q, n_k, device=device)


@functools.lru_cache(maxsize=1)
def _compiled():
    """flex_attention compiled once per process (Triton kernels on CUDA)."""
    return torch.compile(flex_attention, dynamic=False)


def capped_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, cap: float,
                     mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(cap · tanh(scale · q kᵀ / cap) masked) v on FlexAttention.

    q, k (B, H, N·, d) float32 or float64 (v of a half type is computed in float32); ``mask``
    broadcastable to (B, H, Nq, Nk), True = attend; ``causal`` is top-left causality.
    Compiled on CUDA, eager elsewhere (and inside an outer ``torch.compile``, which compiles it).
    """
    if not available():
        raise RuntimeError("FlexAttention needs torch >= 2.5")
    cap_t = torch.tensor(cap, dtype=q.dtype, device=q.device)
    return _run(q, k, v, scale, mask, causal, lambda m: softcap_score_mod(cap_t, m))


def forget_score_mod(hi: Tensor, lo: Tensor | None, mask: Tensor | None = None):
    """The score_mod score + c_i − c_j of Forgetting Attention (FoX), c = hi + lo (B, H, N) in
    two float32 halves, so that the difference keeps float32's precision however far c has
    fallen (hi_i − hi_j is exact for nearby c); -inf where the boolean ``mask`` hides a key."""
    def bias(b, h, q_idx, kv_idx):
        d = hi[b, h, q_idx] - hi[b, h, kv_idx]
        return d if lo is None else d + (lo[b, h, q_idx] - lo[b, h, kv_idx])

    if mask is None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias(b, h, q_idx, kv_idx)
        return score_mod

    def masked_score_mod(score, b, h, q_idx, kv_idx):
        keep = mask[b, h, q_idx, kv_idx]
        return torch.where(keep, score + bias(b, h, q_idx, kv_idx), -float("inf"))
    return masked_score_mod


def forget_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, c: Tensor,
                     mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(scale · q kᵀ + c_i − c_j masked) v on FlexAttention (FoX, arXiv 2503.02130).

    q, k (B, H, N·, d) float32 or float64; c (B, H, N) the cumulative log forget gates (N >= Nq,
    Nk), whose gradient flows through the score_mod's captured halves; ``mask`` broadcastable to
    (B, H, Nq, Nk); ``causal`` top-left, as a block mask.  Compiled on CUDA, eager elsewhere.
    """
    if not available():
        raise RuntimeError("FlexAttention needs torch >= 2.5")
    work = q.dtype
    if c.dtype == work:
        hi, lo = c, None
    else:
        hi = c.detach().to(work)
        lo = (c - hi.to(c.dtype)).to(work)
    return _run(q, k, v, scale, mask, causal, lambda m: forget_score_mod(hi, lo, m))


def _run(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None, causal: bool,
         make_score_mod) -> Tensor:
    """FlexAttention of q, k, v with ``make_score_mod(mask)``'s score_mod, the boolean mask
    expanded to (B, H, Nq, Nk) as a view, causality as a block mask; compiled on CUDA."""
    v_acc = upcast(v).to(q.dtype)
    if mask is not None:  # index it as (B, H, Nq, Nk): broadcast dimensions read index 0
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    compiling = torch.compiler.is_compiling()
    make_mask = causal_block_mask.__wrapped__ if compiling else causal_block_mask
    block_mask = make_mask(q.shape[-2], k.shape[-2], str(q.device)) if causal else None
    run = _compiled() if q.device.type == "cuda" and not compiling else flex_attention
    out = run(q, k, v_acc, score_mod=make_score_mod(mask), block_mask=block_mask, scale=scale)
    return out.to(v.dtype)
