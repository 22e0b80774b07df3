"""The largest attention logit per head, blockwise: QK-Clip's S_max and the guard's max logit.

:func:`head_peaks` returns, for every query head h, ``S_max^h = max_{b, i, j attended} z_bhij``
with ``z = (q kᵀ) · scale`` (signed, before any soft-cap), scored ``block`` queries at a time so the
(B, H, Nq, Nk) logits never exist at once.  Only the keys a query attends count (Kimi K2's S_max is
the max over the logits the softmax sees): masked keys and, under causality, the keys above the
diagonal are left out.  Under top-left causality a query block is scored only against the keys its
queries can see, and the visible rectangle (every row sees it) is reduced without any mask; only
the block's diagonal square is masked, so causal tracking costs about half of one q kᵀ.

**The bf16 screen.**  On a CPU with AMX (Intel Sapphire Rapids and later) or AVX512_BF16 (AMD
Zen 4 and later), a bfloat16 q kᵀ runs about 4x faster than float32 (oneDNN's AMX tiles, or its
bfloat16 dot products: 80 -> 346 GFLOPS on one core of an AMD EPYC Zen 5, measured).  float32
inputs there are scored in two passes that give the float32 answer:

1. every row's top logit m̃_i from bfloat16 copies of q and k, with a bound e_i on its error;
2. the float32 logits of the few rows that can hold a head's maximum, those with
   m̃_i + e_i >= max_i (m̃_i - e_i), every other row being provably below that row's logit.

The bound is rounding analysis (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
ed., §3.1, for γ_d = d 2^-24 / (1 - d 2^-24), float32 summation of d terms).  With bfloat16's
unit roundoff u = 2^-8: rounding q and k changes each product q_j k_j by at most (2u + u²)|q_j k_j|;
a product of two bfloat16 is exact in float32, whose accumulation adds at most γ_d (1 + u)² Σ_j
|q_j k_j|; rounding the sum to bfloat16 adds u of its magnitude, at most u (1 + u)² (1 + γ_d)
Σ_j |q_j k_j|; and the float32 logit the answer is made of is itself within γ_d Σ_j |q_j k_j| of
the exact one.  So |z̃ - fl(z)| <= c Σ_j |q_j k_j| <= c ‖q_i‖ ‖k_j‖ (Cauchy-Schwarz) with
c = 3u + 3u² + u³ + γ_d (1 + u)³ + γ_d, and e_i = c ‖q_i‖ max_j ‖k_j‖, plus 2^-125 (d + √d
(‖q_i‖ + max_j ‖k_j‖)) for values below float32's normal range, which AMX flushes to zero.  A row
outside the candidates therefore has every float32 logit below a candidate's, and the answer is
the float32 maximum (up to the summation order of its one row).  Non-finite inputs, additive
masks with biases, and negative scales take the one-pass float32 path.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
from torch import Tensor

from attnscale.kernels import native
from attnscale.kernels.rowsubset import RowSubset, block_hidden, masked
from attnscale.kernels.team import run_blocks, team_map
from attnscale.precision import work_dtype
from attnscale.workers import workers_for

# Logits scored per block: (B, H, rows, Nk) blocks of at most 2^22 entries (16 MiB in float32).
PEAK_BLOCK_ELEMENTS = 1 << 22
# An additive-mask entry at or below this marks a masked key (the pipeline's MASKED_BIAS).
_MASKED_BIAS = -1e4
# bfloat16's unit roundoff (8 significand bits, round to nearest).
_BF16_U = 2.0**-8
# The screen runs (in automatic mode) from this many logits on; below, conversions cost more
# than the blockwise float32 pass in Python (masked calls, or no sgemm for the C loop).
SCREEN_MIN_ELEMENTS = 1 << 20
# ... and from this many against the C block loop (:func:`_native_peaks`): causal d64 on 2
# threads of an AMD EPYC with AVX512_BF16, screen ÷ loop 1.2 at 4M logits (B1 H4 N1024), even at
# 8M (B1 H8 N1024; B4 H8 N512), 0.63 at 16M (B1 H4 N2048), 0.46 at 32M (B4 H8 N1024, 1 thread).
SCREEN_OVER_NATIVE_ELEMENTS = 1 << 23
# Queries per block of the C loop (one head each; only the logits are held, no weights beside
# them): B4 H8 N1024 d64 non-causal on 1 thread of an AMD EPYC with the AVX2 builds forced,
# 64 rows 90 ms, 128 rows 83, 256 rows 79; causal on AVX-512, 1 and 2 threads, and at B1 H4 N512,
# 128 rows as fast as any (256 and 512 slower at N512).
PEAK_BLOCK_ROWS = 128
# Logits per block of the screen's bfloat16 pass (8 MiB).
SCREEN_BLOCK_ELEMENTS = 1 << 22
# The screen's second pass is given up for the one-pass float32 path when one (batch, head) has
# more candidate rows than this fraction of its queries (rows whose logits all tie, say).
SCREEN_MAX_CANDIDATES = 1 / 16


@functools.lru_cache(maxsize=1)
def amx() -> bool:
    """Whether this CPU runs bfloat16 matmuls on AMX tiles (asks the kernel for the tiles once)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    try:
        return bool(init()) if init is not None else False
    except RuntimeError:  # pragma: no cover - a kernel refusing the tile state
        return False


