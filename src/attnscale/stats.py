"""Softmax statistics over attention logits, stable all the way to one-hot: attnscale's one
statistics module.

Every function takes logits ``z`` of any batch shape and applies the softmax over the last
dimension, ``p_i = exp(z_i) / sum_l exp(z_l)``.  :func:`row_stats` is the entry point the Monte
Carlo experiments, the monitor and the recall trainer share: every statistic of every row in one
call, through the compiled kernel (:mod:`attnscale.kernels.rowstats`) for float32 CPU logits and
through the PyTorch formulation here otherwise.  The single functions (:func:`entropy`, ...) are
differentiable and meant for loss terms.

Special rows, the same answer in every function and on every backend:

* a key with logit ``-inf`` is masked out; a row whose keys are all masked has no distribution and
  every statistic is 0 for it (its ``count`` is 0);
* a row holding NaN or ``+inf`` has no finite softmax (``torch.softmax`` and SDPA give NaN there):
  every statistic is NaN, and the key still counts in ``count``;
* an empty last dimension is a :class:`~attnscale.errors.ConfigError`.

The essay's regime is near one-hot attention, where textbook formulas cancel catastrophically.
All statistics are therefore written around the top key ``t``: with
``S = sum_{i != t} exp(z_i - z_t)`` (each term <= 1, no overflow) we have ``p_t = 1 / (1 + S)``,
``1 - p_t = S / (1 + S)`` and ``log p_i = (z_i - z_t) - log1p(S)``, so no quantity is ever formed
as a difference of two numbers close to 1.  Half-precision inputs are computed in float32
(:func:`attnscale.precision.upcast`); integer logits are a ``TypeError``.

Other normalisers (:func:`attnscale.pipeline.normalise`).  :func:`row_stats` takes
``normaliser=``; the columns keep their names, and their definitions become:

* ``"sink"`` (p_i = e^{z_i} / (e^{b} + Σ_j e^{z_j}), the sink an outcome without a value): max
  weight, entropy and ``||J||_F`` are those of the whole softmax over the keys *and* the sink (the
  distribution the row's softmax forms, and the Jacobian its gradient passes through); ``count``,
  ``logit_std`` and ``logit_absmax`` cover the keys only.  A row with every key masked has all its
  mass on the sink: count 0 and every statistic 0, as for any row without keys;
* ``"sigmoid"`` (p_i = σ(z_i), rows need not sum to 1): max weight ``max_i σ(z_i)``; entropy of
  the normalised row p / Σp, which is ``softmax(ln σ(z))``; ``||J||_F = ||diag(σ(1 - σ))||_F =
  sqrt(Σ_i σ_i² (1 - σ_i)²)``, the Jacobian of the elementwise map;
* ``"softpick"`` (p_i = ReLU(e^{z_i} - 1) / (Σ_j |e^{z_j} - 1| + ε), Zuhri et al. 2025, rows sum
  to less than 1 and may be all zero): max weight ``max_i p_i``; entropy of the normalised row
  p / Σp, ``softmax(ln(e^z - 1))`` over the keys with z > 0 (0 for a row without any); ``||J||_F``
  of the map z -> p, J_ij = δ_ij a_i - p_i c_j with a_i = [z_i > 0] e^{z_i} / D and c_j =
  sgn(z_j) e^{z_j} / D (D the denominator), written around the top key so that 1 - p_t is a sum
  of the other keys' terms (:func:`softpick_stats`);
* ``"stick-breaking"`` (p_j = β_j Π_{k > j} (1 - β_k), β = σ(z), keys in order with the nearest
  last, Tan et al. 2024): max weight ``max_j p_j``; entropy of the normalised row p / Σp,
  ``softmax(log p)``; ``||J||_F`` of the map z -> p, whose entries are ∂p_j/∂z_j = p_j (1 - β_j)
  and ∂p_j/∂z_k = -p_j β_k for k > j (0 for k < j), so ``||J||_F² = Σ_j p_j² ((1 - β_j)² +
  Σ_{k > j} β_k²)`` (:func:`stick_breaking_stats`);
* ``"differential"`` (w = p1 − λ p2, p1 = softmax(z1), p2 = softmax(z2), differential attention;
  z is the two maps side by side, (..., 2n), and ``lam`` is λ): max weight ``max_i w_i`` (the
  largest net weight); entropy of the normalised magnitudes |w| / Σ|w| (nats, in [0, ln n]; the
  softmax entropy of p1 when λ = 0); ``||J||_F = sqrt(||J(p1)||² + λ² ||J(p2)||²)``, the Jacobian
  of w with respect to both maps' logits; ``count`` is the row's keys (n, not 2n), and
  ``logit_std``, ``logit_absmax`` and ``logit_max`` cover the logits of both maps
  (:func:`differential_stats`).

:func:`row_mass` is the weight the keys carry, Σ_i p_i: 1 under softmax, 1 minus the sink's mass
under a sink, anything in [0, n] under sigmoid, in [0, 1) under softpick, 1 - Π_k (1 - β_k) under
stick-breaking, 1 − λ under the differential normaliser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from attnscale.constants import Z95
from attnscale.errors import ConfigError, check_int
from attnscale.kernels import native, rowstats
from attnscale.kernels.native import ROW_STATS_COLUMNS
from attnscale.kernels.softpick import SOFTPICK_EPS, softpick_parts
from attnscale.kernels.stick_breaking import softplus, stick_breaking_log_weights, suffix_after
from attnscale.precision import check_floating, upcast

Tensor = torch.Tensor

__all__ = ["NORMALISERS", "ROW_STATS_COLUMNS", "Moments", "coherence", "columns",
           "differential_stats", "entropy", "fit_line", "jacobian_fro", "logit_std", "max_weight",
           "mean_of_means", "mean_se", "mean_se_from_sums", "qk_row_stats", "row_mass",
           "row_stats", "sigmoid_stats", "softmax_stats", "softpick_stats", "stick_breaking_stats",
           "std_ci", "std_se", "t975"]

# The normalisers a mechanism can name, and the statistics are defined for (the pipeline reads it).
NORMALISERS = ("softmax", "sink", "sigmoid", "softpick", "stick-breaking", "differential")


def _logits(z: Tensor) -> Tensor:
    """Upcast ``z`` (floating point only) and require at least one key per row."""
    z = upcast(check_floating(z, "logits"))
    if z.dim() == 0 or z.shape[-1] == 0:
        raise ConfigError(f"z must have at least one key in its last dimension, got shape "
                          f"{tuple(z.shape)}.")
    return z


def _sqrt(x: Tensor) -> Tensor:
    """``sqrt(max(x, 0))`` whose gradient at 0 is 0 rather than NaN (0 * inf)."""
    pos = x > 0
    return torch.where(pos, torch.where(pos, x, torch.ones_like(x)).sqrt(), torch.zeros_like(x))


def _special_rows(zmax: Tensor, out: Tensor) -> Tensor:
    """Apply the module's rule for special rows to a statistic ``out`` (...), given each row's
    max logit ``zmax`` (...): 0 for rows without a key, NaN for rows holding NaN or ``+inf``."""
    out = torch.where(torch.isneginf(zmax), torch.zeros_like(out), out)
    return torch.where(torch.isnan(zmax) | torch.isposinf(zmax), torch.full_like(out, math.nan),
                       out)


def softmax_stats(z: Tensor) -> dict[str, Tensor]:
    """Max weight, entropy (nats) and ``||J||_F`` of ``softmax(z)`` in one pass; differentiable.

    Args:
        z: logits, shape (..., n) with n >= 1; ``-inf`` marks a masked key.
    Returns:
        dict with ``max_weight``, ``entropy`` and ``jacobian_fro``, each of shape (...); see the
        module doc for masked, NaN and ``+inf`` rows.
    """
    z = _logits(z)
    zmax, idx = z.max(dim=-1, keepdim=True)                       # (..., 1); NaN if any NaN
    # Rows without a finite top (no key, NaN, +inf) are centred at 0 to keep the arithmetic
    # finite; _special_rows sets their results at the end.
    centre = torch.where(torch.isfinite(zmax), zmax, torch.zeros_like(zmax))
    d = z - centre                                                # (..., n), <= 0
    top = torch.zeros_like(z, dtype=torch.bool).scatter(-1, idx, True)
    e = torch.where(top, torch.zeros_like(d), d.exp())            # exp(d_i), top excluded
    S = e.sum(dim=-1)                                             # (...)
    d = d.clamp(min=torch.finfo(d.dtype).min)                     # -inf -> finite; weight is 0
    p_top = 1.0 / (1.0 + S)                                       # (...)

    # Entropy H = -sum p_i log p_i with -log p_i = log1p(S) - d_i >= 0, so every term is >= 0:
    # H = log1p(S) (p_t + rest) - sum_i p_i d_i = log1p(S) - p_t sum_{i != t} e_i d_i.
    ent = torch.log1p(S) - p_top * torch.linalg.vecdot(e, d)

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
    m = e.amax(dim=-1)                                            # (...), 0 when n = 1
    m_safe = torch.where(m > 0, m, torch.ones_like(m))
    u = e / m_safe.unsqueeze(-1)
    u2 = u * u
    U1 = S / m_safe
    U2 = u2.sum(dim=-1)
    U3 = torch.linalg.vecdot(u2, u)
    pm = p_top * m
    inner = (p_top * U1) ** 2 + (1.0 + 2.0 * p_top * p_top) * U2 - 2.0 * pm * U3 + (pm * U2) ** 2
    jac = pm * _sqrt(inner)

    zmax = zmax.squeeze(-1)
    return {"max_weight": _special_rows(zmax, p_top), "entropy": _special_rows(zmax, ent),
            "jacobian_fro": _special_rows(zmax, jac)}


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

    Masked (``-inf``) keys are excluded; a row with fewer than two valid keys returns 0, a row
    holding NaN or ``+inf`` returns NaN.  Differentiable (its gradient is 0 where the std is 0).
    """
    z = _logits(z)
    zmax = z.amax(dim=-1)
    if not bool(torch.isneginf(zmax).any()) and not bool(torch.isneginf(z).any()):
        var = z.var(dim=-1) if z.shape[-1] >= 2 else torch.zeros_like(zmax)
        return _special_rows(zmax, _sqrt(var))
    valid = ~torch.isneginf(z)
    count = valid.sum(dim=-1)
    zv = torch.where(valid, z, torch.zeros_like(z))
    mean = zv.sum(dim=-1, keepdim=True) / count.clamp(min=1).unsqueeze(-1)
    dev = torch.where(valid, z - mean, torch.zeros_like(z))
    var = (dev * dev).sum(dim=-1) / (count - 1).clamp(min=1)
    return _special_rows(zmax, torch.where(count >= 2, _sqrt(var), torch.zeros_like(var)))


