"""The essay's Monte Carlo experiments on random queries and keys.

Model: ``q, k_1..k_n ~ N(0, I_{d_k})`` independent, the premise of the variance argument
(Vaswani et al. 2017, footnote 4).  Every cell of an experiment -- a ``d_k``, an ``n``, a way of
sampling -- draws from its own stream ``attnscale.rng.rng(seed, experiment, ..., d_k, n)``, so a
row does not depend on which other cells were requested, and the experiments return tidy row
dicts.  Statistics come from :func:`attnscale.stats.row_stats`.

Exact shortcut
--------------
Given ``q``, the raw logits ``q.k_i`` are i.i.d. ``N(0, |q|^2)`` (rotate ``q`` onto the first axis;
the first coordinates of the ``k_i`` are i.i.d. standard normals).  Hence sampling
``|q|^2 ~ chi^2(d_k)`` and ``g ~ N(0, I_n)`` and setting ``z = |q| g`` is exact in distribution and
costs ``n + 1`` normals per trial instead of ``(n + 1) d_k``.  It serves every mechanism whose
logits are a function of the raw dot product alone, ``cap(scale * q.k + offset)`` with ``q`` and
``k`` untouched and a constant ``scale`` and ``offset`` (a ``bilinear`` rule, whatever its
normaliser: :func:`shortcut_rule` asks the mechanism itself).  :func:`sample_logits_direct` is the
brute-force reference it is tested against (and the essay's method, timed in ``benchmarks/``).

Size
----
Work is done in chunks of about :data:`CHUNK_ELEMENTS` logits, so memory does not grow with
``trials`` or ``pairs``; one trial's ``n`` keys (times ``d_k`` where a mechanism needs its
vectors) must fit at once, and a request that would need more than half the machine's RAM is
refused up front (:func:`attnscale.memory.check_memory`), and so is one that would run for
more than a day even on a fast machine (:func:`check_time`).  Long runs show a progress bar.

Cells run side by side on ``torch.get_num_threads()`` worker threads; each draws from its own
stream, so the rows are the same bits on any number of threads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from attnscale.columns import MEAN_STATS, ROW_STATS_COLUMNS, named
from attnscale.constants import Z95
from attnscale.errors import (
    ConfigError, check_int, check_int_list, check_int_or_list, check_name_list,
)
from attnscale.kernels.team import team_map
from attnscale.memory import check_memory, memory_budget
from attnscale.mechanisms import build_mechanism, check_mechanism, defined_at_init
from attnscale.mechanisms.base import Mechanism
from attnscale.pipeline import temper
from attnscale.progress import progress
from attnscale.rng import rng
from attnscale.stats import (Moments, mean_se_from_sums, row_mass, row_stats, std_ci,
                             std_se)
from attnscale.workers import num_threads

# Logits processed per chunk (trials x n).  Small enough to stay in cache and in malloc's arenas
# (fresh multi-MB buffers cost a page fault per 4 KB), large enough to amortise Python overhead.
CHUNK_ELEMENTS = 1 << 16
# Logits of the chi-square shortcut scored per call of the row statistics: whole chunks of
# CHUNK_ELEMENTS, gathered so that one call covers 1 MB of float32 logits (1024 of the essay's
# trials of 256 keys) instead of 256 KB: fewer calls, and each row is reduced while it sits in
# L1.  2^17 to 2^19 measured alike (2^16, one chunk a call, 15% slower).
SHORTCUT_BATCH_ELEMENTS = 1 << 18
# Elements of the (trials, n, d_k) key tensor sampled per chunk by the module paths.
DIRECT_CHUNK_ELEMENTS = 1 << 23
# Samples of q.k per chunk in the variance check: 256 KiB float64 tensors.  Larger chunks are
# slower (1.7x at 2^17, measured): malloc hands buffers that big out as fresh pages.
VARIANCE_CHUNK = 1 << 15
# torch intra-op threads for the sampling loops.  The chunks are 64k logits (8M key coordinates on
# the module paths): an OpenMP fork-join per op costs more than it saves, and on a loaded machine
# spinning threads slow it down by an order of magnitude (3x measured for the rotated-frame path
# at n = 65536 on 2 busy cores).  The cores are used by running cells side by side instead, one
# per worker thread (_cell_workers).
MONTE_CARLO_THREADS = 1
# Bytes per logit of a chunk's working set: float32 logits, the float64 shortcut samples and the
# statistics' temporaries (the PyTorch formulation holds about ten row-sized tensors).
BYTES_PER_LOGIT = 96
# Bytes per key coordinate on the module paths: q and k in float32 and a mechanism's copies.
BYTES_PER_KEY_COORDINATE = 16
# Lower bounds on the cost of the work, from the benchmark on one core (benchmarks/
# bench_montecarlo.py measures ~100 ns per pair and ~10 ns per logit) divided by 10 for faster
# machines: a request that needs more than MAX_SECONDS even at these rates is refused.
SECONDS_PER_PAIR = 1e-8
SECONDS_PER_LOGIT = 1e-9
SECONDS_PER_KEY_COORDINATE = 1e-10
MAX_SECONDS = 24 * 3600.0
# The d_k grid of the essay's figures: 4, 8, ..., 1024.
ESSAY_D_KS = tuple(2 ** i for i in range(2, 11))
ESSAY_N = 256          # keys per query in Figures 1-2
ESSAY_TRIALS = 2000    # trials per d_k in Figures 1-2
ESSAY_PAIRS = 100_000  # query-key pairs per d_k in the variance check
# Statistics of :func:`attnscale.stats.row_stats` that saturation averages, in its row order, and
# the keys' total weight (attnscale.columns.WEIGHT_COLUMNS' mass: 1 under softmax, less with a
# sink, anything in [0, n] under sigmoid).
SATURATION_STATS = (*MEAN_STATS, *named("mass"))
# Where row_stats' result holds the averaged statistics (all of SATURATION_STATS but the mass).
_SUMMED = [ROW_STATS_COLUMNS.index(key) for key in MEAN_STATS]


def check_time(what: str, seconds: float) -> None:
    """Refuse a request that would run longer than :data:`MAX_SECONDS` even on a fast machine
    (``seconds`` is that lower bound); shorter long runs show a progress bar instead."""
    if seconds > MAX_SECONDS:
        raise ConfigError(f"{what} would take at least {seconds / 86400:,.1f} days of compute "
                          f"(the limit is {MAX_SECONDS / 3600:.0f} h); split it into smaller runs.")


def sample_chi(dof: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Samples of ``chi(dof)``, the norm of a ``N(0, I_dof)`` vector, float64: ``chi^2(d)`` is
    ``2 Gamma(d / 2, 1)``.  torch's own gamma sampler, for the saturation experiments, whose rows
    (and the report's figures drawn from them) stay as they were; the variance check, which
    draws a gamma per pair, uses :func:`sample_gamma`."""
    alpha = torch.full(shape, dof / 2.0, dtype=torch.float64)
    return (2.0 * torch._standard_gamma(alpha, generator=gen)).sqrt_()


