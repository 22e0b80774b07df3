"""The essay's training numbers, measured, and what the essay did not run.

Each function returns plain dicts (tidy rows or a flat summary); plotting lives in
:mod:`attnscale.experiments.recall.figures`.

* :func:`grad_decomposition`: the step-0 W_Q gradient ratio, unscaled / scaled, split into the
  sqrt(d_k) the divisor removes and the saturation factor that claws part of it back.
* :func:`logit_scaling`: how the logit std grows with d_k, at init and once trained (the muP
  argument: trained q and k align, so q.k ~ d_k rather than sqrt(d_k)).
* :func:`init_reparam_adam` and :func:`init_reparam_sgd`: "Identical at step 0 is not identical at
  step 10,000".
* :func:`study`: every registered mechanism on the task, across d_k and seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from attnscale.errors import check_int_list, check_name_list
from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.config import RecallConfig, sqrt_dk, sweep
from attnscale.experiments.recall.model import RecallNet, StackedRecall
from attnscale.experiments.recall.task import eval_set
from attnscale.experiments.recall.trainer import (
    TRAIN_THREADS, RunResult, evaluate, run_all, train_runs,
)
from attnscale.workers import num_threads

# The all-mechanism study's grid (issue 4: "d_k in {16, 64, 256, 1024} x 3 seeds").
STUDY_D_KS = (16, 64, 256, 1024)
STUDY_SEEDS = (0, 1, 2)
# SGD learning rate of the init-reparam tracking experiment.  SGD needs a far larger step than
# Adam: at 0.1 all three runs reach loss 0.1 in ~200 steps at the defaults; at 0.5 the runs with
# sqrt(d_k) x 0.5 on W_Q, W_K stall at chance, and at 2.0 every run diverges.
SGD_LR = 0.1


def grad_decomposition(scaled: RunResult, unscaled: RunResult) -> dict:
    """Split ``||dL/dW_Q|| unscaled / scaled`` at step 0 (same init, same batch) into two factors.

    With z = c q.k (c = 1/sqrt(d_k) scaled, 1 unscaled), dL/dW_Q = c sum_b (K_b^T dL/dz_b) x_b^T,
    so ``ratio = sqrt(d_k) * saturation`` exactly, where ``saturation`` is the ratio of the same sums
    without c: how much smaller the unscaled softmax passes gradient to its logits because it is
    saturated.  Also reported, as independent readings of that saturation: the ratio of
    ``||dL/dz||`` and of the mean softmax-Jacobian norm at step 0.  The essay: 9.8 = 16 x 0.61.
    """
    ratio = unscaled.grad_wq_norm_step0 / scaled.grad_wq_norm_step0
    root = sqrt_dk(scaled.config)
    jac_s, jac_u = scaled.trace[0].get("jacobian_fro"), unscaled.trace[0].get("jacobian_fro")
    return {"seed": scaled.config.seed, "d_k": scaled.config.d_k,
            "grad_wq_scaled": scaled.grad_wq_norm_step0,
            "grad_wq_unscaled": unscaled.grad_wq_norm_step0,
            "ratio": ratio, "sqrt_d_k": root, "saturation": ratio / root,
            "logit_grad_ratio": unscaled.logit_grad_norm_step0 / scaled.logit_grad_norm_step0,
            "jacobian_ratio": jac_u / jac_s if jac_s else None}


def milestone_ratios(scaled: RunResult, unscaled: RunResult) -> dict:
    """Unscaled / scaled steps to each loss milestone (None when either never gets there),
    and the ratio of final smoothed losses."""
    out = {"seed": scaled.config.seed}
    for name in ("steps_to_loss_1", "steps_to_loss_0_1"):
        a, b = getattr(unscaled, name), getattr(scaled, name)
        out[f"{name}_ratio"] = a / b if a is not None and b else None
    out["final_loss_ratio"] = unscaled.final_loss / scaled.final_loss
    return out


@torch.no_grad()
def init_stats(configs: Sequence[RecallConfig]) -> list[dict]:
    """:func:`~attnscale.experiments.recall.trainer.evaluate` on untrained models (step 0)."""
    with num_threads(TRAIN_THREADS):
        model = StackedRecall([RecallNet(c) for c in configs])
        return evaluate(model, [eval_set(c) for c in configs])


def logit_scaling(d_ks: Sequence[int] = STUDY_D_KS, config: RecallConfig | None = None,
                  *, trained: Sequence[RunResult] | None = None,
                  show_progress: bool | None = None) -> dict:
    """Exponent a in ``std(q.k) ~ d_k^a`` at init and after training ``config.mechanism``.

    ``std(q.k)`` is the std over a sequence's keys of the raw dot products, before any temperature,
    averaged over the held-out set.  Independent unit-variance q and k give a = 1/2 (central limit
    theorem); the essay's muP section predicts a -> 1 once training aligns q with its keys (law of
    large numbers).  ``trained`` may pass runs already trained (one per d_k) to reuse them.
    """
    config = config or RecallConfig()
    configs = [replace(config, d_k=d) for d in d_ks]
    if trained is None:
        trained = run_all(configs, show_progress=show_progress)
    at_init = [init_stats([c])[0] for c in configs]
    rows = [{"mechanism": config.mechanism, "d_k": c.d_k, "qk_std_init": i["qk_std"],
             "qk_std_trained": r.eval_stats["qk_std"], "logit_std_trained": r.eval_stats["logit_std"],
             "eval_accuracy": r.eval_accuracy} for c, i, r in zip(configs, at_init, trained)]
    return {"rows": rows,
            "exponent_init": metrics.power_law_exponent(d_ks, [r["qk_std_init"] for r in rows]),
            "exponent_trained": metrics.power_law_exponent(d_ks, [r["qk_std_trained"] for r in rows])}


def adam_separation(scaled: RunResult, reparam: RunResult) -> dict:
    """Where init-reparam's loss curve leaves scaled's (same init, data and optimizer).

    At step 0 the logits are identical (W_Q, W_K at d^-1/4 times the init, no divisor).  Adam's
    update is invariant to the gradient's scale, so it moves W_Q and W_K by about lr per step in
    both runs, which is d^1/4 times larger *relative to* init-reparam's smaller weights: the runs
    part at once.  Separation is the first step where the per-step losses (on identical batches)
    differ by more than :data:`~attnscale.experiments.recall.metrics.SEPARATION_REL`.
    """
    return {"seed": scaled.config.seed, "optimizer": scaled.config.optimizer,
            "step0_rel_gap": abs(reparam.loss[0] - scaled.loss[0]) / scaled.loss[0],
            "separation_step": metrics.separation_step(reparam.loss, scaled.loss),
            "scaled_steps_to_loss_0_1": scaled.steps_to_loss_0_1,
            "reparam_steps_to_loss_0_1": reparam.steps_to_loss_0_1,
            "scaled_final_loss": scaled.final_loss, "reparam_final_loss": reparam.final_loss}


def init_reparam_adam(config: RecallConfig | None = None, *,
                      show_progress: bool | None = None) -> dict:
    """Train scaled and init-reparam under Adam and return :func:`adam_separation` (+ the runs)."""
    config = replace(config or RecallConfig(), optimizer="adam")
    runs = train_runs([replace(config, mechanism=m) for m in ("scaled", "init-reparam")],
                      show_progress=show_progress, desc="init-reparam vs scaled, adam")
    return {**adam_separation(*runs), "runs": runs}


def init_reparam_sgd(config: RecallConfig | None = None, *, lr: float = SGD_LR,
                     show_progress: bool | None = None) -> dict:
    """Under SGD, init-reparam at lr equals scaled with sqrt(d_k) * lr on W_Q and W_K.

    With W = d^(1/4) W' the forward passes agree, dL/dW' = d^(1/4) dL/dW, so an SGD step of lr on W'
    moves W by sqrt(d) lr dL/dW.  Three runs from the same init and data: init-reparam (lr),
    scaled with ``qk_lr_mult = sqrt(d_k)`` (should track it to float rounding; exactly, when d^1/4
    is a power of two as at d_k = 256) and plain scaled (lr; separates).  Returns the largest
    relative gap of the tracking pair over the whole run and the separation step of the plain pair.
    """
    config = replace(config or RecallConfig(), optimizer="sgd", lr=lr)
    reparam, plain = train_runs([replace(config, mechanism="init-reparam"),
                                 replace(config, mechanism="scaled")],
                                show_progress=show_progress, desc="init-reparam vs scaled, sgd")
    boosted = train_runs([replace(config, mechanism="scaled", qk_lr_mult=sqrt_dk(config))],
                         show_progress=show_progress, desc="scaled, sgd, sqrt(d_k) lr on W_Q/W_K")[0]
    return {"optimizer": "sgd", "lr": lr, "d_k": config.d_k, "seed": config.seed,
            "qk_lr_mult": sqrt_dk(config),
            "tracking_max_rel_gap": metrics.max_rel_gap(reparam.loss, boosted.loss),
            "plain_separation_step": metrics.separation_step(reparam.loss, plain.loss),
            "reparam_final_loss": reparam.final_loss, "boosted_final_loss": boosted.final_loss,
            "plain_final_loss": plain.final_loss, "runs": [reparam, boosted, plain]}


def study(mechanisms: Sequence[str] | None = None, d_ks: Sequence[int] = STUDY_D_KS,
          seeds: Sequence[int] = STUDY_SEEDS, config: RecallConfig | None = None,
          *, show_progress: bool | None = None) -> list[RunResult]:
    """Every mechanism (default: the whole registry) x d_k x seed on the same task.

    All runs of one d_k train as one batched model (same data per seed, same init per seed).
    A repeated mechanism, d_k or seed is a :class:`~attnscale.errors.ConfigError`.
    """
    from attnscale.mechanisms import MECHANISMS, check_mechanism
    mechanisms = list(MECHANISMS) if mechanisms is None else \
        [check_mechanism(m, param="mechanisms") for m in check_name_list("mechanisms", mechanisms)]
    configs = sweep(config or RecallConfig(), d_k=check_int_list("d_ks", d_ks, minimum=1),
                    mechanism=mechanisms, seed=check_int_list("seeds", seeds, minimum=0))
    return run_all(configs, show_progress=show_progress)


def study_summary(runs: Sequence[RunResult]) -> list[dict]:
    """One row per (mechanism, d_k): mean and spread over seeds of steps to 0.1 and accuracy."""
    cells: dict[tuple, list[RunResult]] = {}
    for r in runs:
        cells.setdefault((r.config.mechanism, r.config.d_k), []).append(r)
    rows = []
    for (mech, d_k), rs in cells.items():
        steps = metrics.mean_spread([r.steps_to_loss_0_1 for r in rs])
        acc = metrics.mean_spread([r.eval_accuracy for r in rs])
        rows.append({"mechanism": mech, "d_k": d_k, "seeds": len(rs),
                     "steps_to_loss_0_1_mean": steps["mean"], "steps_to_loss_0_1_std": steps["std"],
                     "reached_0_1": steps["n"], "accuracy_mean": acc["mean"],
                     "accuracy_min": acc["min"],
                     "final_loss_mean": sum(r.final_loss for r in rs) / len(rs),
                     "qk_std_trained_mean": sum(r.eval_stats["qk_std"] for r in rs) / len(rs)})
    return rows
