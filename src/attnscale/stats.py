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
  sqrt(Σ_i σ_i² (1 - σ_i)²)``, the Jacobian of the elementwise map.

:func:`row_mass` is the weight the keys carry, Σ_i p_i: 1 under softmax, 1 minus the sink's mass
under a sink, anything in [0, n] under sigmoid.
"""

from __future__ import annotations

import math

import torch

from attnscale.errors import ConfigError, check_int
from attnscale.kernels import native, rowstats
from attnscale.kernels.native import ROW_STATS_COLUMNS
from attnscale.precision import check_floating, upcast

Tensor = torch.Tensor

__all__ = ["NORMALISERS", "ROW_STATS_COLUMNS", "columns", "entropy", "jacobian_fro", "logit_std",
           "max_weight", "row_mass", "row_stats", "sigmoid_stats", "softmax_stats"]

# The normalisers the statistics are defined for (attnscale.pipeline.NORMALISERS names the same).
NORMALISERS = ("softmax", "sink", "sigmoid")


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


def row_mass(z: Tensor, normaliser: str = "softmax", sink: Tensor | None = None) -> Tensor:
    """Σ_i p_i over the keys of each row, float64 (...): 1 under softmax (0 for a row without
    keys), 1 - p_sink under a sink, Σ σ(z_i) under sigmoid; NaN for rows holding NaN."""
    z = _logits(z)
    if normaliser == "sigmoid":
        return sigmoid_stats(z)["mass"].double()
    zmax = z.amax(dim=-1)
    if normaliser == "sink":
        lse = torch.logsumexp(z, dim=-1)                          # -inf for a row without keys
        b = _sink_column(z, sink)[..., 0]
        return torch.sigmoid(lse - b).double()                    # e^lse / (e^lse + e^b)
    _check_normaliser(normaliser)
    return _special_rows(zmax, torch.ones_like(zmax)).double()


def _check_normaliser(normaliser: str) -> None:
    if normaliser not in NORMALISERS:
        raise ConfigError(f"normaliser must be one of {', '.join(NORMALISERS)}, got "
                          f"{normaliser!r}.")


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
              normaliser: str = "softmax", sink: Tensor | None = None) -> Tensor:
    """Every statistic of every row of ``softmax(z)``: the one entry point for per-row statistics.

    Args:
        z: logits (..., n), n >= 1; ``-inf`` marks a masked key.
        limit: optional int64 tensor (P,): row ``r`` of the flattened (R, n) view sees only its
            first ``limit[r % P]`` keys (clamped to [0, n]), the others count as masked -- causal
            attention without writing a mask, with P the query rows per (batch, head).
        threads: worker threads of the compiled kernel (default ``torch.get_num_threads()``).
        normaliser: ``"softmax"``, ``"sink"`` or ``"sigmoid"``; the columns' definitions for the
            last two are in the module doc.
        sink: the per-head sink logits (H,) (or broadcastable to (..., 1)) for ``"sink"``.
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
    _check_normaliser(normaliser)
    if limit is not None:
        if not isinstance(limit, Tensor) or limit.dtype != torch.int64 or limit.numel() < 1:
            raise ConfigError(f"limit must be a non-empty int64 tensor, got {limit!r}.")
    if threads is not None:
        threads = check_int("threads", threads, minimum=1)
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
    out = torch.stack([count, s["max_weight"], s["entropy"], s["jacobian_fro"], logit_std(z),
                       absmax, _special_rows(zmax, zmax)], dim=-1)
    return out.double()


def columns(rows: Tensor) -> dict[str, Tensor]:
    """Name the last dimension of :func:`row_stats`'s result: ``{column: rows[..., i]}``."""
    return {name: rows[..., i] for i, name in enumerate(ROW_STATS_COLUMNS)}


# The columns of row_stats that describe the weights (the others describe keys and logits).
_WEIGHT_COLUMNS = ("max_weight", "entropy", "jacobian_fro")


def _normalised_row_stats(z: Tensor, limit: Tensor | None, threads: int | None, normaliser: str,
                          sink: Tensor | None) -> Tensor:
    """:func:`row_stats` for the sink and sigmoid normalisers (see the module doc)."""
    keys = row_stats(z, limit=limit, threads=threads)            # count, logit_std, absmax
    if limit is not None:  # written out: the sink column and logsigmoid need the hidden keys
        n = z.shape[-1]
        rows = z.numel() // n
        lim = limit.to(z.device)[torch.arange(rows, device=z.device) % limit.numel()]
        z = z.masked_fill(torch.arange(n, device=z.device) >= lim.view(*z.shape[:-1], 1),
                          -math.inf)
    # The weights' statistics follow the normaliser; count and the logit columns stay the keys'.
    if normaliser == "sink":
        full = columns(row_stats(torch.cat([_sink_column(z, sink), z], dim=-1), threads=threads))
    else:
        full = {c: v.double() for c, v in sigmoid_stats(z).items()}
    key_cols = columns(keys)
    out = torch.stack([full[c] if c in _WEIGHT_COLUMNS else key_cols[c]
                       for c in ROW_STATS_COLUMNS], dim=-1)
    # A row without keys: every statistic 0 (the sink alone is not a row of keys).
    return torch.where(keys[..., :1] == 0, torch.zeros_like(out), out)
