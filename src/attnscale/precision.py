"""Working precision: half types compute in float32, everything else in its own dtype.

Below every other attnscale module (it imports only torch), so the attention pipeline, the
mechanisms, the kernels and the statistics can all share this one rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The dtypes that are upcast: their products and reductions accumulate in float32, as SDPA does.
HALF_TYPES = (torch.float16, torch.bfloat16)


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> float32 so products and reductions accumulate in float32; others unchanged."""
    return x.float() if x.dtype in HALF_TYPES else x


def check_floating(x: Tensor, name: str) -> Tensor:
    """Return ``x`` if it is floating point; the check before :func:`upcast` where integer input
    would otherwise compute something meaningless (the statistics' logits).

    Raises:
        TypeError: ``x`` is not floating point, naming ``name``.
    """
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    return x


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``upcast`` computes a ``dtype`` tensor in: float32 at least, float64 stays."""
    return torch.promote_types(dtype, torch.float32)


def all_finite(x: Tensor) -> bool:
    """Whether every entry of ``x`` is finite: one min/max reduction (NaN propagates through
    both, and an infinity is one of the extremes), about 10x faster on the CPU than
    ``torch.isfinite(x).all()``, which writes a mask first."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))
