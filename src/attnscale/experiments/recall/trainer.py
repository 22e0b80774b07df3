"""Train recall models and measure each run: loss curve, milestones, plateaus, accuracy, statistics.

:func:`train_runs` trains several runs that share every shape and optimiser setting (differing in
mechanism, seed or options) as one batched model, see :class:`attnscale.experiments.recall.model.StackedRecall`;
:func:`train`, :func:`compare` and :func:`run_all` are the entry points built on it.

Speed and determinism
---------------------
Training runs on :data:`TRAIN_THREADS` intra-op thread (restored afterwards): every tensor here is
small, so extra threads mostly add synchronisation, and a fixed thread count makes the float
reductions, hence the curves, bit-identical on any machine.  The data stream is pre-sampled per
chunk, and a step does one forward, one backward and one optimiser step with no host syncs beyond
writing its loss into a preallocated tensor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from attnscale.columns import MEAN_STATS, MONITOR_SUMMARIES
from attnscale.errors import ConfigError, check_int_list, check_name_list
from attnscale.guard import guard
from attnscale.io import json_safe
from attnscale.progress import progress
from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.config import RecallConfig, expand_grid, shared_key
from attnscale.experiments.recall.model import BatchIndex, RecallNet, StackedRecall
from attnscale.mechanisms import qk_clip
from attnscale.experiments.recall.task import CHUNK_STEPS, RecallBatch, eval_set, train_chunk
from attnscale.stats import columns, logit_std, row_stats
from attnscale.workers import num_threads

TRAIN_THREADS = 1
# Held-out sequences per evaluation forward (bounds the (M, chunk, P, d_k) key tensor).
EVAL_CHUNK = 500


@dataclass
class RunResult:
    """Everything measured in one run.  Steps are 0-based optimiser steps (loss at step t is on
    batch t, before update t)."""
    config: RecallConfig
    loss: list[float]                    # per-step training loss (nats)
    smoothed: list[float]                # EMA of ``loss`` (metrics.EMA_DECAY)
    steps_to_loss_1: int | None          # first step with smoothed loss < 1.0 (None: never)
    steps_to_loss_0_1: int | None        # first step with smoothed loss < 0.1
    final_loss: float                    # smoothed loss at the last step
    eval_accuracy: float                 # fraction of the held-out set answered correctly
    grad_wq_norm_step0: float            # ||dL/dW_Q||_F at step 0
    logit_grad_norm_step0: float         # ||dL/dz||_F at step 0, z the attention logits
    plateaus: list[dict]                 # [{"start", "end", "level"}], see metrics.plateaus
    wall_seconds: float                  # wall time of the (batched) training job of this run
    trace: list[dict] = field(default_factory=list)  # attention statistics every log_every steps
    eval_stats: dict = field(default_factory=dict)   # statistics on the held-out set after training

    @property
    def mechanism(self) -> str:
        return self.config.mechanism

    def record(self) -> dict:
        """The run's one serialisation: every measurement under its field name, JSON-safe
        (non-finite numbers of a diverged run become null), without the config and the wall
        time, which the sweep's record keeps beside it.  :meth:`from_record` inverts it;
        :meth:`to_json` and :meth:`row` are views of it."""
        return json_safe({name: getattr(self, name) for name in RECORD_FIELDS})

    @classmethod
    def from_record(cls, config: RecallConfig, result: dict, wall_seconds: float) -> RunResult:
        """The run that :meth:`record` gave ``result`` (a null loss comes back as NaN)."""
        r = dict(result)
        r["loss"] = [math.nan if v is None else v for v in r["loss"]]
        r["final_loss"] = math.nan if r["final_loss"] is None else r["final_loss"]
        return cls(config=config, smoothed=metrics.ema(r["loss"]).tolist(),
                   wall_seconds=wall_seconds, **{name: r[name] for name in RECORD_FIELDS})

    def to_json(self) -> dict:
        """The record of ``attnscale compare --json``: the milestones, the per-step loss as
        ``loss_curve``, and the full config, so the run can be re-run from its record."""
        r, c = self.record(), self.config
        return json_safe({
            "mechanism": c.mechanism, "seed": c.seed,
            **{k: r[k] for k in ("steps_to_loss_1", "steps_to_loss_0_1", "final_loss",
                                 "eval_accuracy", "grad_wq_norm_step0", "plateaus")},
            "wall_seconds": self.wall_seconds, "loss_curve": r["loss"],
            "config": config_dict(c)})

    def row(self) -> dict:
        """A flat record for tables and results.json (no curves): the config's grid keys, the
        scalar measurements, the plateau count and the held-out statistics as ``eval_<stat>``."""
        r, c = self.record(), self.config
        return json_safe({
            "mechanism": c.mechanism, "seed": c.seed, "d_k": c.d_k, "optimizer": c.optimizer,
            "lr": c.lr, "qk_lr_mult": c.qk_lr_mult, "steps": c.steps,
            **{k: r[k] for k in ("steps_to_loss_1", "steps_to_loss_0_1", "final_loss",
                                 "eval_accuracy", "grad_wq_norm_step0",
                                 "logit_grad_norm_step0")},
            "plateaus": len(self.plateaus), "wall_seconds": self.wall_seconds,
            **{f"eval_{k}": v for k, v in r["eval_stats"].items()}})


# The measurements of a run, in the order its record lists them (RunResult's fields but the
# config, the smoothed curve, derived from the loss, and the wall time).
RECORD_FIELDS = ("steps_to_loss_1", "steps_to_loss_0_1", "final_loss", "eval_accuracy",
                 "grad_wq_norm_step0", "logit_grad_norm_step0", "plateaus", "eval_stats", "loss",
                 "trace")


def _optimizer(model: StackedRecall) -> torch.optim.Optimizer:
    """Adam or SGD over the stacked weights; W_Q and W_K (with sigma-reparam's gamma) get
    ``lr * qk_lr_mult``.  Fused kernels: one pass over all parameters per step."""
    c = model.config
    qk = [model.w_q_t, model.w_k_t, *model.q_maps.parameters(), *model.k_maps.parameters()]
    qk_ids = {id(p) for p in qk}
    rest = [p for p in model.parameters() if id(p) not in qk_ids]
    groups = [{"params": rest, "lr": c.lr}, {"params": qk, "lr": c.lr * c.qk_lr_mult}]
    if c.qk_lr_mult == 1.0:
        groups = [{"params": rest + qk, "lr": c.lr}]  # one group: one fused kernel per step
    if c.optimizer == "adam":
        return torch.optim.Adam(groups, lr=c.lr, fused=True)
    return torch.optim.SGD(groups, lr=c.lr)


def _bind_qk_clip(model: StackedRecall) -> None:
    """Bind each qk-clip run's mechanism to its slices of the stacked W_Q^T and W_K^T.  Its
    S_max comes from its logits z in every training forward (the model hands them to
    :func:`attnscale.pipeline.observe_logits`), and the guard installs its clip after every
    optimiser step (:func:`qk_clip.install`).  No-op without qk-clip runs."""
    with torch.no_grad():  # views of run m's weights; the optimiser updates them in place
        for m, mech in enumerate(model.mechanisms):
            if isinstance(mech, qk_clip.QKClip):
                # W^T: a head's features are columns.  track=False: prepare() sees the score
                # tables here, not the batch; the batch's logits reach observe() instead.
                mech.bind(model.w_q_t[m], model.w_k_t[m], dim=-1, track=False)


def _stacked_chunk(configs: Sequence[RecallConfig], chunk: int) -> BatchIndex:
    """The chunk's batches for every run, (M, CHUNK_STEPS, B), sampled once per seed."""
    per_seed: dict[int, RecallBatch] = {}
    for c in configs:
        if c.seed not in per_seed:
            per_seed[c.seed] = train_chunk(c, chunk)
    return BatchIndex.build(stack_batches([per_seed[c.seed] for c in configs]),
                            configs[0].n_keys, configs[0].n_values)


# The row statistics the trace and the evaluation average (attnscale.columns names them), and
# the guard record key of each one's mean.
_STAT_NAMES = MEAN_STATS
_GUARD_MEANS = {s.column: s.key for s in MONITOR_SUMMARIES
                if s.reduce == "mean" and s.column in _STAT_NAMES}


def _attention_stats(z: torch.Tensor, mechanisms) -> dict[str, torch.Tensor]:
    """Row means of entropy (nats), max weight, Jacobian norm and logit std of the attention
    logits z (M, B, P) under each model's normaliser (attnscale.stats): each (M,), float64."""
    per_model = []
    for m, mech in enumerate(mechanisms):
        sink = mech.sink_logits().detach() if mech.normaliser == "sink" else None
        lam = mech.lam().detach() if mech.normaliser == "differential" else None
        # (a stack with a differential model pads the others' logits with -inf, masked keys)
        rows = columns(row_stats(z[m].detach(), normaliser=mech.normaliser, sink=sink,
                                 lam=lam))
        per_model.append([rows[name].mean(-1) for name in _STAT_NAMES])
    return {name: torch.stack([stats[i] for stats in per_model])
            for i, name in enumerate(_STAT_NAMES)}


def _trace_rows(step: int, records: list[dict], runs: int) -> list[dict]:
    """Each run's trace row at ``step`` from the guard's records: run m is the guard's layer m
    (the m-th logits the stacked model hands over per forward), one head."""
    by_run = {r["layer"]: r for r in records}
    if sorted(by_run) != list(range(runs)):
        raise RuntimeError(f"the guard recorded layers {sorted(by_run)} for {runs} runs")
    return [{"step": step, **{name: by_run[m][_GUARD_MEANS[name]] for name in _STAT_NAMES}}
            for m in range(runs)]


def stack_batches(batches: Sequence[RecallBatch]) -> RecallBatch:
    """Stack per-model batches of equal shape on a new leading model axis."""
    return RecallBatch(*(torch.stack([getattr(b, f) for b in batches])
                         for f in ("keys", "values", "query", "target")))


@torch.no_grad()
def evaluate(model: StackedRecall, data: Sequence[RecallBatch]) -> list[dict]:
    """Accuracy and attention statistics of each model on its own held-out set.

    Returns per model ``accuracy`` and the row means of ``entropy, max_weight, jacobian_fro,
    logit_std`` (of the logits after the mechanism) and ``qk_std``, the std over keys of the raw
    q.k before any temperature.
    """
    c = model.config
    was_training = model.training
    model.eval()  # no power-iteration updates (sigma-reparam) while evaluating
    try:
        sums = torch.zeros(2 + len(_STAT_NAMES), len(model), dtype=torch.float64)
        count = len(data[0])
        for lo in range(0, count, EVAL_CHUNK):
            batch = stack_batches([d[lo:lo + EVAL_CHUNK] for d in data])       # (M, chunk)
            idx = BatchIndex.build(batch, c.n_keys, c.n_values)
            out = model(idx)
            stats = _attention_stats(out.z, model.mechanisms)
            rows = (out.logits.argmax(-1) == batch.target).double().sum(-1)    # (M,) correct
            n = batch.query.shape[1]
            sums += torch.stack([rows, *(v.double() * n for v in stats.values()),
                                 logit_std(model.qk_dots(idx)).double().sum(-1)])
        names = ("accuracy", *_STAT_NAMES, "qk_std")
        return [{k: float(v) for k, v in zip(names, sums[:, m] / count)} for m in range(len(model))]
    finally:
        model.train(was_training)


def check_compatible(configs: Sequence[RecallConfig]) -> list[RecallConfig]:
    """Validate ``configs``: distinct runs that differ only in per-run fields (a repeated run
    would count one run twice in every statistic, so it is a ConfigError)."""
    if not configs:
        raise ConfigError("at least one run is required.")
    configs = [c.validated() for c in configs]
    if any(shared_key(c) != shared_key(configs[0]) for c in configs):
        raise ConfigError("runs trained together must share every setting except mechanism, "
                          "seed and options.")
    for i, c in enumerate(configs):  # options may hold unhashable values: compare, don't hash
        if c in configs[:i]:
            raise ConfigError(f"configs lists the run mechanism={c.mechanism!r}, seed={c.seed}, "
                              f"options={dict(c.options)!r} more than once; each run must be "
                              "distinct.")
    return configs


def train_runs(configs: Sequence[RecallConfig], *, show_progress: bool | None = None,
               desc: str | None = None,
               after: Callable[[StackedRecall], None] | None = None) -> list[RunResult]:
    """Train every config as one batched model and measure each run.

    ``after(model)``, when given, is called with the trained model once it has been evaluated
    (the length study evaluates it at other pair counts there).

    Each run keeps its own initialisation (from its seed) and data stream (from its seed), so a
    run's curve does not depend on which others it is trained with beyond float rounding of the
    batched matmuls.
    """
    configs = check_compatible(configs)
    c = configs[0]
    M = len(configs)
    with num_threads(TRAIN_THREADS):
        start = time.perf_counter()
        model = StackedRecall([RecallNet(cfg) for cfg in configs]).train()
        opt = _optimizer(model)
        _bind_qk_clip(model)
        losses = torch.empty(c.steps, M)
        trace = []  # per step: each run's row
        label = desc or ",".join(dict.fromkeys(cfg.mechanism for cfg in configs))
        # The guard records steps 0, log_every, ... and the last (run m is its layer m), and
        # installs the qk-clip runs' clip; no alarms here.
        with guard(model, optimizer=opt, every=c.log_every, alarm_logit=None,
                   alarm_entropy_fraction=None) as g:
            for t in progress(range(c.steps), desc=f"train {label}", enabled=show_progress):
                if t % CHUNK_STEPS == 0:
                    chunk = _stacked_chunk(configs, t // CHUNK_STEPS)
                if t == c.steps - 1:
                    g.record_next()
                out = model(chunk.step(t % CHUNK_STEPS))
                if t == 0:
                    out.z.retain_grad()
                opt.zero_grad(set_to_none=True)
                out.loss.sum().backward()  # models are independent: each gets its own gradient
                if t == 0:
                    grad_wq = model.w_q_t.grad.flatten(1).norm(dim=1).tolist()
                    grad_z = out.z.grad.flatten(1).norm(dim=1).tolist()
                opt.step()
                losses[t] = out.loss.detach()
                records = g.step(t)
                if records:
                    trace.append(_trace_rows(t, records, M))
        evals = evaluate(model, [eval_set(cfg) for cfg in configs])
        if after is not None:
            after(model)
        wall = time.perf_counter() - start

    results = []
    for m, cfg in enumerate(configs):
        loss = losses[:, m].tolist()
        smoothed = metrics.ema(loss)
        rows = [step[m] for step in trace]
        results.append(RunResult(
            config=cfg, loss=loss, smoothed=smoothed.tolist(),
            steps_to_loss_1=metrics.first_below(smoothed, metrics.MILESTONES[0]),
            steps_to_loss_0_1=metrics.first_below(smoothed, metrics.MILESTONES[1]),
            final_loss=float(smoothed[-1]), eval_accuracy=evals[m].pop("accuracy"),
            grad_wq_norm_step0=grad_wq[m], logit_grad_norm_step0=grad_z[m],
            plateaus=metrics.plateaus(smoothed), wall_seconds=wall, trace=rows,
            eval_stats=evals[m]))
    return results


def run_all(configs: Sequence[RecallConfig], *, show_progress: bool | None = None) -> list[RunResult]:
    """Train any set of configs, batching those that can share a model; results in input order."""
    groups: dict[tuple, list[int]] = {}
    for i, cfg in enumerate(configs):
        groups.setdefault(shared_key(cfg), []).append(i)
    results: list[RunResult | None] = [None] * len(configs)
    for members in groups.values():
        for i, res in zip(members, train_runs([configs[i] for i in members],
                                              show_progress=show_progress)):
            results[i] = res
    return results  # type: ignore[return-value]


def train(config: RecallConfig | None = None, *, show_progress: bool | None = None,
          **overrides) -> RunResult:
    """Train one run: ``train(mechanism="unscaled", d_k=64)`` or ``train(config)``."""
    config = replace(config or RecallConfig(), **overrides)
    return train_runs([config], show_progress=show_progress)[0]


def compare(mechanisms: Sequence[str] = ("scaled", "unscaled"), config: RecallConfig | None = None,
            *, seeds: Sequence[int] | None = None, show_progress: bool | None = None,
            **overrides) -> list[RunResult]:
    """Train each mechanism (x each seed) from the same init and data; the essay's demo by default.
    A repeated mechanism or seed is a ConfigError."""
    base = replace(config or RecallConfig(), **overrides)
    seeds = [base.seed] if seeds is None else check_int_list("seeds", seeds, minimum=0)
    return train_runs(expand_grid(base, seed=seeds, mechanism=check_name_list("mechanisms", mechanisms)),
                      show_progress=show_progress)


def config_dict(config: RecallConfig) -> dict:
    """JSON-ready view of a config."""
    out = asdict(config)
    out["options"] = dict(config.options)
    return out
