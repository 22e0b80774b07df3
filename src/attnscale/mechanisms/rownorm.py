"""Row normalisation of q or k with a hand-written backward, shared by qknorm, cosine, qk-rmsnorm.

    y = scale · gain ∘ x · ρ,   ρ = (||x||² / m + eps)^(-1/2)   per row of the last dimension

m = 1 gives the L2 normalisation of QKNorm and cosine attention (with their temperature folded in as
``scale``), m = d gives RMSNorm.  The "row" may span several dimensions: RMSNorm over every head of
a token at once (OLMo 2's q and k norms) reduces over the heads and the head dimension together.  Autograd's composite backward of the same expression makes about
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
                eps: float, dims: tuple[int, ...] = (-1,)) -> Tensor:
        # x (..., d); scale broadcastable to (..., 1) or None; gain (d,) or None; ρ is reduced
        # over ``dims``: (-1,) per row, or (1, 3) over the heads and d of x (B, H, N, d), with a
        # gain (H, 1, d).
        rho = _sum_over(torch.linalg.vecdot(x, x).unsqueeze(-1), dims).div_(m).add_(eps).rsqrt_()
        c = rho if scale is None else rho * scale  # (..., 1)
        y = x * c
        if gain is not None:
            y.mul_(gain)
        ctx.save_for_backward(x, rho, scale, gain)
        ctx.m, ctx.dims = m, dims
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, rho, scale, gain = ctx.saved_tensors
        c = rho if scale is None else rho * scale
        d_scale = d_gain = None
        # The gain's gradient first, so that its x-sized temporary is freed before dx's.
        if gain is not None and ctx.needs_input_grad[2] and ctx.dims == (-1,):
            d = x.shape[-1]
            d_gain = (g * x).reshape(-1, d).t() @ c.reshape(-1)  # Σ_rows c g ∘ x, (d,)
        elif gain is not None and ctx.needs_input_grad[2]:  # Σ over batch and tokens of c g ∘ x
            d_gain = torch.einsum("bhnd,bn->hd", g * x, c.reshape(c.shape[0], c.shape[2]))
            d_gain = d_gain.reshape(gain.shape)
        gw = g if gain is None else g * gain
        dot = _sum_over(torch.linalg.vecdot(gw, x).unsqueeze(-1), ctx.dims)  # Σ (w ∘ g) x
        if scale is not None and ctx.needs_input_grad[1]:
            d_scale = (rho * dot).sum_to_size(scale.shape)      # Σ over the rows sharing it
        # dy/dx: c (w ∘ g) - c ρ² / m · x · dot   (from dρ/dx = -ρ³ x / m); w ∘ g is a new
        # tensor when there is a gain, so dx is formed in its memory
        dx = (gw * c) if gain is None else gw.mul_(c)
        dx.addcmul_(x, c * rho.square() * dot, value=-1.0 / ctx.m)
        return dx, d_scale, d_gain, None, None, None


def _sum_over(per_row: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Per-row sums (..., 1) of the last dimension, summed further over the other ``dims`` (the
    heads, for a norm over each token's whole projection), keeping them."""
    others = tuple(d for d in dims if d not in (-1, per_row.dim() - 1))
    return per_row.sum(others, keepdim=True) if others else per_row


def unit_rows(x: Tensor, scale: Tensor | None = None) -> Tensor:
    """scale · x / ||x|| per row: L2 normalisation with a temperature folded in."""
    return _RowNorm.apply(x, scale, None, 1.0, UNIT_EPS)


def rms_rows(x: Tensor, gain: Tensor | None, eps: float) -> Tensor:
    """RMSNorm per row, gain ∘ x / sqrt(mean(x²) + eps) (no gain: None)."""
    return _RowNorm.apply(x, None, gain, float(x.shape[-1]), eps)


def rms_heads(x: Tensor, gain: Tensor, eps: float) -> Tensor:
    """RMSNorm of each token over all its heads at once, x (B, H, N, d), mean(x²) over H and d,
    with a gain (H, 1, d) per coordinate of the whole projection."""
    return _RowNorm.apply(x, None, gain, float(x.shape[1] * x.shape[-1]), eps, (1, 3))