def sigmoid_stats(z: Tensor) -> dict[str, Tensor]:
    """Max weight, entropy of the normalised row and ``||diag(σ(1-σ))||_F`` of p = σ(z), and the
    total mass Σ p; each of shape (...).  Masked keys (``-inf``) carry p = 0; a row without keys
    gives 0 everywhere, a row holding NaN gives NaN.  Differentiable.
    """
    z = _logits(z)
    p = torch.sigmoid(z)                                          # 0 at masked keys
    log_p = torch.nn.functional.logsigmoid(z)                     # -inf at masked keys
    zmax = z.amax(dim=-1)
    # The normalised row p / Σp is softmax(ln σ(z)): its entropy, stable near one-hot.
    ent = softmax_stats(log_p)["entropy"]
    jac = torch.linalg.vector_norm(p * torch.sigmoid(-z), dim=-1)  # σ(1 - σ) = σ(z) σ(-z)
    empty = torch.isneginf(zmax)
    nan = torch.isnan(zmax)

    def special(x: Tensor) -> Tensor:
        x = torch.where(empty, torch.zeros_like(x), x)
        return torch.where(nan, torch.full_like(x, math.nan), x)

    return {"max_weight": special(p.amax(dim=-1)), "entropy": special(ent),
            "jacobian_fro": special(jac), "mass": special(p.sum(dim=-1))}


