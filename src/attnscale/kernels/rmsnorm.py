"""RMSNorm of q or k rows on attnscale's compiled kernels: one pass forward, one pass backward.

    y = w ∘ x · ρ,   ρ = (Σ x² / m + eps)^(-1/2)
    dx = ρ (w ∘ g) - (ρ³ / m) (Σ (w ∘ g) ∘ x) x,   dw = Σ_rows ρ g ∘ x

over each row of d values (``over="head"``), or over the H rows of one token together
(``grouped``, ``over="model"``: OLMo 2's norm over the whole projection).  The PyTorch form of the
same expression (:mod:`attnscale.mechanisms.rownorm`) makes four passes forward and about ten
backward; worse, SDPA's CPU backward hands back gradients in a (B, N, H, d) layout while q and k
are usually (B, H, N, d) views of another, and elementwise ops over two layouts run several
times slower.  The kernels read every tensor through its own strides instead.

Tokens (b, n) are split over ``torch.get_num_threads()`` workers; each keeps its own gain
gradient (float64), summed at the end, and the split falls at multiples of the float partial
sums' length, so the result does not depend on the thread count beyond the order of that final
float64 sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels import native
from attnscale.kernels.team import team_map
from attnscale.workers import workers_for

# Tokens per worker below which a call runs on fewer workers (a thread's start costs more).
MIN_TOKENS_PER_WORKER = 256


def usable(x: Tensor, gain: Tensor | None, grouped: bool) -> bool:
    """Whether :func:`rms_forward` runs ``x``: float32 on the CPU with the kernels built, (B, H,
    N, d) (or 2-D / 3-D rows when not grouped), rows of unit stride, a float32 gain or none, not
    under a tracer or compiler (which record torch ops only)."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and native.available()):
        return False
    if gain is not None and (gain.dtype != torch.float32 or gain.device.type != "cpu"):
        return False
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return False
    if x.dim() != 4 and (grouped or x.dim() not in (2, 3)):
        return False
    return x.shape[-1] <= 1 or x.stride(-1) == 1


def _as_4d(t: Tensor) -> Tensor:
    """(C, d) or (A, C, d) as (1, 1, C, d) or (A, 1, C, d): a view."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(1)
    return t


def _spans(tokens: int) -> list[tuple[int, int]]:
    """The token ranges of the workers, split at multiples of the kernels' FOLD_TOKENS (so the
    gain's float partial sums are the same whatever the number of workers)."""
    workers = workers_for(torch.device("cpu"), max(1, tokens // MIN_TOKENS_PER_WORKER))
    fold = native.FOLD_TOKENS
    bounds = [min(tokens, -(-tokens * i // workers) // fold * fold) for i in range(workers)]
    bounds.append(tokens)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def rms_forward(x: Tensor, gain: Tensor | None, m: float, eps: float,
                grouped: bool) -> tuple[Tensor, Tensor]:
    """(y, ρ): y = gain ∘ x · ρ, ρ = (Σ x² / m + eps)^(-1/2), in x's layout; ρ float32 (A, H, C)
    per row or (A, C) per token (``grouped``: the sum over the token's H rows), for x with
    :func:`usable`."""
    x4 = _as_4d(x)
    a, h, c, d = x4.shape
    y = torch.empty_like(x)
    if y.dim() > 1 and y.shape[-1] > 1 and y.stride(-1) != 1:
        y = torch.empty(x.shape, dtype=x.dtype)
    rho = torch.empty((a, c) if grouped else (a, h, c), dtype=torch.float32)
    w = None if gain is None else gain.detach().contiguous()
    y4 = _as_4d(y)
    team_map(lambda span: native.rownorm_forward(x4, y4, rho, w, m=float(m), eps=eps,
                                                 grouped=grouped, span=span),
             _spans(a * c), len(_spans(a * c)))
    return y, rho


def rms_backward(x: Tensor, g: Tensor, rho: Tensor, gain: Tensor | None, m: float,
                 grouped: bool, need_gain: bool) -> tuple[Tensor, Tensor | None]:
    """(dx, d_gain) of :func:`rms_forward` for the incoming gradient ``g``: dx in x's layout,
    d_gain (the gain's shape and dtype) when ``need_gain``, else None."""
    if g.dim() and g.shape[-1] > 1 and g.stride(-1) != 1:
        g = g.contiguous()
    x4, g4 = _as_4d(x), _as_4d(g)
    a, h, c, d = x4.shape
    dx = torch.empty_like(x)
    if dx.dim() > 1 and dx.shape[-1] > 1 and dx.stride(-1) != 1:
        dx = torch.empty(x.shape, dtype=x.dtype)
    dx4 = _as_4d(dx)
    w = None if gain is None else gain.detach().contiguous()
    spans = _spans(a * c)
    parts = [torch.zeros(w.shape, dtype=torch.float64) if need_gain and w is not None else None
             for _ in spans]
    team_map(lambda i: native.rownorm_backward(x4, g4, dx4, rho, w, parts[i], m=float(m),
                                               grouped=grouped, span=spans[i]),
             range(len(spans)), len(spans))
    d_gain = None
    if need_gain and w is not None:
        d_gain = torch.zeros(w.shape, dtype=torch.float64)   # no token: no gradient
        for part in parts:
            d_gain += part
        d_gain = d_gain.to(gain.dtype)
    return dx, d_gain
