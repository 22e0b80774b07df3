"""Strict QK-Clip at depth: one walk over the step's batch clips every layer, whatever the depth.

Clipping layer l changes what reaches the layers above it; the strict clip walks the layers in
order, clipping each on its actual inputs and running a clipped layer again before the next one
runs, so a step with one forward pass costs one extra forward (and a second run of the clipped
attention layers) at any depth, and every head ends at or below τ within the rounding tolerance
``strict_rtol``.  The bound is checked against an independent float64 recomputation of every
head's largest logit from the q and k the model hands its attention function (test_guard's
capture), on tiny 24-layer Llamas trained with AdamW at a learning rate that makes the logits
grow in every layer.
"""

from __future__ import annotations

import math

import torch
import torch.multiprocessing as mp
import transformers
from torch import nn
from torch.testing import assert_close

import attnscale
import guard_ddp
from attnscale import MultiHeadAttention
from attnscale.guard import clip_sites, strict_rtol
from attnscale.hf import TemperatureCallback
from test_guard import COMMON, _free_port, batches, true_max_logits
from test_guard_integrations import _trainer

LAYERS = 24
TAU = 1.0
FLOAT32_RTOL = strict_rtol(torch.finfo(torch.float32).eps)


def deep_llama(layers: int = LAYERS, seed: int = 0):
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": layers})
    config.attention_dropout = 0.0
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config,
                                                         attn_implementation="capture-sdpa")


class Counts:
    """Forwards of ``model`` and calls of its attention layers made without grad (the strict
    walk's; the training forwards run with grad), per optimizer step (``close_step`` after it)."""

    def __init__(self, model):
        self.forwards = self.attention = 0
        self.steps: list[tuple[int, int]] = []
        model.register_forward_pre_hook(lambda *_: self._count("forwards"))
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *_: self._count("attention"))

    def _count(self, what: str) -> None:
        if not torch.is_grad_enabled():
            setattr(self, what, getattr(self, what) + 1)

    def close_step(self) -> None:
        self.steps.append((self.forwards, self.attention))
        self.forwards = self.attention = 0


def clipped_layers(records: list[dict]) -> set[int]:
    return {r["layer"] for r in records if r["clip_gamma"] is not None and r["clip_gamma"] < 1}