def bf16_fast() -> bool:
    """Whether this CPU runs bfloat16 matmuls about 4x faster than float32: AMX tiles or
    AVX512_BF16 dot products (the latter read by attnscale's compiled kernels)."""
    return amx() or native.cpu_bf16()


def screen_bound(d: int) -> float:
    """c with |z̃ - fl(z)| <= c ‖q‖ ‖k‖ between a bfloat16-rounded, float32-accumulated,
    bfloat16-stored dot product of length d and the float32 one (module docstring)."""
    u, eps32 = _BF16_U, 2.0**-24
    gamma = d * eps32 / (1 - d * eps32)
    return 3 * u + 3 * u**2 + u**3 + gamma * (1 + u) ** 3 + gamma


# Below float32's normal range AMX flushes inputs and sums to zero: the absolute slack per unit
# of (d + √d (‖q‖ + ‖k‖)) that covers it (module docstring).
_FLUSH_SLACK = 2.0**-125


def screen_error(q_norm: Tensor, k_norm: Tensor, d: int) -> Tensor:
    """The bound on |z̃ - fl(z)| for a bfloat16-screened dot product of a query of norm
    ``q_norm`` with keys of norm at most ``k_norm`` (broadcast together), d coordinates:
    c ‖q‖ ‖k‖ (:func:`screen_bound`) plus the slack for values AMX or bfloat16 dot products
    flush to zero (module docstring)."""
    return (screen_bound(d) * q_norm * k_norm
            + _FLUSH_SLACK * (d + math.sqrt(d) * (q_norm + k_norm)))


