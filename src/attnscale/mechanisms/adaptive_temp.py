"""``adaptive-temp``: the entropy-adaptive temperature of Veličković et al. 2024, "softmax is not
enough (for sharp out-of-distribution)", arXiv 2410.01104.

Each row's entropy H (nats) of softmax(s), s = qᵀk / √d over the keys the query attends, sets an
inverse temperature β(H), and the row becomes softmax(β · s):

    β(H) = max(1, -0.037 H⁴ + 0.481 H³ - 2.3 H² + 4.917 H - 1.791)   if H > 0.5,   else 1.

The polynomial is the paper's fit (its Figure 4 JAX listing, ``poly_fit = [-0.037, 0.481, -2.3,
4.917, -1.791]`` passed to ``jnp.polyval``, which takes the highest power first: -0.037 is the
coefficient of H⁴, -1.791 the constant).  Rows at H <= 0.5 are left alone ("don't overcorrect
low-entropy heads") and β is never below 1 ("never increase entropy").  The listing computes the
entropy with ``log(p + 1e-9)``; here it is the exact entropy of the row kernel, which differs by
less than n · 1e-9 nats.

Gradients flow through β(H), as in the paper: its listing applies no stop-gradient, so autodiff
differentiates β's polynomial and the entropy (attnscale's entropy pass has its own backward,
:mod:`attnscale.kernels.entropy`).  β is a per-row factor on the scale, so after that one
statistics pass the attention itself runs on SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels.entropy import entropy_backward, entropy_forward, row_entropy
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# β(H)'s polynomial, highest power first (jnp.polyval order), from the paper's listing.
POLY_FIT = (-0.037, 0.481, -2.3, 4.917, -1.791)
# Below or at this entropy (nats) β = 1.
ENTROPY_THRESHOLD = 0.5


def _polyval(coefficients, x: Tensor) -> Tensor:
    out = torch.zeros_like(x)
    for c in coefficients:  # Horner, highest power first
        out = out * x + c
    return out


# β's slope dβ/dH where β = poly(H) > 1: the derivative of POLY_FIT, highest power first.
POLY_SLOPE = tuple(c * (len(POLY_FIT) - 1 - i) for i, c in enumerate(POLY_FIT[:-1]))
# Entropies beyond which poly(H) < 1 however far out (its leading coefficient is negative): the
# end of the search for β's window.
WINDOW_SEARCH_END = 64.0
# Rows whose entropy is known to lie this far (nats) outside β's window keep β = 1 without their
# exact entropy (the float32 evaluation of poly near its roots errs by far less: its slope there
# is about 2 and its terms below 1e3).
WINDOW_MARGIN = 1e-3


def _poly(x: float, coefficients=POLY_FIT) -> float:
    out = 0.0
    for c in coefficients:
        out = out * x + c
    return out


def beta_window() -> list[tuple[float, float]]:
    """The entropies where β(H) > 1: the intervals (lo, hi) above ENTROPY_THRESHOLD where the
    polynomial exceeds 1, from a scan in steps of 1/64 nat refined by bisection to 1e-12 (for the
    paper's fit, one interval, about (0.8486, 5.9445))."""
    def above(x: float) -> bool:
        return _poly(x) > 1.0

    def cross(a: float, b: float) -> float:   # above(a) != above(b)
        while b - a > 1e-12:
            mid = (a + b) / 2
            a, b = (mid, b) if above(mid) == above(a) else (a, mid)
        return (a + b) / 2

    intervals, start = [], ENTROPY_THRESHOLD if above(ENTROPY_THRESHOLD) else None
    x, step = ENTROPY_THRESHOLD, 1 / 64
    while x < WINDOW_SEARCH_END:
        y = x + step
        if above(x) != above(y):
            edge = cross(x, y)
            if start is None:
                start = edge
            else:
                intervals.append((start, edge))
                start = None
        x = y
    if start is not None:
        intervals.append((start, WINDOW_SEARCH_END))
    return intervals


BETA_WINDOW = beta_window()


def needs_exact_entropy(lo: Tensor, hi: Tensor) -> Tensor:
    """Rows whose β may exceed 1 given lo <= H <= hi: those whose bounds reach within
    WINDOW_MARGIN of β's window (the others have β = 1 and no gradient through H)."""
    need = torch.zeros_like(lo, dtype=torch.bool)
    for a, b in BETA_WINDOW:
        need |= (hi > a - WINDOW_MARGIN) & (lo < b + WINDOW_MARGIN)
    return need | torch.isnan(lo) | torch.isnan(hi)


def beta(entropy: Tensor) -> Tensor:
    """β(H) = max(1, polyval(POLY_FIT, H)) where H > 0.5, else 1; differentiable."""
    poly = _polyval(POLY_FIT, entropy)
    one = torch.ones_like(entropy)
    return torch.where(entropy > ENTROPY_THRESHOLD, torch.maximum(poly, one), one)


@register("adaptive-temp")
class AdaptiveTemp(Mechanism):
    """z = β(H) qᵀk / √d, H the entropy of softmax(qᵀk / √d), β(H) = max(1, -0.037 H⁴ + 0.481 H³
    - 2.3 H² + 4.917 H - 1.791) for H > 0.5, else 1.  Source: Veličković et al. 2024,
    arXiv 2410.01104 (Figure 4)."""

    bilinear = False  # β depends on q and k
    per_key = False   # ... through the entropy of the whole row

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, inv_sqrt(self.d_head)

    def row_temperature(self, q: Tensor, k: Tensor, scale: Scale, mask: Tensor | None,
                        causal: bool) -> Tensor:
        return beta(row_entropy(q, k, mask, causal, scale))   # (B, H, Nq, 1)

    def adapt_queries(self, q: Tensor, k: Tensor, scale: float, mask: Tensor | None,
                      causal: bool) -> tuple[Tensor, Tensor]:
        """(q · scale · β(H), k): the pipeline's adapt stage as one autograd node, with the
        values and gradients of ``q * (scale * row_temperature(...))``.  k passes through the
        node unchanged, so that the entropy's key gradient is added into the attention's in
        place instead of as a second (B, H, Nk, d) tensor.  Its backward forms ∂L/∂β only on
        the rows where β has a slope (β > 1) and adds the entropy's dQ into the dense dQ in
        place: fewer dense passes than autograd through the product."""
        if q.shape[-2] == 0 or k.shape[-2] == 0:
            return q * scale, k
        return _AdaptiveQueries.apply(q.contiguous(), k.contiguous(), mask, causal, float(scale))


def _owned(g: Tensor) -> Tensor:
    """``g``, or a copy of it where it may share memory with another tensor (a view, or an
    expanded tensor with a zero stride): the gradient a key gradient is added into in place."""
    whole = g.untyped_storage().nbytes() == g.numel() * g.element_size()
    if g._base is None and whole and 0 not in g.stride():
        return g
    return g.clone(memory_format=torch.contiguous_format)


class _AdaptiveQueries(torch.autograd.Function):
    """(q · s · β(H(softmax(s q kᵀ))), k), differentiated through β and H as the paper's
    listing is."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                scale: float) -> tuple[Tensor, Tensor]:
        # Only the rows whose β may exceed 1 need their exact entropy (the bfloat16 screen of
        # attnscale.kernels.entropy, where it runs): every other row has β = 1 and no slope.
        ent, lse = entropy_forward(q, k, mask, causal, scale, exact_where=needs_exact_entropy)
        poly = _polyval(POLY_FIT, ent)
        sloped = (ent > ENTROPY_THRESHOLD) & (poly > 1.0)                 # β = poly > 1 here
        b = torch.where(sloped, poly, 1.0)
        slope = torch.where(sloped, _polyval(POLY_SLOPE, ent), 0.0)       # dβ/dH
        ctx.save_for_backward(q, k, ent, lse, b, slope, mask)
        # The entropy's backward may skip the rows without a gradient (on the host, where that
        # test costs no device sync) without checking q and k for NaN or inf: the 0 · NaN such
        # a value would give there lands only where the attention's own backward (SDPA's, or
        # the materialised one) already puts NaN: the whole head's dQ for a NaN or inf in a
        # key, its dK (and the row's dQ) for one in a query.
        ctx.args = (causal, scale, q.device.type == "cpu")              # the skips' condition
        return q * (scale * b), k.view_as(k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor, g_k: Tensor):
        q, k, ent, lse, b, slope, mask = ctx.saved_tensors
        causal, scale, may_skip = ctx.args
        grad_q = g * (scale * b)
        # ∂L/∂H = dβ/dH · s Σ_d g q on the rows where β has a slope.  Elsewhere it is 0 even for a
        # NaN in g (autograd would give 0 · NaN there): such a g already makes every gradient of
        # the attention NaN, through SDPA's own backward.
        g_ent = torch.zeros_like(ent)
        rows = slope.squeeze(-1).nonzero(as_tuple=True)
        g_ent[rows] = slope[rows] * scale * torch.linalg.vecdot(g[rows], q[rows]).unsqueeze(-1)
        return (*entropy_backward(q, k, ent, lse, g_ent, mask, causal, scale, finite=may_skip,
                                  into=grad_q, into_k=_owned(g_k)), None, None, None)
