"""Row normalisation of q or k with a hand-written backward, shared by qknorm, cosine, qk-rmsnorm.

    y = scale · gain ∘ x · ρ,   ρ = (||x||² / m + eps)^(-1/2)   per row of the last dimension

m = 1 gives the L2 normalisation of QKNorm and cosine attention (with their temperature folded in as
``scale``), m = d gives RMSNorm.  Autograd's composite backward of the same expression makes about
ten passes over (B, H, N, d); this one makes three or four, which is most of what these mechanisms
add to the fused SDPA call.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Guard on the squared norm for L2 normalisation: a zero row stays zero instead of 0/0
# (F.normalize guards the norm at 1e-12, the same threshold).
UNIT_EPS = 1e-24


class _RowNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor | None, gain: Tensor | None, m: float,
                eps: float) -> Tensor:
        # x (..., d); scale broadcastable to (..., 1) or None; gain (d,) or None.
        rho = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(m).add_(eps).rsqrt_()
        c = rho if scale is None else rho * scale  # (..., 1)
        y = x * c
        if gain is not None:
            y.mul_(gain)
        ctx.save_for_backward(x, rho, scale, gain)
        ctx.m = m
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, rho, scale, gain = ctx.saved_tensors
        c = rho if scale is None else rho * scale
        gw = g if gain is None else g * gain
        dot = torch.linalg.vecdot(gw, x).unsqueeze(-1)          # Σ_j (w ∘ g)_j x_j, (..., 1)
        # dy/dx: c (w ∘ g) - c ρ² / m · x · dot   (from dρ/dx = -ρ³ x / m)
        dx = (gw * c).addcmul_(x, c * rho.square() * dot, value=-1.0 / ctx.m)
        d_scale = d_gain = None
        if scale is not None and ctx.needs_input_grad[1]:
            d_scale = (rho * dot).sum_to_size(scale.shape)      # Σ over the rows sharing it
        if gain is not None and ctx.needs_input_grad[2]:
            d = x.shape[-1]
            d_gain = (g * x).reshape(-1, d).t() @ c.reshape(-1)  # Σ_rows c g ∘ x, (d,)
        return dx, d_scale, d_gain, None, None


def unit_rows(x: Tensor, scale: Tensor | None = None) -> Tensor:
    """scale · x / ||x|| per row: L2 normalisation with a temperature folded in."""
    return _RowNorm.apply(x, scale, None, 1.0, UNIT_EPS)


def rms_rows(x: Tensor, gain: Tensor | None, eps: float) -> Tensor:
    """RMSNorm per row, gain ∘ x / sqrt(mean(x²) + eps) (no gain: None)."""
    return _RowNorm.apply(x, None, gain, float(x.shape[-1]), eps)