def test_trainer_strict_clip_walks_24_layers_once_per_step(tmp_path):
    """The HF Trainer with its default AdamW, one batch per step: every step's strict clip is
    one forward of the model and at most one second run per attention layer, and after the
    last step every head of every layer is at or below τ on its batch."""
    model = deep_llama()
    counts = Counts(model)
    kept = {}

    class Step(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            counts.close_step()

    def keep(module, args, kwargs):
        if module.training:
            kept["batch"] = {k: kwargs[k] for k in ("input_ids", "labels")}
    model.register_forward_pre_hook(keep, with_kwargs=True)
    callback = TemperatureCallback(qk_clip=TAU, strict=True, every=1, alarm_logit=None,
                                   alarm_entropy_fraction=None)
    trainer = _trainer(model, tmp_path, [Step()], steps=4)
    callback.add_to(trainer)
    trainer.train()
    g = callback.guard
    # the clip has work in most layers, above the first (where the walk's order matters)
    assert len(clipped_layers(g.records) - {0}) >= LAYERS // 2
    assert [forwards for forwards, _ in counts.steps] == [1, 1, 1, 1]
    assert all(LAYERS <= attention <= 2 * LAYERS for _, attention in counts.steps)
    assert g.strict_passes == 1
    peaks = true_max_logits(model, kept["batch"])  # (layers, heads), float64
    assert float(peaks.max()) <= TAU * (1 + FLOAT32_RTOL)
    # the walk knows each layer's peak after the clip: the recomputation's, to float32 rounding
    walked = torch.stack([g.strict_peaks[f"model.layers.{i}.self_attn"] for i in range(LAYERS)])
    assert_close(walked, peaks, rtol=1e-5, atol=1e-6)


def train_steps(model, steps: list[list[dict]], *, lr: float | list[float], counts=None,
                autocast: bool = False, **options):
    """AdamW over ``steps`` (each a list of batches whose gradients accumulate into one step)
    under a strict guard; ``lr`` per step or for all."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr if isinstance(lr, float) else lr[0])
    passes = []
    with attnscale.guard(model, optimizer=opt, qk_clip=TAU, strict=True, every=1,
                         alarm_logit=None, alarm_entropy_fraction=None, **options) as g:
        for step, micro in enumerate(steps):
            for group in opt.param_groups:
                group["lr"] = lr if isinstance(lr, float) else lr[step]
            for batch in micro:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(**batch).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
            if counts is not None:
                counts.close_step()
            passes.append(g.strict_passes)
    return g, passes


def test_a_head_a_rounding_over_tau_is_not_clipped_again():
    """τ set a relative 1e-8 under the largest logit the guard measures: its factor
    η = 1 - 1e-8 leaves every float32 weight as it was (η^α rounds to 1.0), so the head reads
    the same value again and again; counted as over τ it would be clipped pass after pass up to
    the cap.  Within the tolerance it is not clipped: one forward, no second run of any layer.
    (A plain loop: the model's config asks for a KV cache, which the walk turns off and puts
    back.)"""
    model = deep_llama()
    batch = batches(1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    options = {"optimizer": opt, "every": 1, "alarm_logit": None, "alarm_entropy_fraction": None}

    def step(g) -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        g.step(0)

    with attnscale.guard(model, qk_clip=1e9, **options) as g:  # K2 mode: S_max as measured
        step(g)
    tau = max(r["s_max"] for r in g.records) * (1 - 1e-8)
    counts = Counts(model)
    with attnscale.guard(model, qk_clip=tau, strict=True, **options) as g:
        step(g)
        counts.close_step()
    assert counts.steps == [(1, LAYERS)]
    assert g.strict_passes == 1 and all(r["clip_gamma"] == 1.0 for r in g.records)
    assert model.config.use_cache is True


def test_strict_tolerance_decides_over_tau():
    """A group over τ by less than the tolerance keeps η = 1 in strict mode; K2's mode (no
    tolerance) clips it."""
    site = clip_sites(deep_llama(layers=1))[0]
    tau = 9.244
    s = torch.tensor([tau * (1 + 4.7e-8), 1.0, tau * (1 + 2 * FLOAT32_RTOL), 1.0],
                     dtype=torch.float64)
    eta_q, _ = site.factors(s, tau, FLOAT32_RTOL)
    assert_close(eta_q, torch.tensor([1.0, 1.0, 1 / (1 + 2 * FLOAT32_RTOL),
                                      1 / (1 + 2 * FLOAT32_RTOL)], dtype=torch.float64))
    eta_q, _ = site.factors(s, tau)
    assert bool((eta_q < 1).all())
    assert strict_rtol(torch.finfo(torch.bfloat16).eps) > 100 * FLOAT32_RTOL


def test_accumulated_batches_walk_until_nothing_is_out_of_date():
    """Two forward passes per step (gradient accumulation): a clip made on a later batch
    changes what the earlier ones saw, so the walk repeats, at most once per layer plus one;
    every batch of the step ends at or below τ."""
    layers = LAYERS // 2
    model = deep_llama(layers=layers)
    data = batches(6)
    steps = [data[i:i + 2] for i in range(0, 6, 2)]
    counts = Counts(model)
    _, passes = train_steps(model, steps, lr=0.05, counts=counts)
    assert all(1 <= p <= layers + 1 for p in passes)
    assert [f for f, _ in counts.steps] == [2 * p for p in passes]
    assert max(passes) > 1  # a later batch's clip did move an earlier batch's inputs
    for batch in steps[-1]:
        assert float(true_max_logits(model, batch).max()) <= TAU * (1 + FLOAT32_RTOL)


def test_strict_clip_under_bfloat16_autocast_bounds_the_bfloat16_logits():
    """Under autocast the clipped layer's second run must cast the clipped weights again (not
    reuse the cast of the weights from before the clip): the logits it computes, from bfloat16
    q and k, end at or below τ within the bfloat16 tolerance."""
    model = deep_llama(layers=8)
    data = batches(4)
    g, passes = train_steps(model, [[b] for b in data], lr=0.05, autocast=True)
    assert passes == [1] * 4 and clipped_layers(g.records)
    rtol = strict_rtol(torch.finfo(torch.bfloat16).eps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peaks = true_max_logits(model, data[-1])  # of the bfloat16 q and k the model makes
    assert float(peaks.max()) <= TAU * (1 + rtol)
    walked = torch.stack([g.strict_peaks[f"model.layers.{i}.self_attn"] for i in range(8)])
    assert float(walked.max()) <= TAU * (1 + rtol)


# ---------------------------------------------------------------------------------------------
# Data parallelism: each layer's factors all-reduced as the walk reaches it


class Tower(nn.Module):
    """Residual blocks of attnscale's MultiHeadAttention (d 16, 2 heads)."""

    def __init__(self, layers: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MultiHeadAttention(16, 2) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x, causal=True)
        return x

    def peaks(self, x) -> torch.Tensor:
        """(layers, heads) float64 largest causal logits, recomputed from W_Q and W_K."""
        out = []
        with torch.no_grad():
            for block in self.blocks:
                q, k = block._split(block.w_q(x)).double(), block._split(block.w_k(x)).double()
                z = (q @ k.transpose(-1, -2)) / math.sqrt(8)
                n = z.shape[-1]
                z = z.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
                out.append(z.amax(dim=(0, 2, 3)))
                x = x + block(x, causal=True)
        return torch.stack(out)


