"""One small-LM training run with Wortsman et al.'s recipe, measured for the stability study.

The recipe (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322, section 2.1), each constant defined once below:

* AdamW, β = (0.9, 0.95), ε = 1e-8;
* independent weight decay 1e-4: θ ← θ − s_t λ θ, decoupled from the peak learning rate η and
  following only the schedule's factor s_t = η_t / η (Loshchilov & Hutter's decoupled decay, which
  the paper calls "independent").  torch's AdamW decays by η_t · wd, so it is given
  ``weight_decay = λ / η``; norm gains and the mechanisms' own parameters are not decayed;
* linear warm-up over the first :data:`WARMUP_FRACTION` of the steps, then cosine decay to
  :data:`LR_MIN`;
* gradient clipping at global norm 1.0 and z-loss 1e-4 · log²Z (Chowdhery et al. 2022, PaLM).

Mechanisms that act between steps run for real: qk-clip's clip follows every optimizer step
(:func:`attnscale.guard` installs it as a step post-hook).

A run records its full config, its training throughput (``timing``: tokens per second and seconds
of training, the one part of a record that depends on the machine), the training loss per step (cross-entropy, nats per byte, without
the z-loss term), the gradient norm per step (before clipping), the validation loss at init and
at the end (nats and bits per byte), and every :attr:`LMRunConfig.monitor_every` steps, per layer,
the max |attention logit| (after the mechanism: what enters the softmax), the min and mean over
heads of the mean attention entropy (nats), read by :func:`attnscale.guard`, plus the max |output logit|;
and, for the trained model on the validation windows, each head's mean weight on the first key
(``first_key_weight``, per layer and head, under the mechanism's normaliser): what the
attention-sink rate counts (Gu et al. 2024, arXiv 2410.10781).

A run *diverges* when a training loss is not finite (training stops there) or when its final
validation loss is above its loss at init.  That is a result (``diverged: true``), never an error.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.columns import named
from attnscale.errors import ConfigError, check_float, check_int
from attnscale.experiments.lm.data import Corpus, eval_windows, load_corpus, sample_batch
from attnscale.experiments.lm.model import LM, MLP_RATIO, VOCAB_SIZE, LMConfig, build_lm
from attnscale.io import json_safe
from attnscale.guard import guard
from attnscale.measure.monitor.blocks import first_key_weight
from attnscale.pipeline import observe
from attnscale.memory import check_memory
from attnscale.rng import rng
from attnscale.workers import check_device, num_threads

# --- Wortsman et al. 2023 (arXiv 2309.14322), section 2.1 ----------------------------------------
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 1e-4      # independent: θ ← θ − s_t λ θ, not scaled by the peak learning rate
GRAD_CLIP = 1.0          # global gradient-norm clipping threshold
Z_LOSS = 1e-4            # coefficient of log²Z, Z = Σ exp(output logits) (PaLM's z-loss)
LR_MIN = 1e-5            # the cosine decay ends here (absolute)
WARMUP_FRACTION = 0.05   # warm-up 5e3 of 1e5 steps, kept as a fraction for short runs
# nats -> bits
LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class LMRunConfig:
    """Everything one LM training run depends on (the model's shape is its
    :class:`~attnscale.experiments.lm.model.LMConfig`, built by :meth:`model_config`); its JSON
    form is the ``config`` of the run record."""

    mechanism: str = "scaled"          # registry key of the attention-temperature mechanism
    options: Mapping[str, Any] = field(default_factory=dict)  # the mechanism's own options
    lr: float = 1e-3                   # peak learning rate η
    d_model: int = 64                  # width
    n_layers: int = 2                  # transformer blocks
    n_heads: int = 2                   # attention heads (d_head = d_model / n_heads)
    seq_len: int = 128                 # training and validation context, bytes
    max_seq_len: int | None = None     # context the model is built for (None: seq_len)
    batch_size: int = 16               # sequences per step
    steps: int = 500                   # optimiser steps
    seed: int = 0                      # model init and batch order
    eval_windows: int = 64             # validation windows (evenly spaced, the same in every run)
    monitor_every: int = 10            # attention statistics every k steps (steps 0, k, 2k, ...)
    data: str | None = None            # text file or folder; None: the stdlib's .py files
    device: str = "cpu"                # torch device
    bf16: bool = False                 # bfloat16 autocast for the forward (weights stay float32)
    threads: int = 1                   # CPU intra-op threads: results depend on it, so it is config

    def validated(self) -> LMRunConfig:
        """Return self after checking every field; bad values raise a one-line ConfigError."""
        for name in ("seq_len", "batch_size", "steps", "eval_windows", "monitor_every",
                     "threads"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_float("lr", self.lr, positive=True)
        if self.max_seq_len is not None and self.seq_len > check_int(
                "max_seq_len", self.max_seq_len, minimum=1):
            raise ConfigError(f"seq_len {self.seq_len} is above the model's max_seq_len "
                              f"{self.max_seq_len}.")
        if self.data == "":
            raise ConfigError("data must be a path to a text file or folder, got ''.")
        if not isinstance(self.bf16, bool):
            raise ConfigError(f"bf16 must be true or false, got {self.bf16!r}.")
        if not isinstance(self.device, str):  # the record's JSON holds it as text
            raise ConfigError(f"device must be a string such as 'cpu' or 'cuda:0', got "
                              f"{self.device!r}.")
        check_device("device", self.device)
        self.model_config().validated()
        check_memory(f"this run (width {self.d_model}, {self.n_layers} layers, batch "
                     f"{self.batch_size} x {self.seq_len})", training_bytes(self), self.device,
                     hint="reduce the width, depth, batch or sequence length")
        return self

    def model_config(self) -> LMConfig:
        return LMConfig(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                        max_seq_len=self.max_seq_len or self.seq_len, mechanism=self.mechanism,
                        options=dict(self.options))

    def to_json(self) -> dict:
        out = asdict(self)
        out["options"] = dict(self.options)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LMRunConfig:
        """The config of a JSON dict; an unknown key is a ConfigError that names it."""
        names = {f.name for f in fields(cls)}
        unknown = [k for k in obj if k not in names]
        if unknown:
            raise ConfigError(f"unknown lm config key(s) {', '.join(map(repr, unknown))}; "
                              f"keys: {', '.join(sorted(names))}.")
        return cls(**obj)


# Floats held per parameter in training: weight, gradient and AdamW's two moments.
FLOATS_PER_PARAM = 4
# Activation floats kept for the backward pass per token, per layer and unit of width (LayerNorms,
# q, k, v, attention output, the 4x MLP before and after GELU, residuals): a generous count.
ACTIVATION_FLOATS = 40




def training_bytes(config: LMRunConfig) -> int:
    """An upper estimate of a run's training memory in bytes (float32): parameters with their
    gradients and Adam moments, stored activations, and the (B, N, 256) logits with their
    gradient.  The attention kernels keep O(N · block) per head, not (N, N)."""
    d, layers = config.d_model, config.n_layers
    params = 256 * d + layers * (4 + 2 * MLP_RATIO) * d * d
    tokens = config.batch_size * config.seq_len
    floats = (FLOATS_PER_PARAM * params + ACTIVATION_FLOATS * tokens * d * layers
              + 3 * tokens * VOCAB_SIZE)
    return 4 * floats


def recipe() -> dict:
    """The recipe's constants, recorded with every run."""
    return {"optimizer": "adamw", "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
            "weight_decay": WEIGHT_DECAY, "weight_decay_kind": "independent",
            "grad_clip": GRAD_CLIP, "z_loss": Z_LOSS, "lr_min": LR_MIN,
            "warmup_fraction": WARMUP_FRACTION, "schedule": "linear warmup, cosine decay"}


