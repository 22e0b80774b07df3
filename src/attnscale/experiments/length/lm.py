"""Length extrapolation of the small LM, and YaRN's temperature law measured.

One trial of the ``lm-length`` experiment trains the small LM
(:func:`attnscale.experiments.lm.train_lm`) at context ``seq_len`` (128), then, with no
fine-tuning:

* builds its RoPE tables for the longest evaluation context (:meth:`LM.set_rope`, same
  frequencies) and measures, on ``eval_windows`` validation windows of that length, the loss at
  every position (:func:`~attnscale.experiments.lm.train.loss_by_position`) and the attention
  entropy at every position, per layer (:func:`entropy_by_position`).  Under causality position
  i sees the same prefix in a window of any length, so the mean loss over the first L positions
  of these windows is the validation loss at context L;
* ``llama4-temp`` uses ``floor_scale = seq_len``: Llama 4's 8192 is the span of its chunked
  RoPE layers, so the temperature steps up where the trained context ends; ``logn`` likewise
  ``train_len = seq_len`` (Qwen's L is its training context);
* for ``selective``: the loss at the trained context under context pruning (Leviathan et al.
  2024, arXiv 2410.02703, Section 4), each query keeping at most ``seq_len / f`` keys (those
  selected least) for f in :data:`PRUNE_FACTORS` (f = 1: no pruning), the attention memory f
  times smaller, on the first ``seq_len`` positions of the same windows;
* for ``scaled`` (with ``yarn``, the default; other mechanisms skip it): extends the context
  by each s in ``yarn_factors`` with YaRN's NTK-by-parts frequencies (:func:`yarn_frequencies`),
  sweeps the multiplier m = √(1/t) that YaRN applies to q and k (logits times m²,
  :class:`Tempered`) over :data:`M_GRID`, evaluates the loss at context 128·s for each, and fits
  the minimising m (:func:`fit_minimum`);
* for ``mscale`` (DeepSeek's rule; with ``yarn``): trained at factor 1, where its logits are
  scaled's bit for bit (the same model as the scaled trial of its seed), then extended like the
  scaled model with YaRN's frequencies and, instead of the sweep, DeepSeek's softmax scale
  mscale(s, a)² for each a in :data:`MSCALE_ALL_DIMS` (DeepSeek-V2's 0.707 and DeepSeek-V3's 1,
  which is YaRN's own 0.1 ln s + 1): the two rules' losses on one model, exactly.

YaRN (Peng et al. 2023, arXiv 2309.00071, section 3.2 "NTK-by-parts" and 3.4): for a RoPE
dimension d of frequency θ_d and wavelength λ_d = 2π/θ_d, with r(d) = L / λ_d (L the trained
context) and the ramp γ(r) = 0 for r < α, 1 for r > β, (r − α)/(β − α) between, the new
frequency is h(θ_d) = (1 − γ(r(d))) θ_d / s + γ(r(d)) θ_d, with α = 1 and β = 32 for LLaMA.
Its temperature √(1/t) = 0.1 ln s + 1 is :func:`attnscale.mechanisms.yarn.yarn_m`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from attnscale.errors import ConfigError, parse_int_list
from attnscale.experiments.length.recall import lengths_text
from attnscale.experiments.lm.data import DATA_PARAM, Corpus, eval_windows
from attnscale.experiments.lm.model import LM, rope_frequencies
from attnscale.experiments.lm.train import LMRunConfig, loss_by_position, train_lm
from attnscale.io import json_safe
from attnscale.mechanisms import build_mechanism
from attnscale.mechanisms.base import Mechanism, Scale
from attnscale.mechanisms.mscale import DEEPSEEK_V2_MSCALE_ALL_DIM, DEEPSEEK_V3_MSCALE_ALL_DIM
from attnscale.mechanisms.yarn import yarn_m
from attnscale.measure.monitor.blocks import query_rows
from attnscale.pipeline import Observation, observe
from attnscale.stats import columns
from attnscale.experiments.registry import Param, experiment, params_from_dataclass

# Evaluation contexts, 1x to 8x the trained one; the model is trained at the first.
EVAL_LENGTHS = (128, 256, 512, 1024)
# YaRN's context-extension factors measured.
YARN_FACTORS = (2, 4, 8)
# YaRN's ramp bounds for LLaMA (Peng et al. 2023, section 3.2): alpha = 1, beta = 32.
YARN_ALPHA = 1.0
YARN_BETA = 32.0
# Multipliers m = sqrt(1/t) swept at evaluation (logits times m^2): 0.80, 0.85, ..., 1.60.
M_STEP = 0.05
M_GRID = tuple(round(0.8 + M_STEP * i, 2) for i in range(17))
# DeepSeek's mscale_all_dim values evaluated on the mscale trials: V2's 0.707 and V3's 1 (= YaRN's
# own rule, m = 0.1 ln s + 1).
MSCALE_ALL_DIMS = (DEEPSEEK_V2_MSCALE_ALL_DIM, DEEPSEEK_V3_MSCALE_ALL_DIM)
# The mechanisms whose trials extend the context with YaRN's frequencies: scaled (the sweep of
# √(1/t)) and mscale (DeepSeek's rule).
YARN_MECHANISMS = ("scaled", "mscale")
# Query-key scores per forward of entropy_by_position (B x H x N x N): bounds its batch of windows.
ENTROPY_FLOATS = 2 ** 24
# The section's mechanisms (stick-breaking and forgetting, which encode position themselves,
# without RoPE; mscale trained at factor 1, then extended by DeepSeek's rule).
MECHANISMS = ("scaled", "ssmax", "llama4-temp", "logn", "sink", "sigmoid", "softpick",
              "stick-breaking", "mscale", "forgetting", "selective", "differential")
# Selective attention's memory budgets: each query keeps seq_len / f keys (f = 1: all).  The
# paper's Table reports the same loss with 16x, 25x and 47x less memory at contexts 512-2048.
PRUNE_FACTORS = (1, 2, 4, 8, 16)
# Study defaults for the LM (the lm study's Wortsman recipe; more steps than its LR sweep).
LM_STEPS = 2000
LM_WINDOWS = 32

def yarn_frequencies(inv_freq: Tensor, factor: float, original_len: int, *,
                     alpha: float = YARN_ALPHA, beta: float = YARN_BETA) -> Tensor:
    """YaRN's NTK-by-parts frequencies h(θ_d) for extension factor s = ``factor`` of a model
    trained at context ``original_len``: (d/2,) float64 (see the module doc)."""
    theta = inv_freq.double()
    if factor <= 0 or not math.isfinite(factor):
        raise ConfigError(f"factor must be a positive number, got {factor!r}.")
    if not beta > alpha:
        raise ConfigError(f"beta must be above alpha, got alpha={alpha}, beta={beta}.")
    r = original_len * theta / (2 * math.pi)                     # L / λ_d
    gamma = ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    return (1.0 - gamma) * theta / factor + gamma * theta


class Tempered(Mechanism):
    """A mechanism's logits times ``m²``: YaRN's √(1/t) = m applied to both q and k.  Built at
    evaluation around a trained model's mechanism (not a registry entry)."""

    def __init__(self, base: Mechanism, m: float):
        super().__init__(base.d_head, base.n_heads)
        self.base, self.m = base, float(m)
        self.cap = base.cap

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        q, k, scale = self.base.prepare(q, k, n_keys)
        return q, k, scale * self.m ** 2


