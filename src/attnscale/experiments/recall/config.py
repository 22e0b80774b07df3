"""One frozen dataclass for an associative-recall run, and its validation.

The defaults are the essay's training demo ("A Training Demo"): 16 key-value pairs over 32 key and
32 value tokens, one attention head with d_k = 256, Adam at 3e-4.  What the essay leaves open is
chosen here and documented on the field:

* ``d_model = 256`` (equal to d_k, so W_Q and W_K are square; the essay gives only d_k);
* ``batch_size = 96`` and ``steps = 1200``.  The essay gives neither.  Measured over seeds 0-2
  (``attnscale compare --seed 0,1,2 --batch-size B``), the batch sets how hard the unscaled run
  struggles: at 32 it is 3-6x slower than scaled and one seed never reaches loss 0.1; at 64 it is
  3-4x slower with a plateau near 0.3 in most seeds; at 128 it is ~2x slower with no plateau.
  96 sits at the essay's numbers: ~2-2.5x more steps to each milestone, a step-0 W_Q gradient ratio
  of ~9x, a stall near 0.25 in some seeds, 100% accuracy for both.  1200 steps is about 1.5x what the
  slowest default seed needs to reach 0.1, so both runs converge;
* trainable embeddings and no biases (a single head, nothing else to learn with).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from attnscale.errors import ConfigError, check_choice, check_float, check_int, check_unique
from attnscale.mechanisms import check_mechanism

OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class RecallConfig:
    mechanism: str = "scaled"        # registry key of the attention-temperature mechanism
    seed: int = 0                    # seeds the init and the training stream (eval has its own)
    d_k: int = 256                   # head size of W_Q, W_K, W_V (d_model -> d_k)
    d_model: int = 256               # embedding width
    pairs: int = 16                  # key-value pairs per sequence
    n_keys: int = 32                 # key vocabulary; keys are drawn without replacement
    n_values: int = 32               # value vocabulary = readout classes; chance is 1/n_values
    steps: int = 1200                # optimiser steps
    batch_size: int = 96             # sequences per step
    lr: float = 3e-4                 # learning rate of every parameter (times qk_lr_mult on W_Q, W_K)
    optimizer: str = "adam"          # "adam" (torch defaults: betas 0.9, 0.999, eps 1e-8) or "sgd"
    qk_lr_mult: float = 1.0          # learning-rate multiplier on W_Q and W_K (sqrt(d_k): SGD tracking)
    eval_size: int = 2000            # held-out sequences scored for accuracy after training
    log_every: int = 10              # steps between attention-statistics records
    options: Mapping[str, Any] = field(default_factory=dict)  # the mechanism's own options

    def validated(self) -> RecallConfig:
        """Return self after checking every field; bad values raise a one-line ConfigError."""
        for name in ("d_k", "d_model", "pairs", "n_keys", "n_values", "steps", "batch_size",
                     "eval_size", "log_every"):
            check_int(name.replace("_", "-"), getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_float("lr", self.lr, positive=True)
        check_float("qk-lr-mult", self.qk_lr_mult, positive=True)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.pairs > self.n_keys:
            raise ConfigError(f"pairs must be <= n-keys (keys are drawn without replacement), "
                              f"got pairs={self.pairs} > n-keys={self.n_keys}.")
        if self.pairs < 2:
            raise ConfigError(f"pairs must be >= 2 for attention to have a choice, got {self.pairs}.")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"options must be a mapping of option names to values, "
                              f"got {self.options!r}.")
        check_mechanism(self.mechanism, self.options, param="mechanism")  # values: when built
        return self


# Fields that may differ between runs trained together as one batched model.
PER_RUN_FIELDS = ("mechanism", "seed", "options")


def shared_key(config: RecallConfig) -> tuple:
    """Everything but :data:`PER_RUN_FIELDS`: runs with equal keys can share one batched model."""
    return tuple(getattr(config, f.name) for f in fields(config) if f.name not in PER_RUN_FIELDS)


def expand_grid(base: RecallConfig, **grid) -> list[RecallConfig]:
    """Configs for every combination of ``grid`` values, e.g.
    ``expand_grid(c, mechanism=[...], seed=[0, 1])`` (in-process; a grid on the sweep engine is
    :class:`attnscale.sweep.grid.SweepSpec`).

    A value listed twice is a :class:`ConfigError`: it would train (and count) one run twice."""
    configs = [base]
    for name, values in grid.items():
        values = check_unique(name, list(values))
        configs = [replace(c, **{name: v}) for c in configs for v in values]
    return configs




def sqrt_dk(config: RecallConfig) -> float:
    """sqrt(d_k): the factor the 1/sqrt(d_k) divisor removes from dz/dW_Q (the essay's 16)."""
    return math.sqrt(config.d_k)
