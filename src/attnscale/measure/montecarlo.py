"""The essay's Monte Carlo experiments on random queries and keys.

Model: ``q, k_1..k_n ~ N(0, I_{d_k})`` independent, the premise of the variance argument
(Vaswani et al. 2017, footnote 4).  All experiments are seeded per ``(seed, d_k)``, so a row does
not depend on which other ``d_k`` values were requested, and they return tidy row dicts.

Exact shortcut
--------------
Given ``q``, the raw logits ``q.k_i`` are i.i.d. ``N(0, |q|^2)`` (rotate ``q`` onto the first axis;
the first coordinates of the ``k_i`` are i.i.d. standard normals).  Hence sampling
``|q|^2 ~ chi^2(d_k)`` and ``g ~ N(0, I_n)`` and setting ``z = |q| g`` is exact in distribution and
costs ``n + 1`` normals per trial instead of ``(n + 1) d_k``.  :func:`sample_logits_direct` is the
brute-force reference it is tested against (and the essay's method, timed in ``benchmarks/``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from attnscale.constants import Z95
from attnscale.errors import ConfigError, check_choice, check_int, check_int_list
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.progress import progress
from attnscale.stats import columns, row_stats

# Logits processed per chunk (trials x n).  Small enough to stay in cache and in malloc's arenas
# (fresh multi-MB buffers cost a page fault per 4 KB), large enough to amortise Python overhead.
CHUNK_ELEMENTS = 1 << 16
# Elements of the (trials, n, d_k) key tensor sampled per chunk by the direct reference.
DIRECT_CHUNK_ELEMENTS = 1 << 23
# Mechanisms whose logits this module samples with the chi-square shortcut; every other mechanism
# defined at init goes through its own ``logits`` on rotated-frame (or directly sampled) q and k.
SHORTCUT_MECHANISMS = ("scaled", "unscaled")
# The d_k grid of the essay's figures: 4, 8, ..., 1024.
ESSAY_D_KS = tuple(2 ** i for i in range(2, 11))
ESSAY_N = 256          # keys per query in Figures 1-2
ESSAY_TRIALS = 2000    # trials per d_k in Figures 1-2
ESSAY_PAIRS = 100_000  # query-key pairs per d_k in the variance check
# Statistics of :func:`attnscale.stats.row_stats` that saturation averages, in its row order.
SATURATION_STATS = ("max_weight", "entropy", "jacobian_fro", "logit_std")


def _rng(seed: int, d_k: int, stream: int) -> np.random.Generator:
    """Independent generator for one (seed, d_k, experiment) cell."""
    return np.random.default_rng([seed, d_k, stream])


def kurtosis_dot(d_k: int) -> float:
    """Kurtosis (non-excess) of ``q.k`` for ``q, k ~ N(0, I_d)``: ``3 + 6 / d``.

    ``E[(q.k)^4] = 3 d^2 + 6 d`` because each term ``q_i k_i`` has fourth moment 9.
    """
    return 3.0 + 6.0 / d_k


def std_se(std: float, count: int, kurtosis: float) -> float:
    """Delta-method standard error of a sample standard deviation.

    ``Var(s^2) ~= sigma^4 (kappa - (N - 3) / (N - 1)) / N`` and ``se(s) = se(s^2) / (2 s)``; heavy
    tails (kappa > 3) widen the interval compared with the Gaussian ``s / sqrt(2N)``.
    """
    return std * math.sqrt((kurtosis - (count - 3) / (count - 1)) / count) / 2.0


def variance(d_ks: Sequence[int] = ESSAY_D_KS, pairs: int = ESSAY_PAIRS, seed: int = 0,
             *, show_progress: bool | None = None) -> list[dict]:
    """Empirical std of ``q.k`` against the prediction ``sqrt(d_k)``.

    Returns one row per ``d_k``: ``d_k, pairs, seed, std, predicted, rel_error, std_ci95`` (the
    95% CI of the std, accounting for the kurtosis ``3 + 6/d_k``), ``rel_error_ci95``,
    ``kurtosis_theory`` and ``kurtosis_measured``.
    """
    d_ks = check_int_list("d_k", d_ks, minimum=1)
    pairs = check_int("pairs", pairs, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    rows = []
    for d_k in progress(d_ks, desc="variance", enabled=show_progress):
        rng = _rng(seed, d_k, 0)
        # Exact shortcut: q.k = |q| g with |q|^2 ~ chi2(d_k), g ~ N(0, 1) independent of |q|.
        x = np.sqrt(rng.chisquare(d_k, size=pairs)) * rng.standard_normal(pairs)
        std = float(x.std(ddof=1))
        predicted = math.sqrt(d_k)
        se = std_se(std, pairs, kurtosis_dot(d_k))
        lo, hi = std - Z95 * se, std + Z95 * se
        centred = x - x.mean()
        rows.append({
            "d_k": d_k, "pairs": pairs, "seed": seed, "std": std, "predicted": predicted,
            "rel_error": std / predicted - 1.0, "std_se": se, "std_ci95": [lo, hi],
            "rel_error_ci95": [lo / predicted - 1.0, hi / predicted - 1.0],
            "kurtosis_theory": kurtosis_dot(d_k),
            "kurtosis_measured": float(np.mean(centred ** 4) / np.mean(centred ** 2) ** 2),
        })
    return rows


def sample_logits_direct(d_k: int, n: int, trials: int, rng: np.random.Generator) -> np.ndarray:
    """Raw logits ``q.k_i`` by sampling ``q`` and ``K`` explicitly (the essay's method).

    Returns an array of shape (trials, n).  Memory is O(trials * n * d_k); chunk the caller.
    """
    q = rng.standard_normal((trials, 1, d_k))           # (T, 1, d)
    k = rng.standard_normal((trials, n, d_k))           # (T, n, d)
    return np.matmul(k, q.transpose(0, 2, 1))[..., 0]   # (T, n)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops on one thread, restoring the caller's setting on exit.

    The chunks here are ~64k elements: an OpenMP fork-join per op costs more than it saves, and
    on a loaded machine spinning threads slow it down by an order of magnitude.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _chunks(trials: int, n: int) -> Iterator[int]:
    """Split ``trials`` into chunk sizes of at most CHUNK_ELEMENTS logits each."""
    per = max(1, CHUNK_ELEMENTS // max(n, 1))
    for start in range(0, trials, per):
        yield min(per, trials - start)


def _accumulate(acc: dict[str, list[float]], stats: dict[str, torch.Tensor]) -> None:
    """Add per-chunk sums and sums of squares (in float64) for each statistic."""
    for key, value in stats.items():
        v = value.double()
        s = acc.setdefault(key, [0.0, 0.0])
        s[0] += float(v.sum())
        s[1] += float((v * v).sum())


def _summarise(acc: dict[str, list[float]], trials: int) -> dict[str, float]:
    """Mean and standard error of the mean from accumulated sums."""
    out = {}
    for key, (s1, s2) in acc.items():
        mean = s1 / trials
        var = max(s2 / trials - mean * mean, 0.0) * trials / (trials - 1)
        out[f"{key}_mean"] = mean
        out[f"{key}_se"] = math.sqrt(var / trials)
    return out


def _check_saturation_args(d_ks, n, trials, seed, mechanisms):
    d_ks = check_int_list("d_k", d_ks, minimum=1)
    n = check_int("n", n, minimum=1)
    trials = check_int("trials", trials, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    if isinstance(mechanisms, str):
        mechanisms = (mechanisms,)
    mechanisms = tuple(mechanisms)
    if not mechanisms:
        raise ConfigError("mechanisms must not be empty.")
    at_init = [name for name, cls in MECHANISMS.items() if cls.defined_at_init]
    for name in mechanisms:
        check_choice("mechanisms", name, tuple(MECHANISMS), what="mechanism")
        if name not in at_init:
            raise ConfigError(
                f"mechanism {name!r} has no temperature at init without data: it lives in the "
                f"weights of W_Q and W_K, not in a rule on q and k. Mechanisms defined at init: "
                f"{', '.join(at_init)}.")
    return d_ks, n, trials, seed, mechanisms


def saturation(d_ks: Sequence[int] = ESSAY_D_KS, n: int = ESSAY_N, trials: int = ESSAY_TRIALS,
               seed: int = 0, mechanisms: Sequence[str] = ("scaled", "unscaled"), *,
               show_progress: bool | None = None) -> list[dict]:
    """Softmax saturation of attention over ``n`` random keys, per mechanism and ``d_k``.

    For each trial a fresh query and ``n`` fresh keys are drawn; the statistics of its attention row
    are averaged over ``trials``.  ``scaled`` and ``unscaled`` use the chi-square shortcut; every
    other mechanism defined at init applies its own ``logits`` to queries and keys in a rotated
    frame (:func:`_frame_qk`), or sampled directly when its rule is not rotation invariant.
    Mechanisms sampled the same way share samples (common random numbers), so their differences
    are measured with less noise than their levels.

    Returns one row per (mechanism, d_k) with ``mechanism, d_k, n, trials, seed`` and the mean and
    standard error of ``max_weight``, ``entropy`` (nats), ``jacobian_fro`` and ``logit_std``.
    """
    d_ks, n, trials, seed, mechanisms = _check_saturation_args(d_ks, n, trials, seed, mechanisms)
    rows = []
    for d_k in progress(d_ks, desc="saturation", enabled=show_progress):
        rows += _saturation_one(d_k, n, trials, seed, mechanisms)
    return rows


def _saturation_one(d_k: int, n: int, trials: int, seed: int,
                    mechanisms: tuple[str, ...]) -> list[dict]:
    """Rows of :func:`saturation` for one ``d_k``."""
    acc: dict[str, dict[str, list[float]]] = {m: {} for m in mechanisms}
    method = {m: "chi2-shortcut" for m in mechanisms if m in SHORTCUT_MECHANISMS}
    shortcut = [m for m in mechanisms if m in SHORTCUT_MECHANISMS]
    if shortcut:
        rng = _rng(seed, d_k, 1)
        with _one_thread():
            _shortcut_stats(acc, shortcut, d_k, n, trials, rng)
    modules = {m: build_mechanism(m, d_k, 1) for m in mechanisms if m not in SHORTCUT_MECHANISMS}
    for frame in (True, False):
        group = {m: mod for m, mod in modules.items() if mod.rotation_invariant == frame}
        if not group:
            continue
        _module_stats(acc, group, _frame_qk if frame else _direct_qk, d_k, n, trials,
                      _rng(seed, d_k, 3 if frame else 4))
        method.update({m: "rotation-frame" if frame else "direct" for m in group})
    return [{"mechanism": name, "d_k": d_k, "n": n, "trials": trials, "seed": seed,
             "method": method[name], **_summarise(acc[name], trials)} for name in mechanisms]


def _shortcut_stats(acc: dict, names: list[str], d_k: int, n: int, trials: int,
                    rng: np.random.Generator) -> None:
    """Accumulate statistics of ``scaled``/``unscaled`` logits sampled by the chi-square shortcut."""
    for size in _chunks(trials, n):
        # Exact shortcut: logits q.k_i = |q| g_i, |q|^2 ~ chi2(d_k), g ~ N(0, I_n).
        norm_q = np.sqrt(rng.chisquare(d_k, size=(size, 1)))          # (T, 1)
        g = rng.standard_normal((size, n))                            # (T, n)
        raw = torch.from_numpy(norm_q * g)                             # (T, n) float64
        for name in names:
            _accumulate(acc[name], _row_stats(raw / math.sqrt(d_k) if name == "scaled" else raw))


def _module_stats(acc: dict, modules: dict, sample, d_k: int, n: int, trials: int,
                  rng: np.random.Generator) -> None:
    """Accumulate statistics of each module's ``logits`` on q, k drawn by ``sample`` in chunks."""
    per = max(1, DIRECT_CHUNK_ELEMENTS // (n * d_k))
    for start in range(0, trials, per):
        q, k = sample(d_k, n, min(per, trials - start), rng)
        for name, mod in modules.items():
            with torch.no_grad():
                z = mod.logits(q, k)[:, 0, 0, :]                      # (T, n)
            _accumulate(acc[name], _row_stats(z))


def _row_stats(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row statistics accumulated by the saturation experiments (:data:`SATURATION_STATS`)."""
    rows = columns(row_stats(z, threads=1))
    return {name: rows[name] for name in SATURATION_STATS}


def _frame_qk(d_k: int, n: int, trials: int,
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys in a rotated frame, exact in distribution for rotation-invariant rules.

    Rotate each trial so that ``q = |q| e_1``; the keys' first coordinates are then i.i.d.
    ``N(0, 1)`` and the norm of their remaining ``d_k - 1`` coordinates is ``chi(d_k - 1)``, which
    can sit on ``e_2``.  Any rule invariant under a joint rotation of ``q`` and ``k`` (dot products,
    norms) sees exactly the distribution of ``N(0, I)`` queries and keys, at ``3`` random numbers
    per key instead of ``d_k``.  Returns q (T, 1, 1, d_k) and k (T, 1, n, d_k), float32.
    """
    q = torch.zeros(trials, 1, 1, d_k)
    k = torch.zeros(trials, 1, n, d_k)
    q[:, 0, 0, 0] = torch.from_numpy(np.sqrt(rng.chisquare(d_k, size=trials)))
    k[:, 0, :, 0] = torch.from_numpy(rng.standard_normal((trials, n)))
    if d_k > 1:
        k[:, 0, :, 1] = torch.from_numpy(np.sqrt(rng.chisquare(d_k - 1, size=(trials, n))))
    return q, k


def _direct_qk(d_k: int, n: int, trials: int,
               rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian queries (T, 1, 1, d_k) and keys (T, 1, n, d_k), float32, sampled coordinatewise."""
    q = torch.from_numpy(rng.standard_normal((trials, 1, 1, d_k), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((trials, 1, n, d_k), dtype=np.float32))
    return q, k


def saturation_direct(d_k: int, n: int, trials: int, seed: int,
                      mechanism: str = "unscaled") -> dict[str, float]:
    """Reference for :func:`saturation`: statistics from explicitly sampled ``q`` and ``K``.

    Samples every coordinate of ``N(0, I)`` queries and keys (the essay's method) and applies the
    mechanism's own ``logits``; slow, and the yardstick for both shortcuts.
    """
    _check_saturation_args([d_k], n, trials, seed, (mechanism,))
    acc: dict[str, dict[str, list[float]]] = {mechanism: {}}
    _module_stats(acc, {mechanism: build_mechanism(mechanism, d_k, 1)}, _direct_qk, d_k, n,
                  trials, _rng(seed, d_k, 2))
    return _summarise(acc[mechanism], trials)


# ---------------------------------------------------------------------------------------------
# Derived quantities: the Jacobian crossing and the small-head thresholds.


def jacobian_crossing(rows: Sequence[dict], lower: str = "unscaled",
                      upper: str = "scaled") -> dict:
    """Where ``lower``'s mean ``||J||_F`` crosses below ``upper``'s along ``d_k``.

    Uses the last sign change of ``lower - upper`` on the grid.  ``d_k_estimate`` interpolates
    the difference linearly in ``log2 d_k``; ``d_k_ci95`` is the same interpolation applied to the
    difference shifted by +/- 1.96 of its standard error (the two curves share samples, so the
    standard error of the difference is bounded by the sum of the two).
    """
    by = {(r["mechanism"], r["d_k"]): r for r in rows}
    d_ks = sorted({r["d_k"] for r in rows if (lower, r["d_k"]) in by and (upper, r["d_k"]) in by})

    def diffs(shift: float) -> list[float]:
        return [by[lower, d]["jacobian_fro_mean"] - by[upper, d]["jacobian_fro_mean"]
                + shift * (by[lower, d]["jacobian_fro_se"] + by[upper, d]["jacobian_fro_se"])
                for d in d_ks]

    def crossing(ds: list[float]) -> tuple[int, int, float] | None:
        for i in range(len(ds) - 1, 0, -1):
            if ds[i - 1] > 0 >= ds[i]:
                a, b = math.log2(d_ks[i - 1]), math.log2(d_ks[i])
                t = ds[i - 1] / (ds[i - 1] - ds[i])
                return d_ks[i - 1], d_ks[i], 2.0 ** (a + t * (b - a))
        return None

    mid = crossing(diffs(0.0))
    if mid is None:
        return {"crosses": False, "d_k_interval": None, "d_k_estimate": None, "d_k_ci95": None}
    # Shifting the difference down moves the crossing to smaller d_k, up to larger d_k.  A shifted
    # curve that never crosses on the grid leaves that end of the interval open (None).
    lo, hi = (crossing(diffs(s)) for s in (-Z95, Z95))
    return {"crosses": True, "d_k_interval": [mid[0], mid[1]], "d_k_estimate": mid[2],
            "d_k_ci95": [None if lo is None else min(lo[2], mid[2]),
                         None if hi is None else max(hi[2], mid[2])]}


def condensation_threshold(n: int) -> float:
    """Logit std at which softmax over ``n`` Gaussian logits condenses: ``sqrt(2 ln n)``.

    The expected maximum of ``n`` standard normals grows like ``sqrt(2 ln n)``; once the logit std
    exceeds it the top logit's lead outweighs the ``n`` competitors (the random energy model's
    freezing point).
    """
    return math.sqrt(2.0 * math.log(n))


def small_head_thresholds(n: int = ESSAY_N, d_k: int = 4) -> dict:
    """The essay's "keep the head small" thresholds.

    Unscaled logits have std ``sqrt(d_k)``, which stays below ``sqrt(2 ln n)`` while
    ``d_k < 2 ln n``; conversely at a given ``d_k`` saturation needs ``n < exp(d_k / 2)`` keys.
    """
    n = check_int("n", n, minimum=2)
    d_k = check_int("d_k", d_k, minimum=1)
    return {"n": n, "d_k_threshold": 2.0 * math.log(n), "d_k": d_k,
            "n_threshold": math.exp(d_k / 2.0), "sigma_threshold": condensation_threshold(n)}