def lr_factor(step: int, steps: int, lr: float) -> float:
    """s_t = η_t / η: linear warm-up from 0, then cosine decay from 1 to LR_MIN / η."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    floor = min(1.0, LR_MIN / lr)
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))  # 1 at the last step
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lm_loss(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(cross-entropy, cross-entropy + Z_LOSS · mean log²Z) of logits (B, N, V), targets (B, N)."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)                                  # (B, N)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return ce, ce + Z_LOSS * log_z.square().mean()


def _optimizer(model: LM, config: LMRunConfig) -> torch.optim.AdamW:
    skip = model.no_weight_decay()
    decay = [p for n, p in model.named_parameters() if n not in skip]
    keep = [p for n, p in model.named_parameters() if n in skip]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY / config.lr},  # η_t·λ/η = s_t·λ
              {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                             foreach=True)


def _autocast(device: str, bf16: bool):
    """bf16 autocast on ``device`` when ``bf16``; a no-op context otherwise."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def loss_by_position(model: LM, windows: tuple[Tensor, Tensor], *, batch_size: int,
                     device: str = "cpu", bf16: bool = False) -> Tensor:
    """Mean next-byte cross-entropy at each position over the windows (inputs, targets), each
    (W, N): (N,) float64 nats.  For a context longer than the model was built for, extend it
    first with :meth:`LM.set_rope` (the length study's use)."""
    was_training = model.training
    model.eval()  # no power-iteration step (sigma-reparam), no qk-clip tracking
    try:
        x_all, y_all = windows
        total = torch.zeros(x_all.shape[-1], dtype=torch.float64)
        for lo in range(0, len(x_all), batch_size):
            x = x_all[lo:lo + batch_size].to(device)
            y = y_all[lo:lo + batch_size].to(device)
            with _autocast(device, bf16):
                logits = model(x)                                            # (b, N, 256)
            ce = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")  # (b, N)
            total += ce.double().sum(0).cpu()
        return total / len(x_all)
    finally:
        model.train(was_training)