@contextlib.contextmanager
def pruned_to(model: LM, budget: int | None) -> Iterator[None]:
    """Every layer's selective attention keeps at most ``budget`` keys per query inside the
    block (its context pruning; None: every key)."""
    mechanisms = [block.attn.mechanism for block in model.blocks]
    try:
        for mech in mechanisms:
            mech.budget = budget
        yield
    finally:
        for mech in mechanisms:
            mech.budget = None


@contextlib.contextmanager
def swapped(model: LM, make) -> Iterator[None]:
    """Every layer's mechanism replaced by ``make(mechanism)`` inside the block (and put back)."""
    layers = [block.attn for block in model.blocks]
    originals = [attn.mechanism for attn in layers]
    try:
        for attn in layers:
            attn.mechanism = make(attn.mechanism)
        yield
    finally:
        for attn, mech in zip(layers, originals):
            attn.mechanism = mech


def tempered(model: LM, m: float):
    """Every layer's logits times m² inside the block (nothing changes for m = 1)."""
    return swapped(model, lambda mech: mech if m == 1.0 else Tempered(mech, m))


@torch.no_grad()
def entropy_by_position(model: LM, inputs: Tensor, *, batch_size: int) -> Tensor:
    """Mean attention entropy (nats) at each query position, per layer: (layers, N) float64.

    Every call of the one pipeline in the model is observed (:func:`attnscale.pipeline.observe`)
    and reduced to per-query row statistics the way the monitor does it: the kernel's own rows
    where the computation forms the logits (``Observation.request_rows``), else the monitor's
    blockwise rows (:func:`attnscale.measure.monitor.blocks.query_rows`) from the q, k, scale,
    cap, offset, mask and normaliser the pipeline reports (the entropy of each normaliser's own
    weights, :mod:`attnscale.stats`); their ``entropy`` column is averaged over windows and
    heads.  A call belongs to the layer whose attention module is running (a forward pre-hook
    on each block's ``attn``, removed on the way out).
    """
    n_layers = len(model.blocks)
    per_layer = [None] * n_layers
    running: list[int | None] = [None]

    def add(layer: int, rows: Tensor) -> None:
        h = columns(rows)["entropy"].sum((0, 1)).cpu() / rows.shape[1]          # (N,)
        per_layer[layer] = h if per_layer[layer] is None else per_layer[layer] + h

    def observer(obs: Observation) -> None:
        layer = running[0]
        if layer is None:  # a pipeline call outside the blocks' attention
            return
        if not obs.request_rows(lambda rows: add(layer, rows)):
            add(layer, query_rows(obs.q, obs.k, scale=obs.scale, cap=obs.cap, mask=obs.mask,
                                  causal=obs.causal, offset=obs.offset,
                                  normaliser=obs.normaliser, sink=obs.sink, lam=obs.lam))

    def enter(i: int):
        return lambda module, args: running.__setitem__(0, i)

    hooks = [block.attn.register_forward_pre_hook(enter(i)) for i, block in
             enumerate(model.blocks)]
    was_training = model.training
    model.eval()
    try:
        with observe(observer):
            for lo in range(0, len(inputs), batch_size):
                model(inputs[lo:lo + batch_size])
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return torch.stack(per_layer).double() / len(inputs)


