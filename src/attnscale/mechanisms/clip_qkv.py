"""``clip-qkv``: q, k and v clamped to [-c, c] elementwise, then z = qᵀk / √d.

OLMo (HF transformers ``modeling_olmo.py``: ``query_states``, ``key_states`` and ``value_states``
each ``clamp_(-clip_qkv, clip_qkv)`` after the projections) and DBRX (``modeling_dbrx.py``: the
fused qkv projection clamped to ±``clip_qkv``) bound every coordinate, hence every logit by
d c² / √d: the blunt cousin of ``softcap``, which bounds the logit smoothly.  Option ``clip``
(c > 0): the models set it per checkpoint; the default is the c = 8 of DBRX's released config
(``attn_config.clip_qkv = 8``), so that every walk over the registry by name (the registry tests,
the Monte Carlo at init, the report) can build it.  The clamp's gradient is 0 outside [-c, c],
as in those models.  On the CPU a tensor already inside [-c, c] skips the clamp (values and
gradients are the clamp's bit for bit), the common case: c bounds rare outliers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.errors import check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# DBRX's attn_config.clip_qkv (databricks/dbrx-base config.json).
DBRX_CLIP = 8.0


@register("clip-qkv")
class ClipQKV(Mechanism):
    """z = clamp(q, ±c)ᵀ clamp(k, ±c) / √d, v ← clamp(v, ±c); c = ``clip`` (8, DBRX's).
    Source: OLMo and DBRX ``clip_qkv`` (HF modeling_olmo.py, modeling_dbrx.py)."""

    bilinear = False  # the clamp changes q and k
    rotation_invariant = False  # ... coordinate by coordinate
    acts_on_values = True

    def __init__(self, d_head: int, n_heads: int, *, clip: float = DBRX_CLIP):
        super().__init__(d_head, n_heads)
        self.clip = check_float("clip", clip, positive=True)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return _clamped(q, self.clip), _clamped(k, self.clip), inv_sqrt(self.d_head)

    def prepare_values(self, v: Tensor) -> Tensor:
        return _clamped(v, self.clip)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip={self.clip:g}"


def _clamped(x: Tensor, c: float) -> Tensor:
    """x clamped to [-c, c].  On the CPU, a tensor already inside is returned as it is (one
    min/max reduction instead of the clamp's copy and its backward's masks: clamp is the
    identity there, and so is its gradient, boundary included); NaN takes the clamp, which
    keeps it.  Elsewhere the clamp always runs (the check would cost a device sync)."""
    if x.device.type == "cpu" and x.numel():
        lo, hi = torch.aminmax(x.detach())
        if bool((lo >= -c) & (hi <= c)):
            return x
    return _Clamp.apply(x, c) if x.requires_grad else x.clamp(-c, c)


class _Clamp(torch.autograd.Function):
    """x.clamp(-c, c) whose backward is one pass: it keeps which entries the clamp left as they
    were (inside [-c, c], boundary included; not NaN), where torch's clamp backward compares x
    with both bounds again (same gradient, bit for bit)."""

    @staticmethod
    def forward(ctx, x: Tensor, c: float) -> Tensor:
        y = x.clamp(-c, c)
        ctx.save_for_backward(y == x)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (kept,) = ctx.saved_tensors
        return g * kept, None