@torch.no_grad()
def first_key_weights(model: LM, windows: tuple[Tensor, Tensor], *, batch_size: int,
                      device: str = "cpu", bf16: bool = False) -> list[list[float]]:
    """Each head's mean attention weight on the first key of the windows (inputs, targets),
    under the mechanism's normaliser, over every query (all see it under causality):
    ``[layer][head]``.  The attention-sink rate of Gu et al. 2024 (arXiv 2410.10781) counts the
    heads where this exceeds a threshold."""
    was_training = model.training
    model.eval()
    n_layers = len(model.blocks)
    totals: list = [None] * n_layers
    calls = [0]

    def take(seen) -> None:  # one call per layer, in order, per forward
        layer = calls[0] % n_layers
        calls[0] += 1
        total, rows = first_key_weight(seen)
        totals[layer] = (total, rows) if totals[layer] is None else \
            (totals[layer][0] + total, totals[layer][1] + rows)

    try:
        with observe(take):
            for lo in range(0, len(windows[0]), batch_size):
                with _autocast(device, bf16):
                    model(windows[0][lo:lo + batch_size].to(device))
    finally:
        model.train(was_training)
    return [(total / rows.clamp(min=1)).tolist() for total, rows in totals]


def evaluate(model: LM, windows: tuple[Tensor, Tensor], config: LMRunConfig) -> float:
    """Mean next-byte cross-entropy (nats per byte) over the validation windows."""
    return float(loss_by_position(model, windows, batch_size=config.batch_size,
                                  device=config.device, bf16=config.bf16).mean())


