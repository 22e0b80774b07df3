"""Length generalisation on the recall task: train at 16 pairs, evaluate up to 512, no retraining.

One trial of the ``recall-length`` experiment is one (mechanism, seed): a recall model trained by
:func:`attnscale.experiments.recall.trainer.train_runs` at ``pairs`` key-value pairs, then scored
by :func:`~attnscale.experiments.recall.trainer.evaluate` (held-out accuracy and the attention
statistics of :mod:`attnscale.stats`) on held-out sets of every length in ``lengths``.  The
recall model has no positions (a sequence is a set of pairs), so any pair count fits it; what
bounds the length is the key vocabulary (keys are distinct within a sequence), hence the study's
own config :data:`LENGTH_CONFIG` with 512 keys; the essay-demo config is unchanged.

``llama4-temp`` gets ``floor_scale`` scaled to the task: Llama 4's 8192 is its
``attention_chunk_size`` (HF ``Llama4TextConfig``), the span its RoPE layers attend, so the
temperature takes its first step where a local layer's context ends.  Here that span is the
training length, so ``floor_scale = pairs`` (16) unless given: τ(n) = 0.1 ln(1 + ⌊n/16⌋) + 1
is 1.07 at 16 keys and 1.35 at 512.  ``logn`` gets the training length as its ``train_len`` (Qwen's
L is its training context), so max(1, log_16 n) is 1 up to 16 keys and 2.25 at 512.
"""

from __future__ import annotations

from dataclasses import replace

from attnscale.columns import named
from attnscale.errors import ConfigError, parse_int_list
from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.task import eval_set
from attnscale.experiments.recall.trainer import TRAIN_THREADS, evaluate, train_runs
from attnscale.experiments.registry import Param, experiment, params_from_dataclass
from attnscale.io import json_safe

# The pair counts the study evaluates, 1x to 32x the trained count; trained at the first.
EVAL_PAIRS = (16, 32, 64, 128, 256, 512)
# The length study's config: the essay's demo with a key vocabulary for 512 distinct keys.
LENGTH_CONFIG = RecallConfig(n_keys=max(EVAL_PAIRS))
# The mechanisms compared: the fixed temperatures, the length-aware ones (ssmax, llama4-temp,
# logn), the other normalisers (sink, sigmoid) and the normalised and capped ones, in the
# figure's order; then the rectified normalisers (softpick, stick-breaking), the logit biases
# (forgetting, selective) and differential attention, appended so that a store holding the
# others grows by them.
MECHANISMS = ("scaled", "unscaled", "ssmax", "llama4-temp", "logn", "sink", "sigmoid", "qknorm",
              "cosine", "softcap", "learned-temp", "softpick", "stick-breaking", "forgetting",
              "selective", "differential")
# Statistics kept per length, from trainer.evaluate.
STATS = ("accuracy", *named("entropy", "max_weight"))


def lengths_text(lengths) -> str:
    """``16,32,...``: how a list of pair counts is held in a trial's config (a string param)."""
    return ",".join(str(n) for n in lengths)


def mechanism_options(mechanism: str, pairs: int, floor_scale: float | None) -> dict:
    """The mechanism's options in this study: llama4-temp's floor_scale (default: ``pairs``),
    logn's train_len (``pairs``, the training length)."""
    if mechanism == "llama4-temp":
        return {"floor_scale": float(pairs if floor_scale is None else floor_scale)}
    if floor_scale is not None:
        raise ConfigError(f"floor_scale applies to llama4-temp only, not {mechanism!r}.")
    if mechanism == "logn":
        return {"train_len": pairs}
    return {}


def _params() -> dict[str, Param]:
    params = params_from_dataclass(RecallConfig)
    params.pop("options")  # set by mechanism_options, recorded in the result
    for key, p in params.items():
        params[key] = Param(p.type, getattr(LENGTH_CONFIG, key), p.optional)
    params["lengths"] = Param(str, lengths_text(EVAL_PAIRS))
    params["floor_scale"] = Param(float, None, optional=True)
    return params


def _split(config: dict) -> tuple[RecallConfig, list[int]]:
    config = dict(config)
    lengths = parse_int_list("lengths", config.pop("lengths"), minimum=2)
    floor_scale = config.pop("floor_scale")
    options = mechanism_options(config["mechanism"], config["pairs"], floor_scale)
    base = RecallConfig(**config, options=options).validated()
    if max(lengths) > base.n_keys:
        raise ConfigError(f"lengths go up to {max(lengths)} pairs but n_keys is {base.n_keys}: "
                          "keys are distinct within a sequence, so n_keys must be >= every length.")
    return base, lengths


def _check(config: dict) -> None:
    _split(config)


@experiment("recall-length", params=_params(), check=_check, threads=TRAIN_THREADS)
def recall_length(**config) -> dict:
    """Train one recall model at ``pairs`` pairs, then evaluate it at every pair count in
    ``lengths`` on held-out sets of ``eval_size`` sequences: accuracy, attention entropy (nats)
    and max weight per length, plus the training run's own measurements."""
    base, lengths = _split(config)
    by_length: dict[int, dict] = {}

    def at_lengths(model) -> None:
        for n in lengths:
            (stats,) = evaluate(model, [eval_set(replace(base, pairs=n))])
            by_length[n] = stats

    (run,) = train_runs([base], show_progress=False, after=at_lengths)
    return json_safe({
        "options": dict(base.options), "lengths": lengths,
        **{stat: [by_length[n][stat] for n in lengths] for stat in STATS},
        "final_loss": run.final_loss, "steps_to_loss_0_1": run.steps_to_loss_0_1,
        "train_accuracy": run.eval_accuracy})
