"""Where a NaN in q, k or v reaches the attention output: the rule every kernel path follows.

The rule.  Output row i of a head depends on its query q_i and on the keys k_j and values v_j of
the keys j it attends (its mask and causality), nothing else, and a NaN reaches exactly the
outputs that depend on it:

* a NaN in q_i (after the mechanism, its row temperature included) makes row i NaN;
* a NaN in k_j makes NaN every row that attends key j;
* a NaN in v_j[c] makes NaN entry c of every row that attends key j;
* a key a query does not attend never reaches it, and a row with no key to attend is zero.

Two mechanisms widen what a row depends on, and the rule follows their formulas: selective
attention's selection F_ij sums the first head's logits of the queries between key j and query i
(:mod:`attnscale.kernels.biased`), so a NaN in the first head's q_k or k_j also reaches the later
rows of every head that attend key j; differential attention's output normalisation (a per-head
RMSNorm over d_v, ``normalises_output``) mixes a row's entries, so a NaN in v_j[c] makes the whole
row NaN.

That is SDPA's documented formula, softmax(q kᵀ · scale + bias) v, with a hidden key left out
rather than added as -inf: in SDPA's math backend NaN + -inf and 0 · NaN are NaN, so a hidden
key's NaN reaches every query of its head, and a row with no key is NaN.  SDPA's fused kernels
follow neither, and differ by shape:

* CPU flash kernel (torch 2.13, measured): a row shorter than one SIMD vector of keys (< 16 for
  float32, fp16 and bf16 on AVX-512, < 8 for float64) takes its maximum with ``std::max``, which
  drops NaN, and a row whose maximum stays -inf is zero-filled as fully masked: a row of NaN
  logits (a NaN query; a NaN key that is the only one) comes back zero; longer rows give NaN.
  A boolean mask is added as -inf, so a hidden NaN key reaches every query; causality writes
  -inf over the logits, so it hides it; a hidden NaN value reaches the queries of its key block
  through 0 · NaN in P V, not those of blocks skipped above the diagonal.
* CUDA (PyTorch's FlashAttention-2 sources, ``flash_attn/softmax.h`` and ``mask.h``): a NaN
  logit gives exp2(NaN) = NaN in the weights, so an attended NaN always reaches its row;
  causality writes -inf (a hidden NaN key stays hidden), but a hidden NaN value within a computed
  key block reaches other rows through 0 · NaN; the memory-efficient kernel takes a boolean mask
  as an additive bias, so a hidden NaN key reaches every query.  FlexAttention's ``score_mod``
  (attnscale's soft-cap) writes -inf for hidden keys and shares the 0 · NaN of P V.

:func:`reach` gives the rule's pattern.  The pipeline (:mod:`attnscale.pipeline`) enforces it on
the CPU after a screen that costs one reduction over the output (:func:`has_nan`: every NaN that
a hidden key let through lands there) when the call hides keys, and one over q and k when a row
is shorter than :func:`flash_scalar_keys`; only when the screen finds a NaN does it compute the
pattern and the output over the inputs without NaN (twice the work).  On CUDA it would cost a
device synchronisation per call (and break CUDA-graph capture), so the kernels' own pattern
stands there: every NaN the rule sends arrives, and a hidden key's NaN may also reach rows it
should not.  Compiled, traced and exported graphs likewise keep the kernels' pattern.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

# float32 lanes of one SIMD vector of torch's CPU kernels, by the capability ATen dispatches to;
# 64 (2048-bit SVE, the widest) where not known.
SIMD_FLOATS = {"AVX512": 16, "AVX2": 8}
WIDEST_SIMD_FLOATS = 64


@functools.lru_cache(maxsize=1)
def flash_scalar_keys() -> int:
    """Keys below which the CPU flash-attention kernel (SDPA's on the CPU, and the sink's) can
    return a row of NaN logits as zeros: a row shorter than one SIMD vector of float32 (the
    kernel's accumulation type for float32 and half inputs; float64 rows need half as many) runs
    entirely in its scalar tail, whose std::max drops NaN.  Measured on torch 2.13 with AVX-512:
    Nk <= 15 gives a zero row, Nk >= 16 a NaN row (float64: Nk <= 7 and Nk >= 8)."""
    return SIMD_FLOATS.get(torch.backends.cpu.get_cpu_capability(), WIDEST_SIMD_FLOATS)


def has_nan(t: Tensor) -> bool:
    """Whether ``t`` may hold a NaN: its sum is NaN (one reduction, the cheapest; an overflow
    that sums +inf and -inf also answers True, which only costs the caller its exact path)."""
    return t.numel() > 0 and math.isnan(t.sum().item())


def recording(t: Tensor) -> bool:
    """Whether a tracer, compiler or exporter records this call instead of running it: data-
    dependent checks are skipped there (the recorded graph keeps the kernels' own pattern)."""
    return (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.compiler.is_exporting() or type(t) is not torch.Tensor)


def reach(hit: Tensor, mask: Tensor | None, causal: bool, n_q: int) -> Tensor:
    """Which queries attend a flagged key: (B, H, Nq, c) bool from ``hit`` (B, H, Nk, c) bool.

    Entry (i, c) is True when query i attends some key j with ``hit[j, c]``.  ``mask`` is boolean
    (True = attend) broadcastable to (B, H, Nq, Nk), causality already folded in; without a mask,
    ``causal`` gives top-left causality (query i attends keys j <= i), else every key.  O(Nk · c)
    without a mask; a mask costs one (Nq, Nk) @ (Nk, c) product, as large as the mask itself.
    """
    n_k = hit.shape[-2]
    if n_k == 0:
        return hit.new_zeros(*hit.shape[:-2], n_q, hit.shape[-1])
    if mask is not None:
        counts = mask.to(torch.float32) @ hit.to(torch.float32)           # (B, H, Nq, c)
        return counts > 0
    if not causal:
        return hit.any(dim=-2, keepdim=True).expand(*hit.shape[:-2], n_q, hit.shape[-1])
    seen = hit.to(torch.int32).cumsum(dim=-2) > 0                         # any key j' <= j
    last = torch.arange(n_q, device=hit.device).clamp(max=n_k - 1)       # query i's last key
    return seen.index_select(-2, last)


def without_nan(t: Tensor) -> Tensor:
    """``t`` with every NaN replaced by 0 (infinities kept): the finite part that the exact path
    computes on before it writes the rule's NaN back."""
    return torch.where(torch.isnan(t), torch.zeros((), dtype=t.dtype, device=t.device), t)


# recompute(q, k, v, scale, offset, sink, mask) -> output: the same attention on other inputs
Recompute = Callable[..., Tensor]


def ruled(out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float | Tensor,
          offset: float | Tensor, sink: Tensor | None, mask: Tensor | None, causal: bool,
          recompute: Recompute, *, flash: bool = True, exact_qk: bool = False) -> Tensor:
    """``out`` of a fused kernel with its NaN where the rule puts them (see the module doc).

    q, k (B, H, N·, d) as the kernel got them (after the mechanism); ``scale`` a float or a
    tensor broadcastable to (B, H, Nq, 1); ``offset`` likewise, added to the logits; ``sink`` the
    per-head sink logit (H,) or None; ``mask`` the keys each query attends (True = attend,
    causality folded in) or None with ``causal``; ``flash``: whether the kernel may be the CPU
    flash op.  On the CPU a screen first: a kernel misplaces a NaN only by letting a hidden key's
    NaN through (``out`` then holds it) or, the flash op, by dropping a row of NaN logits shorter
    than :func:`flash_scalar_keys` (q, k or the scale then hold it).  Only then the pattern, and
    ``recompute`` over the inputs without NaN.  ``exact_qk``: the kernel hides masked keys by
    writing -inf over their logits and forms every row's weights itself (a blockwise kernel), so
    the NaN of q and k are where the formula puts them (selective attention's, which reach other
    heads through its selection, included) and only the values' 0 · NaN in P V is placed here.
    """
    if out.device.type != "cpu" or recording(out):
        return out
    hides = mask is not None or causal
    if exact_qk:
        if not (hides and has_nan(out) and has_nan(v)):
            return out
        reached = reach(v.isnan(), mask, causal, q.shape[-2])                # (B, H, Nq, d_v)
        if mask is not None:  # rows without a key attend everything in the kernels (then zeroed)
            mask = mask | ~mask.any(dim=-1, keepdim=True)
        out = recompute(q, k, without_nan(v), scale, offset, sink, mask)
        return out.masked_fill(reached, float("nan"))
    short = flash and k.shape[-2] < flash_scalar_keys()
    if not ((hides and has_nan(out))
            or (short and any(has_nan(t) for t in (q, k, scale) if isinstance(t, Tensor)))):
        return out
    if isinstance(scale, Tensor):
        q, scale = q * scale, 1.0
    rows = q.isnan().any(dim=-1, keepdim=True)                             # (B, H, Nq, 1)
    if isinstance(offset, Tensor):
        rows = rows | offset.isnan()
        offset = without_nan(offset)
    if sink is not None:
        rows = rows | sink.isnan().view(1, -1, 1, 1)
        sink = without_nan(sink)
    n_q = q.shape[-2]
    reached = (rows | reach(k.isnan().any(dim=-1, keepdim=True), mask, causal, n_q)
               | reach(v.isnan(), mask, causal, n_q))                      # (B, H, Nq, d_v)
    if mask is not None:  # rows without a key attend everything in the kernels (then zeroed)
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    out = recompute(without_nan(q), without_nan(k), without_nan(v), scale, offset, sink, mask)
    return out.masked_fill(reached, float("nan"))
