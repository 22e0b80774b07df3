"""Attention on one planted key as the number of keys grows: SSMax's "attention fading" argument.

Nakanishi 2025 ("Scalable-Softmax Is Superior for Attention", arXiv 2501.19399) argues that the
softmax weight of a key whose logit leads the rest by a fixed margin fades like ``1/n`` under a
fixed temperature, ``e^m / (e^m + n - 1)``, but stays near 1 when the logits are multiplied by
``s ln n`` (its Figure 1: one logit +3, all others -2, s = 0.43).

Here the rest are not all equal but random: ``q, k_1..k_n ~ N(0, I_{d_k})`` as in
:mod:`attnscale.measure.montecarlo`, sampled in its rotated frame (exact for rotation-invariant
rules), and key 0 is planted so that its raw dot product is ``q.k_0 = margin * sqrt(d_k)``: in the
units of the scaled logits ``q.k / sqrt(d_k)``, whose other entries have mean 0 and standard
deviation ``|q| / sqrt(d_k) ~ 1``, the planted key leads the others' mean by ``margin``.  Its
other coordinates are drawn like every key's.  Each mechanism's own ``logits`` turns q and k into
logits, so the rule measured is the registry's; statistics come from
:func:`attnscale.stats.row_stats` (through montecarlo's accumulator), and the planted key's weight is ``exp(z_0 - logsumexp(z))``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch

from attnscale.errors import ConfigError, check_float, check_int, check_int_or_list
from attnscale.measure.montecarlo import (
    BYTES_PER_KEY_COORDINATE, DIRECT_CHUNK_ELEMENTS, check_mechanisms, frame_qk, module_stats,
    summarise,
)
from attnscale.memory import check_memory
from attnscale.mechanisms import MECHANISMS, build_mechanism
from attnscale.progress import progress
from attnscale.rng import rng
from attnscale.stats import mean_se

# The planted key's lead over the others' mean, in units of the scaled logit q.k / sqrt(d_k):
# Nakanishi 2025, Figure 1 plants +3 among logits of -2, a lead of 5.
PLANTED_MARGIN = 5.0


def planted_frame_qk(d_k: int, n: int, trials: int, margin: float, gen: torch.Generator, *,
                     scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated-frame queries (T, 1, 1, d_k) and keys (T, 1, n, d_k), float32, with key 0 planted
    so that ``q.k_0 = margin * sqrt(d_k)`` (see the module doc); ``scratch`` as in
    :func:`attnscale.measure.montecarlo.frame_qk`."""
    q, k = frame_qk(d_k, n, trials, gen, scratch=scratch)
    # q = |q| e_1, so the raw dot product is |q| times key 0's first coordinate.
    k[:, 0, 0, 0] = margin * math.sqrt(d_k) / q[:, 0, 0, 0]
    return q, k


def planted_weight(z: torch.Tensor) -> torch.Tensor:
    """Softmax weight of key 0 in each row of logits ``z`` (..., n), in ``z``'s dtype."""
    return torch.exp(z[..., 0] - torch.logsumexp(z, dim=-1))


def planted_key(ns: int | Sequence[int], d_k: int = 64, trials: int = 200, seed: int = 0,
                mechanisms: Sequence[str] = ("scaled", "ssmax"), margin: float = PLANTED_MARGIN,
                *, show_progress: bool | None = None) -> list[dict]:
    """Weight on one planted key among ``n`` random keys, per mechanism and ``n``.

    Returns one row per (n, mechanism), in that nesting order, with ``mechanism, d_k, n, trials,
    seed, margin`` and the mean and standard error over trials of ``planted_weight`` (the planted
    key's softmax weight) and of the statistics of :func:`attnscale.measure.montecarlo.saturation`
    (``max_weight``, ``entropy`` in nats, ...).  Mechanisms share samples
    (common random numbers), drawn from ``attnscale.rng.rng(seed, "planted", d_k, n)``.  Only
    rotation-invariant mechanisms defined at init are accepted (the frame is exact for them); a
    repeated entry, or a request too large for memory, is a ConfigError.
    """
    ns = check_int_or_list("n", ns, minimum=2)
    d_k = check_int("d_k", d_k, minimum=2)
    trials = check_int("trials", trials, minimum=2)
    seed = check_int("seed", seed, minimum=0)
    margin = check_float("margin", margin)
    names = check_mechanisms(mechanisms)
    for name in names:
        if not MECHANISMS[name].rotation_invariant:
            raise ConfigError(f"mechanisms: {name!r} is not rotation invariant, so the planted-key "
                              "frame does not sample it exactly; choose a rotation-invariant "
                              "mechanism.")
    for n in ns:
        check_memory(f"n={n} keys per query at d_k={d_k}",
                     max(DIRECT_CHUNK_ELEMENTS, n * d_k) * BYTES_PER_KEY_COORDINATE)
    modules = {name: build_mechanism(name, d_k, 1) for name in names}
    bar = progress(None, desc="planted key", total=trials * len(ns), enabled=show_progress)
    rows = []
    with contextlib.closing(bar), torch.no_grad():
        for n in ns:
            acc: dict[str, dict] = {name: {} for name in names}
            weights: dict[str, list[torch.Tensor]] = {name: [] for name in names}
            scratch: dict = {}
            module_stats(acc, modules,
                          lambda d, n_, t, g: planted_frame_qk(d, n_, t, margin, g,
                                                               scratch=scratch),
                          d_k, n, trials, rng(seed, "planted", d_k, n), advance=bar.update,
                          on_logits=lambda name, z: weights[name].append(
                              planted_weight(z).double()))
            for name in names:
                mean, se = mean_se(torch.cat(weights[name]))
                rows.append({"mechanism": name, "d_k": d_k, "n": n, "trials": trials,
                             "seed": seed, "margin": margin, "planted_weight_mean": mean,
                             "planted_weight_se": se, **summarise(acc[name], trials)})
    return rows