def _trace_row(step: int, records: list[dict], logits: Tensor) -> dict:
    """Per layer: max |attention logit| over heads, and the min and mean over heads of each
    head's mean entropy.  Not the min over query rows: under causality the first query has one
    key, so that minimum is 0 in every layer at every step."""
    by_layer: dict[int, list[dict]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    heads = [by_layer[layer] for layer in sorted(by_layer)]
    return {"step": step, "output_logit_max": float(logits.detach().abs().amax()),
            "attn_logit_max": [max(h[_ABSMAX] for h in hs) for hs in heads],
            "entropy_min": [min(h[_ENTROPY] for h in hs) for hs in heads],
            "entropy_mean": [sum(h[_ENTROPY] for h in hs) / len(hs) for hs in heads]}


# The monitor's record keys the trace reads (attnscale.columns names them).
_ABSMAX, _ENTROPY = named("logit_absmax", "entropy_mean")


def train_lm(config: LMRunConfig | Mapping[str, Any] | None = None, *,
             after: Callable[[LM, Corpus], None] | None = None, **overrides) -> dict:
    """Train one run and return its record (JSON-ready; non-finite numbers become null).

    ``config`` is a :class:`LMRunConfig` or its JSON dict; ``overrides`` replace fields, e.g.
    ``train_lm(mechanism="unscaled", lr=3e-2)``.  ``after(model, corpus)``, when given, is called
    with the trained model and the corpus it was trained on after its final evaluation (the
    length study evaluates it at longer contexts).
    """
    if isinstance(config, Mapping):
        config = LMRunConfig.from_json(config)
    config = replace(config or LMRunConfig(), **overrides).validated()
    corpus = load_corpus(config.data)
    windows = eval_windows(corpus.val, config.eval_windows, config.seq_len)
    # --threads binds the CPU's intra-op threads: any CPU spelling ("cpu", "cpu:0"), by kind.
    on_cpu = torch.device(config.device).type == "cpu"
    threads = num_threads(config.threads) if on_cpu else contextlib.nullcontext()
    with threads:
        model = build_lm(config.model_config(), seed=config.seed, device=config.device).train()
        opt = _optimizer(model, config)
        loss_init = evaluate(model, windows, config)
        gen = rng(config.seed, "lm-batches")
        losses = torch.full((config.steps,), math.nan)
        grad_norms = torch.full((config.steps,), math.nan)
        trace, diverged_step = [], None
        k = config.monitor_every
        start = time.perf_counter()
        # The guard records steps 0, k, 2k, ... and installs qk-clip's clip; no alarms here.
        with guard(model, optimizer=opt, every=k, alarm_logit=None,
                   alarm_entropy_fraction=None) as g:
            for t in range(config.steps):
                for group in opt.param_groups:
                    group["lr"] = config.lr * lr_factor(t, config.steps, config.lr)
                x, y = sample_batch(corpus.train, config.batch_size, config.seq_len, gen)
                x, y = x.to(config.device), y.to(config.device)
                with _autocast(config.device, config.bf16):
                    logits = model(x)                                       # (B, N, 256)
                ce, loss = lm_loss(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norms[t] = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                opt.step()
                losses[t] = ce.detach()
                records = g.step(t)
                if t % k == 0:
                    trace.append(_trace_row(t, records, logits))
                    bad = ~torch.isfinite(losses[:t + 1])
                    if bad.any():  # a diverged run: nothing left to learn from its steps
                        diverged_step = int(bad.nonzero()[0])
                        break
        wall = time.perf_counter() - start
        steps_done = t + 1
        final = evaluate(model, windows, config) if diverged_step is None else math.nan
        sinks = None if diverged_step is not None else first_key_weights(
            model, windows, batch_size=config.batch_size, device=config.device, bf16=config.bf16)
        if after is not None:
            after(model, corpus)
    diverged = diverged_step is not None or not math.isfinite(final) or final > loss_init
    return json_safe({
        "experiment": "lm", "config": config.to_json(), "recipe": recipe(),
        "corpus": corpus.describe(), "n_params": sum(p.numel() for p in model.parameters()),
        "loss_init": loss_init, "final_val_loss": final, "final_val_bpb": final * LOG2E,
        "diverged": diverged, "diverged_step": diverged_step, "steps_done": steps_done,
        "train_loss": losses[:steps_done].tolist(), "grad_norm": grad_norms[:steps_done].tolist(),
        "trace": trace, "first_key_weight": sinks,
        # Apart from this entry a record is the same bytes for the same config on any machine.
        "timing": {"tokens_per_second": steps_done * config.batch_size * config.seq_len / wall,
                   "train_seconds": wall}})