def ddp_batch(rank: int) -> torch.Tensor:
    """Rank 1's input is 3x rank 0's: the ranks' peaks differ in every layer."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(20 + rank))
    return x * (3.0 if rank == 1 else 1.0)


def ddp_strict_worker(rank: int, port: int, out: str) -> None:
    with guard_ddp.gloo(rank, port):
        tower = Tower()
        opt = torch.optim.SGD(tower.parameters(), lr=0.0)  # the clip is the only change
        with attnscale.guard(tower, optimizer=opt, qk_clip=0.5, strict=True, every=1,
                             alarm_logit=None) as g:
            tower(ddp_batch(rank)).sum().backward()
            opt.step()
            g.step(0)
        torch.save({"state": tower.state_dict(), "passes": g.strict_passes,
                    "gamma": [r["clip_gamma"] for r in g.records]}, f"{out}/strict{rank}.pt")


def test_data_parallel_strict_walk_clips_every_rank_alike(tmp_path):
    """Two gloo ranks with their own batches: each layer's factors come from the larger of the
    ranks' peaks on inputs the clipped layers below produced, so one walk leaves both ranks'
    batches at or below τ and the weights identical."""
    mp.start_processes(ddp_strict_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"strict{r}.pt") for r in (0, 1))
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key
    assert r0["passes"] == r1["passes"] == 1 and r0["gamma"] == r1["gamma"]
    tower = Tower()
    tower.load_state_dict(r0["state"])
    before = Tower()
    assert float(before.peaks(ddp_batch(1))[1:].max()) > 0.5  # layers above the first clipped
    assert float(before.peaks(ddp_batch(0)).max()) < float(before.peaks(ddp_batch(1)).max())
    for rank in (0, 1):
        assert float(tower.peaks(ddp_batch(rank)).max()) <= 0.5 * (1 + FLOAT32_RTOL)
    assert float(tower.peaks(ddp_batch(1)).max()) >= 0.5 * (1 - FLOAT32_RTOL)  # held at τ
