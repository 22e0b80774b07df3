"""Softmax statistics over attention logits, stable all the way to one-hot.

Every function takes logits ``z`` of any batch shape and applies the softmax over the last
dimension, ``p_i = exp(z_i) / sum_l exp(z_l)``.  Masked keys are given as ``-inf`` logits and are
excluded; a row whose keys are all masked has no distribution and every statistic returns 0 for it.

The essay's regime is near one-hot attention, where textbook formulas cancel catastrophically.
All statistics are therefore written around the top key ``t``: with ``S = sum_{i != t} exp(z_i - z_t)``
(each term <= 1, no overflow) we have ``p_t = 1 / (1 + S)``, ``1 - p_t = S / (1 + S)`` and
``log p_i = (z_i - z_t) - log1p(S)``, so no quantity is ever formed as a difference of two numbers
close to 1.  Half-precision inputs are computed in float32.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _work_dtype(z: Tensor) -> Tensor:
    """Upcast half types to float32; keep float32/float64 as they are."""
    if not z.is_floating_point():
        raise TypeError(f"logits must be floating point, got {z.dtype}")
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


def _centred(z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Centre each row on its top logit.

    Returns ``(d, e, S, valid_row)`` for logits ``z`` of shape (..., n): ``d = z - z_t`` (<= 0),
    ``e_i = exp(d_i)`` for ``i != t`` and ``e_t = 0`` (one argmax per row is excluded, ties keep
    the rest), ``S = sum_i e_i`` and ``valid_row`` (rows with an unmasked key; None when nothing
    is masked).  Masked entries of ``d`` are clamped to the most negative finite value so that
    products with their zero weight stay 0.
    """
    z = _work_dtype(z)
    zmax, idx = z.max(dim=-1, keepdim=True)                       # (..., 1)
    valid_row = None
    if bool(torch.isneginf(zmax).any()):
        # Fully masked rows are centred at 0 so that every exp below is exp(-inf) = 0.
        valid_row = torch.isfinite(zmax).squeeze(-1)              # (...)
        zmax = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    d = z - zmax                                                  # (..., n), <= 0
    e = d.exp().scatter_(-1, idx, 0.0)                            # exp(d_i), top excluded
    S = e.sum(dim=-1)                                             # (...)
    d.clamp_(min=torch.finfo(d.dtype).min)                        # -inf -> finite; weight is 0
    return d, e, S, valid_row


def softmax_stats(z: Tensor) -> dict[str, Tensor]:
    """Max weight, entropy (nats) and ``||J||_F`` of ``softmax(z)`` in one pass.

    Args:
        z: logits, shape (..., n); ``-inf`` marks a masked key.  Must not contain NaN or +inf.
    Returns:
        dict with ``max_weight``, ``entropy`` and ``jacobian_fro``, each of shape (...).
    """
    d, e, S, valid_row = _centred(z)
    p_top = 1.0 / (1.0 + S)                                        # (...)

    # Entropy H = -sum p_i log p_i with -log p_i = log1p(S) - d_i >= 0, so every term is >= 0:
    # H = log1p(S) (p_t + rest) - sum_i p_i d_i = log1p(S) - p_t sum_{i != t} e_i d_i.
    entropy = torch.log1p(S) - p_top * torch.linalg.vecdot(e, d)

    # ||J||_F^2 for J = diag(p) - p p^T, split around the top key t, with R_k = sum_{i != t} p_i^k
    # and rest = 1 - p_t = p_t S:
    #   diagonal      p_t^2 rest^2 + sum_{i != t} p_i^2 (1 - p_i)^2 = p_t^2 rest^2 + R2 - 2 R3 + R4
    #   off-diagonal  sum_{i != j} p_i^2 p_j^2 = 2 p_t^2 R2 + R2^2 - R4
    # so ||J||^2 = p_t^2 rest^2 + (1 + 2 p_t^2) R2 - 2 R3 + R2^2.  Non-top weights are <= 1/2, so
    # 2 R3 <= R2 and nothing cancels catastrophically (unlike sum p^2 - 2 sum p^3 + (sum p^2)^2,
    # which is 0 or NaN near one-hot).  To keep p_i^2 from underflowing when the gap exceeds
    # ~350 (float64) or ~45 (float32), factor out the largest non-top weight p_t m:
    # with u_i = e_i / m and U_k = sum u_i^k (each in [1, n]),
    #   ||J|| = p_t m sqrt(p_t^2 U1^2 + (1 + 2 p_t^2) U2 - 2 p_t m U3 + (p_t m)^2 U2^2).
    m = e.amax(dim=-1)                                             # (...), 0 when n = 1
    u = e / torch.where(m > 0, m, torch.ones_like(m)).unsqueeze(-1)
    u2 = u * u
    U1 = S / torch.where(m > 0, m, torch.ones_like(m))
    U2 = u2.sum(dim=-1)
    U3 = torch.linalg.vecdot(u2, u)
    pm = p_top * m
    inner = (p_top * U1) ** 2 + (1.0 + 2.0 * p_top * p_top) * U2 - 2.0 * pm * U3 + (pm * U2) ** 2
    jac = pm * torch.sqrt(inner.clamp(min=0.0))

    out = {"max_weight": p_top, "entropy": entropy, "jacobian_fro": jac}
    if valid_row is not None:
        out = {k: torch.where(valid_row, v, torch.zeros_like(v)) for k, v in out.items()}
    return out


def max_weight(z: Tensor) -> Tensor:
    """Largest attention weight ``max_i p_i = 1 / (1 + S)``; shape (...)."""
    return softmax_stats(z)["max_weight"]


def entropy(z: Tensor) -> Tensor:
    """Shannon entropy ``H(p) = -sum_i p_i ln p_i`` in nats; shape (...)."""
    return softmax_stats(z)["entropy"]


def jacobian_fro(z: Tensor) -> Tensor:
    """Frobenius norm of the softmax Jacobian ``J = diag(p) - p p^T``, in O(n) per row.

    ``||J||_F^2 = sum_i p_i^2 (1 - p_i)^2 + sum_{i != j} p_i^2 p_j^2``; equivalently
    ``sum p^2 - 2 sum p^3 + (sum p^2)^2``, a form this function avoids because it cancels to NaN or
    0 near one-hot.  Shape (...).
    """
    return softmax_stats(z)["jacobian_fro"]


def logit_std(z: Tensor) -> Tensor:
    """Standard deviation of the unmasked logits in each row (Bessel-corrected); shape (...).

    Masked (``-inf``) keys are excluded; a row with fewer than two valid keys returns 0.
    """
    z = _work_dtype(z)
    if z.shape[-1] >= 2 and not bool(torch.isneginf(z).any()):
        return z.std(dim=-1)
    valid = ~torch.isneginf(z)  # NaN and +inf stay in, and make the row's std NaN
    count = valid.sum(dim=-1)
    zv = torch.where(valid, z, torch.zeros_like(z))
    mean = zv.sum(dim=-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
    dev = torch.where(valid, z - mean, torch.zeros_like(z))
    var = (dev * dev).sum(dim=-1) / (count - 1).clamp(min=1)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))