def _weight_special(zmax: Tensor, x: Tensor) -> Tensor:
    """A rectified normaliser's statistic ``x`` (...) under the module's special-row rule: 0 for a
    row without keys, NaN for a row holding NaN or +inf."""
    return _special_rows(zmax, torch.where(torch.isneginf(zmax), torch.zeros_like(x), x))


def softpick_stats(z: Tensor) -> dict[str, Tensor]:
    """Max weight, entropy of the normalised row, ``||J||_F`` and mass of softpick weights
    (:mod:`attnscale.kernels.softpick`) of logits z (..., n) (-inf = masked); each (...),
    differentiable.  A row whose logits are all <= 0 has no weight: every statistic 0.

    ``||J||_F² = Σ_{i: z_i > 0} a_i² (1 - p_i)² + Σ_i p_i² (C2 - c_i²)`` with a_i = e_i / D,
    c_j = sgn(u_j) e_j / D and C2 = Σ_j c_j² (the diagonal entry a_i - p_i c_i is a_i (1 - p_i)
    where z_i > 0, and 0 elsewhere).  For the top key t, 1 - p_t = (Σ_{j≠t} |u_j| + ε c) / D and
    C2 - c_t² = Σ_{j≠t} c_j², sums of the other keys' terms, so neither is a difference of two
    numbers close to each other near one-hot; for the other keys both are at least half of the
    row's total.
    """
    z = _logits(z)
    u, d, e, m = softpick_parts(z)                                 # (..., n), (..., 1), (..., n)
    keys = ~torch.isneginf(z)
    absu = torch.where(keys, u.abs(), torch.zeros_like(u))
    r = torch.relu(u)
    p = r / d
    top = torch.zeros_like(z, dtype=torch.bool).scatter(-1, z.argmax(-1, keepdim=True), True)
    c = torch.where(keys, torch.sign(u) * e / d, torch.zeros_like(u))
    c2 = c * c
    others = torch.where(top, torch.zeros_like(absu), absu).sum(-1, keepdim=True)
    rest = torch.where(top, others + SOFTPICK_EPS * torch.exp(-m), d - r)    # D (1 - p_i)
    c2_rest = torch.where(top, torch.where(top, torch.zeros_like(c2), c2).sum(-1, keepdim=True),
                          c2.sum(-1, keepdim=True) - c2)                      # C2 - c_i²
    diag = torch.where(u > 0, (e / d) * (rest / d), torch.zeros_like(u))
    jac = _sqrt((diag * diag).sum(-1) + (p * p * c2_rest).sum(-1))
    # The normalised row r / Σr is softmax(ln r), ln r_i = z_i + ln(1 - e^{-z_i}) for z_i > 0.
    pos = z > 0
    log_r = torch.where(pos, z + torch.log(-torch.expm1(-torch.where(pos, z, torch.ones_like(z)))),
                        torch.full_like(z, -math.inf))
    ent = softmax_stats(log_r)["entropy"]
    zmax = z.amax(dim=-1)
    return {"max_weight": _weight_special(zmax, p.amax(dim=-1)),
            "entropy": _weight_special(zmax, ent), "jacobian_fro": _weight_special(zmax, jac),
            "mass": _weight_special(zmax, p.sum(dim=-1))}


