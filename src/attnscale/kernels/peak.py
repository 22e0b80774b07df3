"""The largest attention logit per head, blockwise: QK-Clip's S_max and the guard's max logit.

:func:`head_peaks` returns, for every query head h, ``S_max^h = max_{b, i, j attended} z_bhij``
with ``z = (q kᵀ) · scale`` (signed, before any soft-cap), scored ``block`` queries at a time so the
(B, H, Nq, Nk) logits never exist at once.  Only the keys a query attends count (Kimi K2's S_max is
the max over the logits the softmax sees): masked keys and, under causality, the keys above the
diagonal are left out.  Under top-left causality a query block is scored only against the keys its
queries can see, and the visible rectangle (every row sees it) is reduced without any mask; only
the block's diagonal square is masked, so causal tracking costs about half of one q kᵀ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnscale.precision import work_dtype
from attnscale.workers import parallel_map, workers_for

# Logits scored per block: (B, H, rows, Nk) blocks of at most 2^22 entries (16 MiB in float32).
PEAK_BLOCK_ELEMENTS = 1 << 22
# An additive-mask entry at or below this marks a masked key (the pipeline's MASKED_BIAS).
_MASKED_BIAS = -1e4


def head_peaks(q: Tensor, k: Tensor, scale: float | Tensor, *, mask: Tensor | None = None,
               causal: bool = False, block_elements: int = PEAK_BLOCK_ELEMENTS) -> Tensor:
    """Largest logit ``scale · q kᵀ`` over attended keys, per query head.

    Args:
        q: (B, H, Nq, d); k: (B, Hk, Nk, d) with ``H % Hk == 0`` (grouped-query attention: query
            head h reads key head ``h // (H // Hk)``).
        scale: float, or tensor broadcastable to (B, H, Nq, 1) (per head or per row).
        mask: bool (True = attend) or additive float (entries <= -1e4 mask a key, finite entries
            above are logit biases, counted), broadcastable to (B, H, Nq, Nk).
        causal: query i attends keys j <= i (top-left, as SDPA's ``is_causal``), on top of mask.
    Returns:
        float64 (H,): -inf for a head with no attended key; NaN where a logit is NaN.
    """
    with torch.no_grad():
        work = work_dtype(q.dtype)
        q, k = q.detach().to(work), k.detach().to(work)
        if isinstance(scale, Tensor):
            scale = scale.detach().to(work)
        b, h, n_q, _ = q.shape
        n_k = k.shape[-2]
        if k.shape[-3] != h:  # GQA: an O(Nk d) copy, never O(N^2)
            k = k.repeat_interleave(h // k.shape[-3], dim=-3)
        if b * h * n_q * n_k == 0:
            return torch.full((h,), -math.inf, dtype=torch.float64)
        bias = None
        if mask is not None and mask.dtype != torch.bool:
            bias = mask.detach().to(work)
            mask = bias > _MASKED_BIAS
            bias = torch.where(mask, bias, 0.0)
            if not bool(bias.any()):
                bias = None
        kt = k.transpose(-2, -1)  # (B, H, d, Nk)
        rows = max(1, min(n_q, block_elements // max(1, b * h * n_k)))
        starts = range(0, n_q, rows)
        peaks = parallel_map(lambda i0: _block_peak(q[..., i0:i0 + rows, :], kt, scale, mask,
                                                    bias, causal, i0),
                             starts, workers_for(q.device, len(starts)))
        return torch.stack(peaks).amax(dim=0).double().cpu()


def _rows(t: Tensor | None, i0: int, i1: int) -> Tensor | None:
    """Rows ``i0:i1`` of a tensor broadcastable to (..., Nq, Nk); broadcast (size-1) rows stay."""
    if t is not None and t.dim() >= 2 and t.shape[-2] > 1:
        return t[..., i0:i1, :]
    return t


def _block_peak(q: Tensor, kt: Tensor, scale: float | Tensor, mask: Tensor | None,
                bias: Tensor | None, causal: bool, i0: int) -> Tensor:
    """Per-head max of the attended logits of query rows ``i0 : i0 + Nb``: (H,) in q's dtype."""
    n_b, n_k = q.shape[-2], kt.shape[-1]
    i1 = i0 + n_b
    mask, bias = _rows(mask, i0, i1), _rows(bias, i0, i1)
    if isinstance(scale, Tensor):
        scale = _rows(scale, i0, i1)
    hi = min(n_k, i1) if causal else n_k  # keys beyond the block's last query are all hidden
    heads = q.shape[-3]
    if hi == 0:
        return torch.full((heads,), -math.inf, dtype=q.dtype, device=q.device)

    def reduce(z: Tensor, lo: int, hi: int, diagonal: bool) -> Tensor:
        # z holds the raw dot products.  Without a bias the scale is applied to the row maxima
        # instead of to every logit: rounding is monotone, so fl(s · max z) = max fl(s · z)
        # exactly for s >= 0 (and s · min z for s < 0), and one pass over the block is saved.
        if bias is not None:
            z = z * scale + (bias[..., lo:hi] if bias.shape[-1] == n_k else bias)
        hide = None
        if mask is not None:
            hide = ~(mask[..., lo:hi] if mask.shape[-1] == n_k else mask)
        if diagonal:  # row r (query i0 + r) sees columns lo + c <= i0 + r
            above = (torch.arange(lo, hi, device=z.device)
                     > torch.arange(i0, i1, device=z.device).unsqueeze(-1))  # (Nb, W)
            hide = above if hide is None else hide | above
        if bias is not None:
            if hide is not None:
                z = z.masked_fill(hide, -math.inf)
            return z.amax(dim=(0, 2, 3))  # (H,)
        if not isinstance(scale, Tensor):
            if hide is not None:
                z = z.masked_fill(hide, -math.inf)
            return z.amax(dim=(0, 2, 3)) * scale if scale >= 0 else (
                z.masked_fill(hide, math.inf) if hide is not None else z).amin(
                dim=(0, 2, 3)) * scale
        # per-head or per-row scale: each row's extreme times its own scale
        top = (z if hide is None else z.masked_fill(hide, -math.inf)).amax(-1, keepdim=True)
        low = (z if hide is None else z.masked_fill(hide, math.inf)).amin(-1, keepdim=True)
        rows = torch.where(scale >= 0, top * scale, low * scale)  # (B, H, Nb, 1)
        rows = torch.where(torch.isneginf(top), -math.inf, rows)  # a row with no key
        return rows.amax(dim=(0, 2, 3))

    # Under causality columns [0, i0] are visible to every row of the block: no mask there.
    split = min(hi, i0 + 1) if causal else hi
    parts = []
    if split > 0:
        parts.append(reduce(q @ kt[..., :split], 0, split, False))
    if split < hi:
        parts.append(reduce(q @ kt[..., split:hi], split, hi, True))
    return torch.stack(parts).amax(dim=0)