def entropy_batch(n_heads: int, n: int) -> int:
    """Windows per forward in :func:`entropy_by_position`: its (B, H, N, N) logits stay within
    :data:`ENTROPY_FLOATS` floats (a few copies of 64 MiB at float32)."""
    return max(1, ENTROPY_FLOATS // (n_heads * n * n))


def fit_minimum(x: Sequence[float], y: Sequence[float]) -> dict:
    """The x minimising a sampled curve y(x): the vertex of the parabola through the grid minimum
    and its two neighbours (clipped to them); at an end of the grid, that end with
    ``edge = true``.  Non-finite y are skipped."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) == 0:
        return {"x": None, "y": None, "edge": None}
    i = int(np.argmin(y))
    if i == 0 or i == len(x) - 1:
        return {"x": float(x[i]), "y": float(y[i]), "edge": True}
    a, b, c = np.polyfit(x[i - 1:i + 2], y[i - 1:i + 2], 2)
    if a <= 0:
        return {"x": float(x[i]), "y": float(y[i]), "edge": False}
    vx = float(np.clip(-b / (2 * a), x[i - 1], x[i + 1]))
    return {"x": vx, "y": float(a * vx * vx + b * vx + c), "edge": False}


def _params() -> dict[str, Param]:
    params = params_from_dataclass(LMRunConfig)
    for key in ("max_seq_len", "device", "bf16", "monitor_every", "options"):
        params.pop(key)
    params["steps"] = Param(int, LM_STEPS)
    params["eval_windows"] = Param(int, LM_WINDOWS)
    params["lengths"] = Param(str, lengths_text(EVAL_LENGTHS))
    params["yarn"] = Param(bool, True)   # the YaRN sweep, on the scaled model's trials only
    params["yarn_factors"] = Param(str, ",".join(map(str, YARN_FACTORS)))
    params["data"] = DATA_PARAM          # stored absolute, pinned by its fingerprint
    return params


def _split(config: dict) -> tuple[LMRunConfig, list[int], list[int] | None]:
    config = dict(config)
    lengths = parse_int_list("lengths", config.pop("lengths"), minimum=1)
    factors = parse_int_list("yarn_factors", config.pop("yarn_factors"), minimum=2)
    # YaRN extends scaled (its sweep) and mscale (DeepSeek's rule) only.
    yarn = config.pop("yarn") and config["mechanism"] in YARN_MECHANISMS
    # The length rules start at the training context: llama4-temp's floor_scale, logn's train_len.
    options = {"llama4-temp": {"floor_scale": float(config["seq_len"])},
               "logn": {"train_len": int(config["seq_len"])}}.get(config["mechanism"], {})
    # Built and validated at the training context (the memory estimate is for training); the
    # trained model is extended to the evaluation lengths afterwards (LM.set_rope).
    run = LMRunConfig(**config, options=options, monitor_every=max(1, config["steps"] // 10))
    run.validated()
    return run, lengths, factors if yarn else None


def _check(config: dict) -> None:
    _split(config)


def mscale_losses(model: LM, corpus: Corpus, run: LMRunConfig, base: Tensor,
                  factors: Sequence[int]) -> list[dict]:
    """Validation loss at context ``seq_len``·s for each s in ``factors``, the model extended by
    YaRN's frequencies and run with DeepSeek's softmax scale (``mscale`` with that factor) for
    each mscale_all_dim in :data:`MSCALE_ALL_DIMS`: one row per (s, a) with the per-vector
    multiplier m (the logits times m²)."""
    rows = []
    for s in factors:
        n = run.seq_len * s
        model.set_rope(yarn_frequencies(base, s, run.seq_len), n)
        windows = eval_windows(corpus.val, run.eval_windows, n)
        for a in MSCALE_ALL_DIMS:
            def make(mech: Mechanism, s=s, a=a) -> Mechanism:
                return build_mechanism("mscale", mech.d_head, mech.n_heads, factor=float(s),
                                       mscale_all_dim=a)
            with swapped(model, make):
                loss = float(loss_by_position(model, windows, batch_size=run.batch_size).mean())
            rows.append({"factor": s, "length": n, "mscale_all_dim": a, "m": yarn_m(s, a),
                         "loss": loss})
    return rows


@experiment("lm-length", params=_params(), check=_check, threads=1)
def lm_length(**config) -> dict:
    """Train the small LM at ``seq_len``, then evaluate loss and attention entropy by position
    up to the longest of ``lengths``; with ``yarn``, the YaRN temperature sweep per factor."""
    run, lengths, factors = _split(config)
    out: dict = {}

    def extrapolate(model: LM, corpus: Corpus) -> None:
        longest = max(lengths)
        inputs, targets = eval_windows(corpus.val, run.eval_windows, longest)
        base = rope_frequencies(model.config.d_head)
        model.set_rope(base, longest)
        loss = loss_by_position(model, (inputs, targets), batch_size=run.batch_size)
        out["loss_by_position"] = loss.tolist()
        out["loss_at_length"] = [float(loss[:n].mean()) for n in lengths]
        out["entropy_by_position"] = entropy_by_position(
            model, inputs, batch_size=entropy_batch(model.config.n_heads, longest)).tolist()
        if run.mechanism == "selective":  # the same loss with less memory?
            short = (inputs[:, :run.seq_len], targets[:, :run.seq_len])
            out["pruning"] = []
            for f in PRUNE_FACTORS:
                with pruned_to(model, None if f == 1 else run.seq_len // f):
                    loss = loss_by_position(model, short, batch_size=run.batch_size).mean()
                out["pruning"].append({"memory_factor": f, "budget": run.seq_len // f,
                                       "loss": float(loss)})
        if factors is None:
            return
        if run.mechanism == "mscale":
            out["mscale"] = mscale_losses(model, corpus, run, base, factors)
            model.set_rope(base, run.seq_len)
            return
        out["yarn"] = []
        for s in factors:
            n = run.seq_len * s
            model.set_rope(yarn_frequencies(base, s, run.seq_len), n)
            windows = eval_windows(corpus.val, run.eval_windows, n)
            curve = []
            for m in M_GRID:
                with tempered(model, m):
                    curve.append(float(loss_by_position(model, windows,
                                                        batch_size=run.batch_size).mean()))
            out["yarn"].append({"factor": s, "length": n, "m": list(M_GRID), "loss": curve,
                                "fit": fit_minimum(M_GRID, curve)})
        model.set_rope(base, run.seq_len)

    record = train_lm(run, after=extrapolate)
    return json_safe({
        "options": dict(run.options), "lengths": lengths, "loss_init": record["loss_init"],
        "final_val_loss": record["final_val_loss"], "diverged": record["diverged"], **out})