def stick_breaking_stats(z: Tensor) -> dict[str, Tensor]:
    """Max weight, entropy of the normalised row, ``||J||_F`` and mass of stick-breaking weights
    (:mod:`attnscale.kernels.stick_breaking`) of logits z (..., n), keys in order with the nearest
    last (-inf = masked); each (...), differentiable.

    ``||J||_F² = Σ_j p_j² ((1 - β_j)² + Σ_{k > j} β_k²)`` (β = σ(z)); the mass
    ``1 - Π_k (1 - β_k) = -expm1(-Σ_k softplus(z_k))`` is exact for small and large sums alike.
    """
    z = _logits(z)
    log_p = stick_breaking_log_weights(z)
    p = torch.exp(log_p)
    beta = torch.sigmoid(z)
    jac = _sqrt((p * p * (torch.sigmoid(-z) ** 2 + suffix_after(beta * beta))).sum(-1))
    mass = -torch.expm1(-softplus(z).sum(-1))
    zmax = z.amax(dim=-1)
    return {"max_weight": _weight_special(zmax, p.amax(dim=-1)),
            "entropy": _weight_special(zmax, softmax_stats(log_p)["entropy"]),
            "jacobian_fro": _weight_special(zmax, jac), "mass": _weight_special(zmax, mass)}


# The statistics of each normaliser whose rows need not sum to 1 (max weight, entropy,
# Jacobian norm and mass), by name.
_RECTIFIED_STATS = {"softpick": softpick_stats, "stick-breaking": stick_breaking_stats}


def row_mass(z: Tensor, normaliser: str = "softmax", sink: Tensor | None = None,
             lam: Tensor | None = None) -> Tensor:
    """Σ_i p_i over the keys of each row, float64 (...): 1 under softmax (0 for a row without
    keys), 1 - p_sink under a sink, Σ σ(z_i) under sigmoid, the rectified sums under softpick
    and stick-breaking, 1 − λ under the differential normaliser (``lam``, z the two maps side
    by side); NaN for rows holding NaN."""
    z = _logits(z)
    if normaliser == "sigmoid":
        return sigmoid_stats(z)["mass"].double()
    if normaliser in _RECTIFIED_STATS:
        return _RECTIFIED_STATS[normaliser](z)["mass"].double()
    if normaliser == "differential":
        return differential_stats(z, lam)["mass"].double()
    zmax = z.amax(dim=-1)
    if normaliser == "sink":
        lse = torch.logsumexp(z, dim=-1)                          # -inf for a row without keys
        b = _sink_column(z, sink)[..., 0]
        return torch.sigmoid(lse - b).double()                    # e^lse / (e^lse + e^b)
    check_normaliser(normaliser)
    return _special_rows(zmax, torch.ones_like(zmax)).double()


def check_normaliser(normaliser: str) -> None:
    """ConfigError unless ``normaliser`` is one of :data:`NORMALISERS`."""
    if normaliser not in NORMALISERS:
        raise ConfigError(f"normaliser must be one of {', '.join(NORMALISERS)}, got "
                          f"{normaliser!r}.")


def _per_head(z: Tensor, x: Tensor, what: str) -> Tensor:
    """A per-head parameter beside logits z (B, H, Nq, n) or (H, ..., n): 0-d, (H,) (heads at
    dim -3), or anything broadcastable to (..., 1); as a column of z's dtype."""
    if x is None:
        raise ConfigError(f"the {what!r} normaliser needs its per-head parameter.")
    x = x.to(z.dtype)
    if x.dim() == 1 and z.dim() >= 3:
        x = x.view(-1, 1, 1)
    return x.expand(*z.shape[:-1], 1) if x.dim() else x.expand(*z.shape[:-1]).unsqueeze(-1)


