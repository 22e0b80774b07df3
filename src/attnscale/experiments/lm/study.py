"""The small-LM stability study's building blocks: variants, the grid, and per-run measures.

A run record is what :func:`attnscale.experiments.lm.train_lm` returns (its ``config`` inside), so
these work on a list of records from any source: a loop of ``train_lm`` calls or a sweep store.
A *variant* is a mechanism with its options, named ``qk-layernorm`` or
``qk-layernorm(divisor=False)``: the registry key, plus the options when there are any.

LR sensitivity (Wortsman et al. 2023, arXiv 2309.14322, section 2.2)::

    sensitivity = E_{η in grid} [ min(ℓ(η), ℓ0) − ℓ* ],   ℓ* = min_{η in grid} ℓ(η)

with ℓ(η) the final validation loss at peak learning rate η, ℓ0 the loss at init, and a run whose
loss is not finite counted at ℓ0.  It is computed per (variant, width, seed) over the learning
rates present (the study's tables, claims and figures are :mod:`attnscale.study.lm`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from attnscale.mechanisms import (MECHANISMS, canonical_options, check_mechanism,  # noqa: F401
                                  parse_variant, variant_text)

# Wortsman et al. 2023's learning-rate grid (Figure 1).
WORTSMAN_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
# The default study: these variants x WORTSMAN_LRS x DEFAULT_WIDTHS x DEFAULT_SEEDS.
DEFAULT_VARIANTS = ("scaled", "unscaled", "qk-layernorm", "qk-layernorm(divisor=False)",
                    "qk-rmsnorm", "cosine", "softcap", "sigma-reparam", "mup", "sink", "sigmoid",
                    "gated", "adaptive-temp",
                    # the normalisers without sinks, DeepSeek-V3's softmax scale (its YaRN
                    # factor 40) and OLMo 2's q/k norm over the whole projection
                    "softpick", "stick-breaking", "mscale(factor=40.0)", "qk-rmsnorm(over=model)",
                    # a forget gate (FoX), selective attention and differential attention
                    "forgetting", "selective", "differential")
DEFAULT_WIDTHS = (64, 128)
DEFAULT_SEEDS = (0, 1)
# The default study also runs these variants at WIDE_WIDTHS on WIDE_SEEDS, so that LR sensitivity
# vs width has three points for the variants Wortsman et al. (2023, Fig. 1) contrast: the default
# grows more sensitive with width, qk-layernorm does not.
WIDE_VARIANTS = ("scaled", "qk-layernorm", "softcap", "sink")
WIDE_WIDTHS = (256,)
WIDE_SEEDS = (0,)
# The attention-sink runs: these variants x SINK_SEEDS, at SINK_WIDTH and SINK_LR for SINK_STEPS
# (four times the LR sweep's: sinks emerge with training, Gu et al. 2024), each recording every
# head's mean weight on the first key.  scaled has softmax sinks to remove; softpick is the claim
# (Zuhri et al. 2025); sink gives softmax a sink of its own, sigmoid and stick-breaking have no
# row sum to keep.
SINK_VARIANTS = ("scaled", "softpick", "sink", "sigmoid", "stick-breaking")
SINK_SEEDS = (0, 1)
SINK_WIDTH = 128
SINK_LR = 1e-2
SINK_STEPS = 2000
# A head sinks when its mean attention weight on the first key exceeds this (Gu et al. 2024,
# "When Attention Sink Emerges in Language Models", arXiv 2410.10781: ε = 0.3; the softpick paper
# measures its sink rate so).
SINK_THRESHOLD = 0.3
# --quick: these x WORTSMAN_LRS x the smallest width x one seed.
QUICK_VARIANTS = ("scaled", "unscaled", "qk-layernorm", "softcap")


def variant(record: dict) -> str:
    """The mechanism and its options: ``softcap`` or ``softcap(cap=30)``."""
    c = record["config"]
    return variant_text(c["mechanism"], c.get("options"))


def plotted_loss(record: dict) -> float:
    """min(ℓ, ℓ0), a non-finite ℓ counting as ℓ0: the loss Figure 1 draws and the sensitivity
    averages (a diverged run sits at the loss at init)."""
    loss, init = record["final_val_loss"], record["loss_init"]
    return init if loss is None or not math.isfinite(loss) else min(loss, init)


def lr_sensitivity(losses: Sequence[float | None], loss_init: float) -> float | None:
    """E over the grid of [min(ℓ(η), ℓ0) − ℓ*], ℓ* the best finite ℓ(η); None when no learning
    rate got below ℓ0 (nothing learned, so ℓ* is undefined)."""
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    if not finite or min(finite) >= loss_init:
        return None
    best = min(finite)
    clipped = [loss_init if x is None or not math.isfinite(x) else min(x, loss_init)
               for x in losses]
    return sum(x - best for x in clipped) / len(clipped)


def peak_logit(record: dict) -> float | None:
    """The largest max |attention logit| over layers and monitored steps of a run."""
    values = [v for row in record["trace"] for v in row["attn_logit_max"]
              if v is not None and math.isfinite(v)]
    return max(values, default=None)


def normalises_qk(mechanism: str, options: dict | None = None) -> bool:
    """Whether a mechanism normalises q and k (its logits do not change when q and k are
    scaled): the ``normalises_qk`` it declares, so no list of names is kept."""
    return bool(MECHANISMS[check_mechanism(mechanism)].normalises_qk)


def sink_rate(record: dict) -> float | None:
    """The share of a run's heads (over layers) whose mean weight on the first key exceeds
    :data:`SINK_THRESHOLD` (Gu et al. 2024's Sink_1); None for a run without the record (a
    diverged run, or one recorded before runs kept it)."""
    weights = record.get("first_key_weight")
    if not weights:
        return None
    heads = [w for layer in weights for w in layer]
    return sum(w > SINK_THRESHOLD for w in heads) / len(heads)