def head_peaks(q: Tensor, k: Tensor, scale: float | Tensor, *, mask: Tensor | None = None,
               causal: bool = False, block_elements: int = PEAK_BLOCK_ELEMENTS,
               screen: bool | None = None) -> Tensor:
    """Largest logit ``scale · q kᵀ`` over attended keys, per query head.

    Args:
        q: (B, H, Nq, d); k: (B, Hk, Nk, d) with ``H % Hk == 0`` (grouped-query attention: query
            head h reads key head ``h // (H // Hk)``).
        scale: float, or tensor broadcastable to (B, H, Nq, 1) (per head or per row).
        mask: bool (True = attend) or additive float (entries <= -1e4 mask a key, finite entries
            above are logit biases, counted), broadcastable to (B, H, Nq, Nk).
        causal: query i attends keys j <= i (top-left, as SDPA's ``is_causal``), on top of mask.
        screen: score float32 CPU input through the bfloat16 screen (module docstring): None
            (default) where the CPU has AMX or AVX512_BF16 and the call holds at least
            :data:`SCREEN_OVER_NATIVE_ELEMENTS` logits (:data:`SCREEN_MIN_ELEMENTS` with a mask,
            or without the C block loop), True wherever it applies (for tests), False never.
            The answer is the float32 one either way.
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
        if b * h * n_q * n_k == 0:
            return torch.full((h,), -math.inf, dtype=torch.float64)
        loop = (mask is None and q.dtype == torch.float32 and q.device.type == "cpu"
                and native.blas_sgemm() is not None)
        if screen is None:
            screen = bf16_fast() and b * h * n_q * n_k >= (
                SCREEN_OVER_NATIVE_ELEMENTS if loop else SCREEN_MIN_ELEMENTS)
        if loop and not screen:
            return _native_peaks(q, k, scale, causal)
        if k.shape[-3] != h:  # GQA: an O(Nk d) copy, never O(N^2)
            k = k.repeat_interleave(h // k.shape[-3], dim=-3)
        bias = None
        if mask is not None and mask.dtype != torch.bool:
            bias = mask.detach().to(work)
            mask = bias > _MASKED_BIAS
            bias = torch.where(mask, bias, 0.0)
            if not bool(bias.any()):
                bias = None
        kt = k.transpose(-2, -1)  # (B, H, d, Nk)
        rows = max(1, min(n_q, block_elements // max(1, b * h * n_k)))
        if screen and q.dtype == torch.float32 and q.device.type == "cpu" and bias is None:
            peaks = _screened(q, k, kt, scale, mask, causal)
            if peaks is not None:
                return peaks
        if loop:
            return _native_peaks(q, k, scale, causal)
        starts = range(0, n_q, rows)
        peaks = team_map(lambda i0: _block_peak(q[..., i0:i0 + rows, :], kt, scale, mask,
                                                bias, causal, i0),
                         starts, workers_for(q.device, len(starts)))
        return torch.stack(peaks).amax(dim=0).double().cpu()


def _native_peaks(q: Tensor, k: Tensor, scale: float | Tensor, causal: bool) -> Tensor:
    """head_peaks without a mask, through the C block loop (:func:`native.peak_rows`): every
    row's largest and smallest raw logit, from float32 blocks of one head that stay in cache,
    in one call on the calling thread's OpenMP team; then each row's extreme times its scale
    (rounding is monotone, so fl(s · max z) = max fl(s · z) for s >= 0, and the min for s < 0)."""
    q, k = native.block_operand(q), native.block_operand(k)
    b, h, n_q, _ = q.shape
    top, low = torch.empty(b, h, n_q), torch.empty(b, h, n_q)
    run_blocks(lambda blocks, threads: native.peak_rows(q, k, top, low, causal, blocks,
                                                        threads=threads),
               (b, h, n_q, k.shape[2]), min(PEAK_BLOCK_ROWS, n_q), causal,
               workers_for(q.device, b * h * n_q))
    if isinstance(scale, Tensor):
        s_rows = scale.expand(b, h, n_q, 1).squeeze(-1)
        rows_peak = torch.where(s_rows >= 0, top * s_rows, low * s_rows)
        rows_peak = torch.where(torch.isneginf(top), -math.inf, rows_peak)  # a row with no key
    else:
        rows_peak = top * scale if scale >= 0 else low * scale
    return rows_peak.amax(dim=(0, 2)).double()


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


def _screened(q: Tensor, k: Tensor, kt: Tensor, scale: float | Tensor, mask: Tensor | None,
              causal: bool) -> Tensor | None:
    """head_peaks through the bfloat16 screen (module docstring), or None where it does not
    apply (a negative scale, non-finite input) or would not pay (too many candidate rows)."""
    b, h, n_q, d = q.shape
    n_k = k.shape[-2]
    if isinstance(scale, Tensor):
        if not bool((scale >= 0).all()):
            return None
        s_rows = scale.expand(b, h, n_q, 1).squeeze(-1)
    else:
        if scale < 0:
            return None
        s_rows = None
    k_norm = torch.linalg.vector_norm(k, dim=-1).double().amax(dim=-1, keepdim=True)  # (B, H, 1)
    if not bool(torch.isfinite(k_norm).all()):  # a NaN or inf in k (or a norm overflowing)
        return None
    native_max = native.available()
    hidden = None if mask is None else ~mask
    hidden = None if hidden is None else hidden.reshape((1,) * (4 - hidden.dim()) + hidden.shape)
    approx = torch.empty(b, h, n_q, dtype=torch.float32)
    q_norm = torch.empty(b, h, n_q, dtype=torch.float32)
    # Blocks of whole heads where they fit: one (Nq x d) @ (d x Nk) product per head keeps AMX
    # about 2x busier than row blocks of the same size (measured); under causality, four row
    # chunks, each against the keys it can see.
    rows = min(n_q, max(1, SCREEN_BLOCK_ELEMENTS // n_k))
    if causal:
        rows = min(rows, max(1, -(-n_q // 4)))
    heads = max(1, min(h, SCREEN_BLOCK_ELEMENTS // (rows * n_k)))
    local = threading.local()  # one output buffer per worker: a fresh 8 MiB block page-faults

    def block(where: tuple[int, int, int]) -> None:
        bi, h0, i0 = where
        h1, i1 = min(h, h0 + heads), min(n_q, i0 + rows)
        hi = min(n_k, i1) if causal else n_k
        q_blk = q[bi, h0:h1, i0:i1]
        q_norm[bi, h0:h1, i0:i1] = torch.linalg.vector_norm(q_blk, dim=-1)
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty(heads * rows * n_k, dtype=torch.bfloat16)
        z = torch.bmm(q_blk.bfloat16(), k[bi, h0:h1, :hi].bfloat16().transpose(1, 2),
                      out=buf[:(h1 - h0) * (i1 - i0) * hi].view(h1 - h0, i1 - i0, hi))
        if hidden is not None:
            z.masked_fill_(block_hidden(hidden, bi, slice(h0, h1), i0, i1, hi), -math.inf)
        if causal and i0 + 1 < hi:  # the chunk's diagonal part
            above = (torch.arange(i0 + 1, hi) > torch.arange(i0, i1).unsqueeze(-1))
            z[..., i0 + 1:hi].masked_fill_(above, -math.inf)
        approx[bi, h0:h1, i0:i1] = (native.bf16_row_max(z) if native_max
                                    else z.amax(dim=-1).float())

    items = [(bi, h0, i0) for bi in range(b) for h0 in range(0, h, heads)
             for i0 in range(0, n_q, rows)]
    team_map(block, items, workers_for(q.device, len(items)))
    q_norm = q_norm.double()
    err = screen_error(q_norm, k_norm, d)
    if not bool(torch.isfinite(err).all()):  # a NaN or inf in q (or a norm overflowing)
        return None
    top = approx.double()
    valid = ~torch.isneginf(top)
    if bool((torch.isnan(top) | (top == math.inf)).any()):
        return None                                       # a bf16 logit overflowed
    lower, upper = top - err, top + err
    factor = scale if s_rows is None else s_rows.double()
    lower, upper = lower * factor, upper * factor
    floor = torch.where(valid, lower, -math.inf).amax(dim=(0, 2), keepdim=True)   # (1, H, 1)
    candidate = valid & (upper >= floor)                                          # (B, H, Nq)
    subset = RowSubset(candidate)
    if subset.most == 0:
        return torch.full((h,), -math.inf, dtype=torch.float64)
    if subset.most > max(16, SCREEN_MAX_CANDIDATES * n_q):
        return None
    # The candidates' float32 logits (the padding repeats a candidate: no maximum changes).
    z = masked(subset.gather(q) @ kt, subset.hidden(hidden, n_k, causal))        # (B, H, c, Nk)
    top_c = z.amax(dim=-1)                                                       # (B, H, c)
    # scaled in float32, as the one-pass path does, so both give the same float32 answer
    best = top_c * (scale if s_rows is None else s_rows.gather(2, subset.idx))
    best = torch.where(torch.isneginf(top_c) | ~subset.real, -math.inf, best)
    return best.amax(dim=(0, 2)).double()