def differential_stats(z: Tensor, lam: Tensor | None) -> dict[str, Tensor]:
    """Max weight, entropy of |w| / Σ|w|, ``||J||_F`` and the mass Σ w of w = softmax(z1) −
    λ softmax(z2), z = [z1 | z2] (..., 2n) with masked keys at -inf in both maps, λ = ``lam``
    (0-d, per head, or broadcastable to (..., 1)); each of shape (...).  A row without keys gives
    0, a row holding NaN gives NaN.  Differentiable."""
    z = _logits(z)
    if z.shape[-1] % 2:
        raise ConfigError(f"differential logits are two maps side by side: the last dimension "
                          f"must be even, got {z.shape[-1]}.")
    lam = _per_head(z, lam, "differential")[..., 0]                     # (...)
    z1, z2 = z[..., :z.shape[-1] // 2], z[..., z.shape[-1] // 2:]
    s1, s2 = softmax_stats(z1), softmax_stats(z2)
    w = torch.softmax(z1, dim=-1) - lam.unsqueeze(-1) * torch.softmax(z2, dim=-1)
    a = w.abs()
    total = a.sum(dim=-1, keepdim=True)
    share = a / torch.where(total > 0, total, torch.ones_like(total))
    ent = -(share * torch.log(torch.where(share > 0, share, torch.ones_like(share)))).sum(-1)
    jac = torch.sqrt(s1["jacobian_fro"] ** 2 + (lam * s2["jacobian_fro"]) ** 2)
    zmax = torch.maximum(z1.amax(dim=-1), z2.amax(dim=-1))             # NaN propagates
    return {"max_weight": _special_rows(zmax, w.amax(dim=-1)), "entropy": _special_rows(zmax, ent),
            "jacobian_fro": _special_rows(zmax, jac),
            "mass": _special_rows(zmax, 1.0 - lam)}


def _sink_column(z: Tensor, sink: Tensor | None) -> Tensor:
    """The sink logits as a column (..., 1) beside logits z (B, H, Nq, Nk) or (H, ..., n): ``sink``
    is (H,), or anything broadcastable to (..., 1)."""
    if sink is None:
        raise ConfigError("the 'sink' normaliser needs the sink logits.")
    sink = sink.to(z.dtype)
    if sink.dim() == 1 and z.dim() >= 3:  # one per head, heads at dim -3
        sink = sink.view(-1, 1, 1)
    return sink.expand(*z.shape[:-1], 1)


def row_stats(z: Tensor, *, limit: Tensor | None = None, threads: int | None = None,
              normaliser: str = "softmax", sink: Tensor | None = None,
              lam: Tensor | None = None) -> Tensor:
    """Every statistic of every row of ``softmax(z)``: the one entry point for per-row statistics.

    Args:
        z: logits (..., n), n >= 1; ``-inf`` marks a masked key.
        limit: optional int64 tensor (P,): row ``r`` of the flattened (R, n) view sees only its
            first ``limit[r % P]`` keys (clamped to [0, n]), the others count as masked -- causal
            attention without writing a mask, with P the query rows per (batch, head).
        threads: worker threads of the compiled kernel (default ``torch.get_num_threads()``).
        normaliser: one of :data:`NORMALISERS` (``"differential"``: z the two maps side by
            side, (..., 2n)); the columns' definitions for the others than softmax are in the
            module doc.
        sink: the per-head sink logits (H,) (or broadcastable to (..., 1)) for ``"sink"``.
        lam: λ (0-d or per head (H,)) for ``"differential"``.
    Returns:
        float64 tensor (..., 7) whose columns are :data:`ROW_STATS_COLUMNS`: ``count`` (the
        row's unmasked keys), ``max_weight``, ``entropy``, ``jacobian_fro``, ``logit_std``,
        ``logit_absmax`` (``max |z|`` over unmasked keys) and ``logit_max`` (the signed
        ``max z`` over unmasked keys, QK-Clip's S_max).  :func:`columns` names them.  Masked,
        NaN and ``+inf`` rows follow the module doc (``count`` still counts their keys).

    float32 CPU logits go through the compiled kernel when it is available, unless ``z`` needs
    a gradient; everything else (other dtypes, devices, no kernel) through the PyTorch
    formulation, which is differentiable.  The two agree to float32 rounding.
    """
    z = _logits(z)
    check_normaliser(normaliser)
    if limit is not None:
        if not isinstance(limit, Tensor) or limit.dtype != torch.int64 or limit.numel() < 1:
            raise ConfigError(f"limit must be a non-empty int64 tensor, got {limit!r}.")
    if threads is not None:
        threads = check_int("threads", threads, minimum=1)
    if normaliser == "differential":
        return _differential_row_stats(z, limit, threads, lam)
    if normaliser != "softmax":
        return _normalised_row_stats(z, limit, threads, normaliser, sink)
    needs_grad = z.requires_grad and torch.is_grad_enabled()
    if (z.dtype == torch.float32 and z.device.type == "cpu" and not needs_grad
            and native.available()):
        return rowstats.row_stats(z, limit=limit, threads=threads)
    if limit is not None:
        n = z.shape[-1]
        rows = z.numel() // n
        lim = limit.to(z.device)[torch.arange(rows, device=z.device) % limit.numel()]
        hidden = torch.arange(n, device=z.device) >= lim.view(*z.shape[:-1], 1)
        z = z.masked_fill(hidden, -math.inf)
    masked = torch.isneginf(z)
    s = softmax_stats(z)
    zmax = z.amax(dim=-1)
    absmax = _special_rows(zmax, z.masked_fill(masked, 0.0).abs().amax(dim=-1))
    count = (~masked).sum(dim=-1).to(s["entropy"].dtype)
    values = {"count": count, "max_weight": s["max_weight"], "entropy": s["entropy"],
              "jacobian_fro": s["jacobian_fro"], "logit_std": logit_std(z), "logit_absmax": absmax,
              "logit_max": _special_rows(zmax, zmax)}
    out = torch.stack([values[name] for name in ROW_STATS_COLUMNS], dim=-1)
    return out.double()


def columns(rows: Tensor) -> dict[str, Tensor]:
    """Name the last dimension of :func:`row_stats`'s result: ``{column: rows[..., i]}``."""
    return {name: rows[..., i] for i, name in enumerate(ROW_STATS_COLUMNS)}


def _normalised_row_stats(z: Tensor, limit: Tensor | None, threads: int | None, normaliser: str,
                          sink: Tensor | None) -> Tensor:
    """:func:`row_stats` for the normalisers other than softmax (see the module doc)."""
    keys = row_stats(z, limit=limit, threads=threads)            # count, logit_std, absmax
    if limit is not None:  # written out: the sink column and logsigmoid need the hidden keys
        n = z.shape[-1]
        rows = z.numel() // n
        lim = limit.to(z.device)[torch.arange(rows, device=z.device) % limit.numel()]
        z = z.masked_fill(torch.arange(n, device=z.device) >= lim.view(*z.shape[:-1], 1),
                          -math.inf)
    # The weights' statistics come from the normalised row, the logits' from the keys alone.
    values = columns(keys)
    if normaliser == "sink":
        full = columns(row_stats(torch.cat([_sink_column(z, sink), z], dim=-1), threads=threads))
    else:
        stats = _RECTIFIED_STATS.get(normaliser, sigmoid_stats)
        full = {c: v.double() for c, v in stats(z).items()}
    values.update({c: full[c] for c in _WEIGHT_STATS})
    out = torch.stack([values[name] for name in ROW_STATS_COLUMNS], dim=-1)
    # A row without keys: every statistic 0 (the sink alone is not a row of keys).
    return torch.where(keys[..., :1] == 0, torch.zeros_like(out), out)


# The row statistics of the weights p (the others, count and the logit statistics, are of z).
_WEIGHT_STATS = ("max_weight", "entropy", "jacobian_fro")


def _differential_row_stats(z: Tensor, limit: Tensor | None, threads: int | None,
                            lam: Tensor | None) -> Tensor:
    """:func:`row_stats` for the differential normaliser (see the module doc): z (..., 2n)."""
    n = z.shape[-1] // 2
    if limit is not None:  # the limit counts the keys of one map: hide them in both
        rows = z.numel() // z.shape[-1]
        lim = limit.to(z.device)[torch.arange(rows, device=z.device) % limit.numel()]
        hidden = torch.arange(n, device=z.device) >= lim.view(*z.shape[:-1], 1)
        z = z.masked_fill(torch.cat([hidden, hidden], dim=-1), -math.inf)
    both = columns(row_stats(z, threads=threads))          # the logits of both maps, 2n a row
    values = dict(both, count=columns(row_stats(z[..., :n], threads=threads))["count"])
    full = differential_stats(z, lam)
    values.update({c: full[c].double() for c in _WEIGHT_STATS})
    out = torch.stack([values[name] for name in ROW_STATS_COLUMNS], dim=-1)
    return torch.where(values["count"].unsqueeze(-1) == 0, torch.zeros_like(out), out)


def coherence(q: Tensor, k: Tensor, *, mask: Tensor | None = None,
              limit: Tensor | None = None) -> Tensor:
    """How aligned each query is with its keys, against what independent q and k would give:

        coherence = std_i(q·k_i) / (|q| · rms_i |k_i| / √d)

    over the keys ``i`` the row attends (std Bessel-corrected, as :func:`logit_std`; rms over
    the same keys).  For a query independent of isotropic keys, ``q·k_i`` has std
    ``|q| · rms|k| / √d``, so coherence is about 1: the premise of the 1/√d footnote.  As
    training aligns queries with keys it grows towards √d (keys ``±c q/|q|`` give exactly √d,
    and Cauchy–Schwarz bounds it by ``√d · √(n/(n−1))``): the μP argument that q·k then grows
    like d, not √d.  Scale-free (a scale on q or k cancels).  Shape (..., Nq), float64; NaN where
    it is undefined (see :func:`qk_row_stats`, which gives it with its factors).
    """
    return qk_row_stats(q, k, mask=mask, limit=limit)["coherence"]


def qk_row_stats(q: Tensor, k: Tensor, *, mask: Tensor | None = None,
                 limit: Tensor | None = None) -> dict[str, Tensor]:
    """Per query row, over the keys it attends: ``count``, ``q_rms`` = |q| / √d, ``k_rms`` =
    rms_i |k_i| / √d (the rms of one component) and :func:`coherence`, which split a row's logit
    std into the footnote's factors, exactly without a cap or bias::

        logit_std(scale · q kᵀ) = scale · √d · q_rms · k_rms · coherence

    (the footnote's premise is q_rms = k_rms = coherence = 1, so that scale = 1/√d gives unit
    logits).

    Args:
        q: queries (..., Nq, d); k: keys (..., Nk, d), batch dims broadcastable with q's.
        mask: optional bool, broadcastable to (..., Nq, Nk), True = attend.
        limit: optional int64 (Nq,): row i attends only its first ``limit[i]`` keys (causal
            attention without writing a mask), as in :func:`row_stats`.
    Returns:
        dict of float64 (..., Nq) tensors.  ``coherence`` is NaN where it is undefined: a row
        with fewer than two keys, a zero query (a padding token's), or attended keys that are
        all zero.  Forms the (..., Nq, Nk) products (the std through :func:`row_stats`, so the
        compiled kernel where it runs): call it on blocks of query rows.
    """
    q, k = upcast(check_floating(q, "q")), upcast(check_floating(k, "k"))
    dots = q @ k.transpose(-2, -1)                                # (..., Nq, Nk)
    mask, limit = _one_key_mask(mask, limit, k.shape[-2])
    if mask is not None:
        dots = dots.masked_fill(~mask.expand(dots.shape), -math.inf)
    stats = columns(row_stats(dots, limit=limit))
    return qk_row_factors(q, k, stats["logit_std"], stats["count"], mask=mask, limit=limit)


def _one_key_mask(mask: Tensor | None, limit: Tensor | None,
                  n_k: int) -> tuple[Tensor | None, Tensor | None]:
    """A mask and a causal ``limit`` given together as one mask (True = attend), limit None;
    either alone as it is."""
    if mask is None or limit is None:
        return mask, limit
    return mask & (torch.arange(n_k, device=mask.device)
                   < limit.to(mask.device).unsqueeze(-1)), None


def qk_row_factors(q: Tensor, k: Tensor, qk_std: Tensor, count: Tensor, *,
                   mask: Tensor | None = None, limit: Tensor | None = None) -> dict[str, Tensor]:
    """:func:`qk_row_stats` from each row's std of q·k over its keys, already known (the kernel
    that formed the logits measured it: a row's logit std over its scale), without forming the
    (..., Nq, Nk) products: ``q_rms`` and ``k_rms`` from q and k, and ``coherence`` =
    ``qk_std / (√d · q_rms · k_rms)``.

    ``qk_std`` and ``count`` (the keys each row attends) are (..., Nq); ``mask`` and ``limit`` say
    which keys, as in :func:`qk_row_stats` (the largest tensor is the mask's, (..., Nq, Nk),
    where one is given).  Returns float64 (..., Nq) tensors, as :func:`qk_row_stats`."""
    q, k = upcast(check_floating(q, "q")), upcast(check_floating(k, "k"))
    d, n_k = q.shape[-1], k.shape[-2]
    k_sq = (k * k).sum(dim=-1).double() / d                       # (..., Nk), |k_i|²/d
    mask, limit = _one_key_mask(mask, limit, n_k)
    count = count.double()
    if mask is not None:
        keep = mask.expand(*count.shape, n_k)
        k_ms = (keep.to(k_sq.dtype) @ k_sq.unsqueeze(-1)).squeeze(-1)
    elif limit is not None:                                       # prefix sums of |k_i|²/d
        seen = limit.to(q.device).clamp(0, n_k)
        sums = torch.nn.functional.pad(k_sq.cumsum(dim=-1), (1, 0))
        k_ms = sums[..., seen].expand(count.shape)
    else:
        k_ms = k_sq.sum(dim=-1, keepdim=True).expand(count.shape)
    k_rms = (k_ms / count.clamp(min=1)).sqrt()
    q_rms = torch.linalg.vector_norm(q, dim=-1).double() / math.sqrt(d)
    norm = q_rms * k_rms * math.sqrt(d)                           # |q| · rms|k| / √d
    qk_std = qk_std.double()
    ok = (count >= 2) & (norm > 0)
    coh = torch.where(ok, qk_std / torch.where(ok, norm, 1.0), math.nan)
    # A NaN in q or k makes every quantity of its rows NaN, as in every other statistic.
    return {"count": count, "q_rms": q_rms, "k_rms": torch.where(count > 0, k_rms, 0.0),
            "coherence": torch.where(torch.isnan(qk_std) | torch.isnan(norm), math.nan, coh)}


# ---------------------------------------------------------------------------------------------
# Sampling statistics of the estimates built from the statistics above: standard errors,
# confidence intervals and fitted lines, the one place the experiments and the report take
# them from.


def mean_se(x: Tensor) -> tuple[float, float]:
    """Mean of a sample ``x`` (any shape, read as float64) and the standard error of that mean,
    ``s / sqrt(N)`` with the Bessel-corrected ``s`` (0 for a single value)."""
    x = x.double()
    return x.mean().item(), (x.std() / math.sqrt(x.numel())).item() if x.numel() > 1 else 0.0


def mean_se_from_sums(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """Mean and standard error of the mean of ``count >= 2`` values from their sum and sum of
    squares (a streaming accumulation): ``var = (Σx² / N - mean²) N / (N - 1)``, clamped at 0,
    and ``se = sqrt(var / N)``."""
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0) * count / (count - 1)
    return mean, math.sqrt(var / count)


def mean_of_means(means: list[float], ses: list[float]) -> tuple[float, float]:
    """Average of ``k`` independent estimates and its standard error ``sqrt(Σ se²) / k``."""
    k = len(means)
    return sum(means) / k, math.sqrt(sum(se ** 2 for se in ses)) / k


class Moments:
    """Streaming central moments of a sample, from power sums shifted by its first chunk's mean
    (so nothing cancels when the mean is far from 0)."""

    def __init__(self) -> None:
        self.count, self.shift, self.sums = 0, None, [0.0] * 4

    def add(self, x: Tensor) -> None:
        if self.shift is None:
            self.shift = float(x.mean())
        y = x - self.shift
        y2 = y * y
        for k, part in enumerate((y, y2, y2 * y, y2 * y2)):
            self.sums[k] += float(part.sum())
        self.count += x.numel()

    def central(self) -> tuple[float, float]:
        """``(m2, m4)``, the second and fourth central moments (divided by N)."""
        s1, s2, s3, s4 = (s / self.count for s in self.sums)
        m2 = max(s2 - s1 * s1, 0.0)
        m4 = max(s4 - 4 * s1 * s3 + 6 * s1 * s1 * s2 - 3 * s1 ** 4, 0.0)
        return m2, m4


def std_se(std: float, count: int, kurtosis: float) -> float:
    """Delta-method standard error of a sample standard deviation.

    ``Var(s^2) ~= sigma^4 (kappa - (N - 3) / (N - 1)) / N`` and ``se(s) = se(s^2) / (2 s)``; heavy
    tails (kappa > 3) widen the interval compared with the Gaussian ``s / sqrt(2N)``.
    """
    return std * math.sqrt((kurtosis - (count - 3) / (count - 1)) / count) / 2.0


def std_ci(std: float, se: float) -> tuple[float, float]:
    """95% interval of a standard deviation on the log scale: ``s exp(-/+ z se / s)``.

    The delta method applied to ``ln s`` (whose se is ``se(s) / s``) keeps both ends positive, as a
    standard deviation is, and widens the upper end for small samples, where the sampling
    distribution of ``s`` is right-skewed; for large samples it agrees with ``s -/+ z se``.
    """
    if std <= 0.0:
        return 0.0, 0.0
    half = Z95 * se / std
    return std * math.exp(-half), std * math.exp(half)


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom (``dof >= 1``).

    Bisection on the exact CDF for integer dof (Abramowitz & Stegun 26.7.3-4): with
    ``theta = atan(t / sqrt(dof))``, ``P(|T| < t)`` is a finite series in ``cos(theta)``.
    """
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")

    def central(t: float) -> float:          # P(|T| < t)
        th = math.atan(t / math.sqrt(dof))
        c2 = math.cos(th) ** 2
        if dof % 2:                          # odd: (2 / pi) (theta + sin cos (1 + 2/3 c2 + ...))
            term, total = 1.0, 1.0 if dof > 1 else 0.0
            for j in range(1, (dof - 1) // 2):
                term *= c2 * (2 * j) / (2 * j + 1)
                total += term
            return 2.0 / math.pi * (th + math.sin(th) * math.cos(th) * total)
        term, total = 1.0, 1.0               # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...)
        for j in range(1, dof // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            total += term
        return math.sin(th) * total

    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if central(mid) < 0.95 else (lo, mid)
    return 0.5 * (lo + hi)


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion ``successes / trials`` (Wilson 1927):
    ``(k + z²/2) / (n + z²) -/+ z / (n + z²) sqrt(k (n - k) / n + z²/4)``, z = :data:`Z95`.

    Unlike the normal interval ``p -/+ z sqrt(p (1 - p) / n)`` it stays inside [0, 1] and does
    not shrink to a point at 0 or n successes, where a handful of trials leaves the rate open:
    0 of 3 gives [0, 0.56]."""
    n = check_int("trials", trials, minimum=1)
    k = check_int("successes", successes, minimum=0)
    if k > n:
        raise ConfigError(f"successes must be <= trials, got {k} > {n}.")
    z2 = Z95 * Z95
    centre = (k + z2 / 2.0) / (n + z2)
    half = Z95 / (n + z2) * math.sqrt(k * (n - k) / n + z2 / 4.0)
    # at k = 0 (k = n) the end is 0 (1) exactly; the formula leaves a rounding residue there
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def fit_line(x: Sequence[float], y: Sequence[float], se: Sequence[float]) -> dict:
    """Weighted least-squares line ``y = a + b x`` through points with standard errors ``se``.

    Weights are ``1 / se^2``.  The slope's standard error is ``sqrt(S / D)`` with ``S = sum w``,
    ``D = S sum w x^2 - (sum w x)^2``, scaled by ``max(1, sqrt(chi2 / dof))`` (the Birge ratio,
    ``dof = len(x) - 2``): when the points scatter about the line more than their standard errors
    allow (a curved relation, or underestimated errors) the interval widens accordingly.  The 95%
    interval is ``b +/- q se(b)`` with ``q`` = 1.96 when the errors are taken as known (ratio <= 1)
    and Student's ``t_{0.975, dof}`` when the scatter sets them.

    Returns ``slope, slope_se, slope_ci95, intercept, chi2, dof, birge``.
    """
    x, y, se = (list(map(float, v)) for v in (x, y, se))
    if not len(x) == len(y) == len(se) or len(x) < 2:
        raise ConfigError(f"fit_line needs at least 2 points of x, y and se of equal length, got "
                          f"{len(x)}, {len(y)}, {len(se)}.")
    if min(se) <= 0 or not all(map(math.isfinite, x + y + se)):
        raise ConfigError("fit_line needs finite x and y and positive, finite standard errors.")
    w = [1.0 / s ** 2 for s in se]
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x))
    sy = sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ConfigError("fit_line needs at least two distinct x.")
    slope = (sw * sxy - sx * sy) / det
    intercept = (sxx * sy - sx * sxy) / det
    chi2 = sum(wi * (yi - intercept - slope * xi) ** 2 for wi, xi, yi in zip(w, x, y))
    dof = len(x) - 2
    birge = math.sqrt(chi2 / dof) if dof > 0 else 1.0
    inflate = birge > 1.0
    slope_se = math.sqrt(sw / det) * (birge if inflate else 1.0)
    half = (t975(dof) if inflate else Z95) * slope_se
    return {"slope": slope, "slope_se": slope_se, "slope_ci95": (slope - half, slope + half),
            "intercept": intercept, "chi2": chi2, "dof": dof, "birge": birge}