def sample_normal(size: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` standard normals as float64: torch's float32 normals (its vectorised Box-Muller
    on 24-bit uniforms, the same the saturation shortcut draws its logits from), widened.

    Their tails end at ``sqrt(-2 ln 2^-24) = 5.77`` (probability 8e-9 beyond, which moves the
    kurtosis of ``q.k`` by about 1e-6, a ten-thousandth of its standard error at 100k pairs),
    and they cost 2.4 ns a sample on one core against 14 ns for ``torch.randn`` in float64, a
    scalar loop (measured on an AVX-512 EPYC).
    """
    return torch.randn(size, generator=gen).double()


def sample_gamma(alpha: float, size: int, gen: torch.Generator) -> torch.Tensor:
    """``size`` samples of ``Gamma(alpha, 1)``, float64, by Marsaglia and Tsang's method.

    Marsaglia & Tsang 2000 ("A simple method for generating gamma variables", ACM TOMS 26):
    with ``d = alpha - 1/3`` and ``c = 1 / sqrt(9 d)``, draw ``x ~ N(0, 1)`` and ``u ~ U(0, 1)``,
    set ``v = (1 + c x)^3`` and accept ``d v`` when ``v > 0`` and
    ``ln u < x^2 / 2 + d - d v + d ln v``, or at once when ``u < 1 - 0.0331 x^4`` (their squeeze,
    which implies it and never passes ``v <= 0``); exact, and at least 95% of candidates are
    accepted for ``alpha >= 1``.  Below 1, ``Gamma(alpha) = Gamma(alpha + 1) U^(1/alpha)``.

    One candidate per sample is drawn and tested as whole tensors, the logarithms only where the
    squeeze fails, and the rejected samples are drawn again until none is left (with
    :func:`sample_normal`'s normals): about 12 ns a sample on one core, where
    ``torch._standard_gamma``'s per-sample loop takes 28 ns (measured on an AVX-512 EPYC) and
    dominated the variance check.
    """
    boost = alpha < 1.0
    a = alpha + 1.0 if boost else alpha
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(size, dtype=torch.float64)
    todo = None                                        # positions still to draw; None: all
    while todo is None or todo.numel():
        m = size if todo is None else todo.numel()
        x = sample_normal(m, gen)
        u = torch.rand(m, generator=gen, dtype=torch.float64)
        v = (x * c).add_(1.0)
        v = v * v * v
        x2 = x.square_()
        ok = u < (x2 * x2).mul_(-0.0331).add_(1.0)     # the squeeze
        hard = (~ok).nonzero().squeeze(1)
        if hard.numel():                               # the full test; NaN or -inf for v <= 0
            vh = v[hard]
            bound = vh.log().sub_(vh).add_(1.0).mul_(d).add_(x2[hard], alpha=0.5)
            ok[hard] = u[hard].log_() < bound
        v *= d
        if todo is None:
            out.copy_(v)
            todo = (~ok).nonzero().squeeze(1)
        else:
            out[todo[ok]] = v[ok]
            todo = todo[~ok]
    if boost:
        out *= torch.rand(size, generator=gen, dtype=torch.float64).neg_().add_(1.0) \
            .pow_(1.0 / alpha)
    return out


def kurtosis_dot(d_k: int) -> float:
    """Kurtosis (non-excess) of ``q.k`` for ``q, k ~ N(0, I_d)``: ``3 + 6 / d``.

    ``E[(q.k)^4] = 3 d^2 + 6 d`` because each term ``q_i k_i`` has fourth moment 9.
    """
    return 3.0 + 6.0 / d_k


def _chunk_sizes(total: int, per: int) -> Iterator[int]:
    """Split ``total`` into chunk sizes of at most ``per``."""
    for start in range(0, total, per):
        yield min(per, total - start)


def variance(d_ks: Sequence[int] = ESSAY_D_KS, pairs: int = ESSAY_PAIRS, seed: int = 0,
             *, show_progress: bool | None = None) -> list[dict]:
    """Empirical std of ``q.k`` against the prediction ``sqrt(d_k)``.

    Returns one row per ``d_k``: ``d_k, pairs, seed, std, predicted, rel_error, std_se``,
    ``std_ci95`` (the 95% CI of the std on the log scale, :func:`std_ci`, with the standard error
    accounting for the kurtosis ``3 + 6/d_k``), ``rel_error_ci95``, ``kurtosis_theory`` and
    ``kurtosis_measured``.  Memory does not grow with ``pairs`` (chunks of
    :data:`VARIANCE_CHUNK`); a progress bar counts the pairs.
    """
    d_ks = check_int_list("d_ks", d_ks, minimum=1)
    pairs = check_int("pairs", pairs, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    check_time(f"pairs={pairs} for {len(d_ks)} d_k", len(d_ks) * pairs * SECONDS_PER_PAIR)
    bar = progress(None, desc="variance", total=len(d_ks) * pairs, enabled=show_progress)
    with num_threads(MONTE_CARLO_THREADS), contextlib.closing(bar):
        advance = _locked(bar.update)
        return team_map(lambda d_k: _variance_row(d_k, pairs, seed, advance), d_ks,
                        _cell_workers(len(d_ks), 0))


def _variance_row(d_k: int, pairs: int, seed: int, advance) -> dict:
    """The row of :func:`variance` for one ``d_k``; ``advance(pairs)`` reports progress."""
    gen = rng(seed, "variance", d_k)
    moments = Moments()
    for size in _chunk_sizes(pairs, VARIANCE_CHUNK):
        # Exact shortcut: q.k = |q| g with |q| ~ chi(d_k), g ~ N(0, 1) independent.
        x = sample_gamma(d_k / 2.0, size, gen).mul_(2.0).sqrt_()
        x *= sample_normal(size, gen)
        moments.add(x)
        advance(size)
    m2, m4 = moments.central()
    std = math.sqrt(m2 * pairs / (pairs - 1))
    predicted = math.sqrt(d_k)
    se = std_se(std, pairs, kurtosis_dot(d_k))
    lo, hi = std_ci(std, se)
    return {
        "d_k": d_k, "pairs": pairs, "seed": seed, "std": std, "predicted": predicted,
        "rel_error": std / predicted - 1.0, "std_se": se, "std_ci95": [lo, hi],
        "rel_error_ci95": [lo / predicted - 1.0, hi / predicted - 1.0],
        "kurtosis_theory": kurtosis_dot(d_k),
        "kurtosis_measured": m4 / (m2 * m2) if m2 > 0 else math.nan,
    }


def _cell_workers(cells: int, need: int) -> int:
    """Threads to run ``cells`` independent cells on side by side: ``torch.get_num_threads()``
    (read before the sampling loops set their own count), at most one per cell, and no more
    working sets of ``need`` bytes than the memory budget holds.  Each cell draws from its own
    stream, so the rows do not depend on the number."""
    workers = min(torch.get_num_threads(), cells)
    budget = memory_budget()
    if budget is not None and need > 0:
        workers = min(workers, budget[0] // need)
    return max(1, workers)


def _locked(update):
    """``update`` behind a lock, for cells that report progress from several threads."""
    lock = threading.Lock()

    def locked(k: int) -> None:
        with lock:
            update(k)
    return locked


def sample_logits_direct(d_k: int, n: int, trials: int, gen: torch.Generator) -> torch.Tensor:
    """Raw logits ``q.k_i`` by sampling ``q`` and ``K`` explicitly (the essay's method).

    Returns a float64 tensor of shape (trials, n).  Memory is O(trials * n * d_k); chunk the caller.
    """
    q = torch.randn(trials, d_k, 1, generator=gen, dtype=torch.float64)     # (T, d, 1)
    k = torch.randn(trials, n, d_k, generator=gen, dtype=torch.float64)     # (T, n, d)
    return (k @ q)[..., 0]                                                  # (T, n)


def _accumulate(acc: dict[str, list[float]], z: torch.Tensor,
                mech: Mechanism | None = None) -> None:
    """Add the per-row statistics of logits ``z`` (T, n) to per-statistic sums and sums of
    squares (float64); under ``mech``'s normaliser (softmax without one)."""
    normaliser = "softmax" if mech is None else mech.normaliser
    sink = mech.sink_logits().detach() if normaliser == "sink" else None
    lam = mech.lam().detach() if normaliser == "differential" else None
    rows = row_stats(z, threads=1, normaliser=normaliser, sink=sink, lam=lam)     # (T, 7)
    values = torch.cat([rows[:, _SUMMED], row_mass(z, normaliser, sink, lam)[:, None]], dim=1)
    sums = torch.stack([values.sum(0), values.square().sum(0)]).tolist()         # (2, stats)
    for key, total, total_sq in zip(SATURATION_STATS, *sums):
        s = acc.setdefault(key, [0.0, 0.0])
        s[0] += total
        s[1] += total_sq


def summarise(acc: dict[str, list[float]], trials: int) -> dict[str, float]:
    """Mean and standard error of the mean from accumulated sums."""
    out = {}
    for key in SATURATION_STATS:
        out[f"{key}_mean"], out[f"{key}_se"] = mean_se_from_sums(*acc[key], trials)
    return out


@dataclass(frozen=True)
class ShortcutRule:
    """A mechanism's logits as a function of the raw dot product: ``cap(scale * q.k + offset)``
    under its normaliser (:func:`shortcut_rule`)."""
    mechanism: Mechanism
    scale: float
    cap: float | None
    offset: float

    @property
    def plain(self) -> bool:
        """``scale * q.k`` under a plain softmax: no cap, offset or other normaliser."""
        return self.mechanism.scale_only


def shortcut_rule(mech: Mechanism, n: int) -> ShortcutRule | None:
    """The rule of a mechanism whose logits are ``cap(scale * q.k + offset)`` of the raw dot
    product, ``q`` and ``k`` left as they are, with a constant ``scale`` and ``offset`` (its
    ``bilinear`` and ``per_key`` declarations, the base ``logits``, no logit bias), under any
    normaliser but the differential one (two maps); None for any other, and for a scale or
    offset that is not one number (per head, per row).

    The probe vectors are zero-stride views, read only for the scale: asking costs no memory
    whatever ``d_head`` is.
    """
    if not (mech.bilinear and mech.per_key and mech.logit_bias is None
            and mech.normaliser != "differential" and type(mech).logits is Mechanism.logits):
        return None
    probe = torch.zeros(()).expand(1, 1, 1, mech.d_head)
    with torch.no_grad():   # a learned scale (learned-temp, ssmax) is read, not trained
        _, _, scale = mech.prepare(probe, probe, n)
        offset = mech.offset(n) if mech.has_offset else 0.0
    if not all(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.numel() == 1)
               for v in (scale, offset)):
        return None
    return ShortcutRule(mech, float(scale), mech.cap, float(offset))


def check_mechanisms(mechanisms: object, param: str = "mechanisms") -> list[str]:
    """Names of registry mechanisms defined at init, distinct; a single name is allowed."""
    names = check_name_list(param, [mechanisms] if isinstance(mechanisms, str) else mechanisms)
    at_init = defined_at_init()
    for name in names:
        check_mechanism(name, param=param)
        if name not in at_init:
            raise ConfigError(
                f"mechanism {name!r} has no temperature at init without data: it lives in the "
                f"weights of W_Q and W_K, not in a rule on q and k. Mechanisms defined at init: "
                f"{', '.join(at_init)}.")
    return names


def _plan(d_ks: list[int], ns: list[int], trials: int, mechanisms: list[str]) -> dict:
    """How each (d_k, n) cell samples each mechanism: ``{(d_k, n): {method: {name: how}}}`` with
    ``how`` the shortcut's :class:`ShortcutRule` or the mechanism module, and the largest cell's
    working set (bytes).  Every cell's memory, and the time of
    the whole request, are checked before any mechanism is built at its ``d_k``."""
    plan, shortcut, seconds, largest = {}, {}, 0.0, 0
    for n in ns:
        # Which mechanisms the shortcut serves is a property of their rule, not of d_k.
        shortcut[n] = {m for m in mechanisms
                       if shortcut_rule(build_mechanism(m, 2, 1), n) is not None}
        for d_k in d_ks:
            need = max(SHORTCUT_BATCH_ELEMENTS, n) * BYTES_PER_LOGIT \
                + d_k * BYTES_PER_KEY_COORDINATE
            seconds += n * len(mechanisms) * SECONDS_PER_LOGIT
            if len(shortcut[n]) < len(mechanisms):
                need += max(DIRECT_CHUNK_ELEMENTS, n * d_k) * BYTES_PER_KEY_COORDINATE
                seconds += n * d_k * SECONDS_PER_KEY_COORDINATE
            check_memory(f"n={n} keys per query at d_k={d_k}", need)
            largest = max(largest, need)
    check_time(f"trials={trials} over {len(d_ks) * len(ns)} (d_k, n) cells", trials * seconds)
    for d_k in d_ks:
        modules = {m: build_mechanism(m, d_k, 1) for m in mechanisms}
        for n in ns:
            cell: dict[str, dict] = {}
            for name, mod in modules.items():
                rule = shortcut_rule(mod, n) if name in shortcut[n] else None
                method = ("chi2-shortcut" if rule is not None else
                          "rotation-frame" if mod.rotation_invariant else "direct")
                cell.setdefault(method, {})[name] = mod if rule is None else rule
            plan[d_k, n] = cell
    return plan, largest


def saturation(d_ks: Sequence[int] = ESSAY_D_KS, n: int | Sequence[int] = ESSAY_N,
               trials: int = ESSAY_TRIALS, seed: int = 0,
               mechanisms: Sequence[str] = ("scaled", "unscaled"), *,
               show_progress: bool | None = None) -> list[dict]:
    """Softmax saturation of attention over ``n`` random keys, per mechanism, ``d_k`` and ``n``.

    For each trial a fresh query and ``n`` fresh keys are drawn; the statistics of its attention
    row are averaged over ``trials``.  ``n`` is one key count or a list of them, as ``d_ks`` is a
    list of head sizes.  Mechanisms whose logits are a function of the raw ``q.k`` alone (a
    constant scale, offset and cap) use the chi-square shortcut; every other mechanism defined at
    init applies its own ``logits`` to queries and keys in a rotated frame (:func:`frame_qk`), or
    sampled directly when its rule is not rotation invariant.  Mechanisms sampled the same way share samples (common random numbers), so their
    differences are measured with less noise than their levels.

    Returns one row per (d_k, n, mechanism), in that nesting order, with ``mechanism, d_k, n,
    trials, seed, method`` and the mean and standard error of ``max_weight``, ``entropy`` (nats),
    ``jacobian_fro`` and ``logit_std``.  A repeated entry in any list is a ConfigError, and so
    is a request whose working set would not fit in memory; a progress bar counts the trials.
    """
    d_ks = check_int_list("d_ks", d_ks, minimum=1)
    ns = check_int_or_list("n", n, minimum=1)
    trials = check_int("trials", trials, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    mechanisms = check_mechanisms(mechanisms)
    plan, need = _plan(d_ks, ns, trials, mechanisms)
    bar = progress(None, desc="saturation", total=trials * sum(map(len, plan.values())),
                   enabled=show_progress)
    workers = _cell_workers(len(plan), need)
    with num_threads(MONTE_CARLO_THREADS), contextlib.closing(bar):
        advance = _locked(bar.update)
        cells = team_map(lambda item: _saturation_cell(*item[0], trials, seed, mechanisms,
                                                       item[1], advance),
                         plan.items(), workers)
    return [row for cell in cells for row in cell]


def _saturation_cell(d_k: int, n: int, trials: int, seed: int, mechanisms: list[str],
                     cell: dict, advance) -> list[dict]:
    """Rows of :func:`saturation` for one ``(d_k, n)``; ``advance(trials)`` reports progress."""
    acc: dict[str, dict[str, list[float]]] = {m: {} for m in mechanisms}
    method = {name: how for how, group in cell.items() for name in group}
    for how, group in cell.items():
        gen = rng(seed, "saturation", how, d_k, n)
        if how == "chi2-shortcut":
            _shortcut_stats(acc, group, d_k, n, trials, gen, advance)
        else:
            sample = (functools.partial(frame_qk, scratch={}) if how == "rotation-frame"
                      else _direct_qk)
            module_stats(acc, group, sample, d_k, n, trials, gen, advance)
    return [{"mechanism": name, "d_k": d_k, "n": n, "trials": trials, "seed": seed,
             "method": method[name], **summarise(acc[name], trials)} for name in mechanisms]


def _shortcut_stats(acc: dict, rules: dict[str, ShortcutRule], d_k: int, n: int, trials: int,
                    gen: torch.Generator, advance=lambda k: None) -> None:
    """Accumulate statistics of each rule's logits of raw ``q.k`` sampled by the chi-square
    shortcut (the same samples for every rule: common random numbers).

    The draws come in chunks of :data:`CHUNK_ELEMENTS` logits (the stream's unit: the samples
    do not depend on the batching below) and are scored a batch of :data:`SHORTCUT_BATCH_ELEMENTS`
    at a time, into two buffers kept over the batches.
    """
    per = max(1, CHUNK_ELEMENTS // n)                                 # trials per draw
    batch = max(1, SHORTCUT_BATCH_ELEMENTS // (n * per)) * per        # whole draws per batch
    raw_buf = torch.empty(min(batch, trials), n)                      # (T, n) float32
    scaled_buf = (torch.empty_like(raw_buf) if any(r.plain and r.scale != 1.0
                                                   for r in rules.values()) else None)
    for size in _chunk_sizes(trials, batch):
        raw = raw_buf[:size]
        start = 0
        for part in _chunk_sizes(size, per):
            # Exact shortcut: logits q.k_i = |q| g_i, |q| ~ chi(d_k), g ~ N(0, I_n).
            norm_q = sample_chi(d_k, (part, 1), gen).float()          # (part, 1)
            torch.randn(part, n, generator=gen, out=raw[start:start + part]).mul_(norm_q)
            start += part
        for name, rule in rules.items():
            if not rule.plain:   # the pipeline's own step from dot products to logits
                _accumulate(acc[name], temper(raw, rule.scale, rule.cap, rule.offset),
                            rule.mechanism)
            else:
                _accumulate(acc[name], raw if rule.scale == 1.0 else
                            torch.mul(raw, rule.scale, out=scaled_buf[:size]))
        advance(size)


def module_stats(acc: dict, modules: dict, sample, d_k: int, n: int, trials: int,
                  gen: torch.Generator, advance=lambda k: None, on_logits=None) -> None:
    """Accumulate statistics of each module's ``logits`` on q, k drawn by ``sample`` in chunks;
    ``on_logits(name, z)``, when given, also sees every chunk's logits."""
    for size in _chunk_sizes(trials, max(1, DIRECT_CHUNK_ELEMENTS // (n * d_k))):
        q, k = sample(d_k, n, size, gen)
        for name, mod in modules.items():
            with torch.no_grad():
                z = mod.logits(q, k)[:, 0, 0, :]                      # (T, n)
            _accumulate(acc[name], z, mod)
            if on_logits is not None:
                on_logits(name, z)
        advance(size)


def frame_qk(d_k: int, n: int, trials: int, gen: torch.Generator, *,
              scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys in a rotated frame, exact in distribution for rotation-invariant rules.

    Rotate each trial so that ``q = |q| e_1``; the keys' first coordinates are then i.i.d.
    ``N(0, 1)`` and the norm of their remaining ``d_k - 1`` coordinates is ``chi(d_k - 1)``, which
    can sit on ``e_2``.  Any rule invariant under a joint rotation of ``q`` and ``k`` (dot products,
    norms) sees exactly the distribution of ``N(0, I)`` queries and keys, at ``3`` random numbers
    per key instead of ``d_k``.  Returns q (T, 1, 1, d_k) and k (T, 1, n, d_k), float32.

    ``scratch`` (a dict the caller keeps over its chunks) reuses the last chunk's tensors when
    the shape is the same: only the coordinates written below differ between chunks, the rest
    stay 0, and a fresh multi-MB zero tensor per chunk costs a page fault per 4 KiB (a fifth of
    the report's entropy-vs-n section).  The tensors are then overwritten by the next chunk.
    """
    if scratch is not None and scratch.get("shape") == (trials, n, d_k):
        q, k = scratch["q"], scratch["k"]
    else:
        q = torch.zeros(trials, 1, 1, d_k)
        k = torch.zeros(trials, 1, n, d_k)
        if scratch is not None:
            scratch.update(shape=(trials, n, d_k), q=q, k=k)
    q[:, 0, 0, 0] = sample_chi(d_k, (trials,), gen)
    k[:, 0, :, 0] = torch.randn(trials, n, generator=gen)
    if d_k > 1:
        k[:, 0, :, 1] = sample_chi(d_k - 1, (trials, n), gen)
    return q, k


def _direct_qk(d_k: int, n: int, trials: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian queries (T, 1, 1, d_k) and keys (T, 1, n, d_k), float32, sampled coordinatewise."""
    q = torch.randn(trials, 1, 1, d_k, generator=gen)
    k = torch.randn(trials, 1, n, d_k, generator=gen)
    return q, k


def saturation_direct(d_k: int, n: int, trials: int, seed: int,
                      mechanism: str = "unscaled") -> dict[str, float]:
    """Reference for :func:`saturation`: statistics from explicitly sampled ``q`` and ``K``.

    Samples every coordinate of ``N(0, I)`` queries and keys (the essay's method) and applies the
    mechanism's own ``logits``; slow, and the yardstick for both shortcuts.
    """
    d_k = check_int("d_k", d_k, minimum=1)
    n = check_int("n", n, minimum=1)
    trials = check_int("trials", trials, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    name, = check_mechanisms([mechanism], "mechanism")
    check_memory(f"n={n} keys per query at d_k={d_k}",
                 max(DIRECT_CHUNK_ELEMENTS, n * d_k) * BYTES_PER_KEY_COORDINATE)
    check_time(f"trials={trials}", trials * n * d_k * SECONDS_PER_KEY_COORDINATE)
    acc: dict[str, dict[str, list[float]]] = {name: {}}
    with num_threads(MONTE_CARLO_THREADS):
        module_stats(acc, {name: build_mechanism(name, d_k, 1)}, _direct_qk, d_k, n, trials,
                      rng(seed, "saturation-reference", d_k, n))
    return summarise(acc[name], trials)


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
