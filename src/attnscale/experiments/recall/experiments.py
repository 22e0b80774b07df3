"""The essay's training numbers, measured, and what the essay did not run.

Each function returns plain dicts (tidy rows or a flat summary); plotting lives in
:mod:`attnscale.experiments.recall.figures`.

* :func:`grad_decomposition`: the step-0 W_Q gradient ratio, unscaled / scaled, split into the
  sqrt(d_k) the divisor removes and the saturation factor that claws part of it back.
* :func:`logit_scaling`: how the logit std grows with d_k, at init and once trained (the muP
  argument: trained q and k align, so q.k ~ d_k rather than sqrt(d_k)).
* :func:`adam_separation` and :func:`init_reparam_sgd`: "Identical at step 0 is not identical at
  step 10,000".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from attnscale.experiments.recall import metrics
from attnscale.experiments.recall.config import RecallConfig, sqrt_dk
from attnscale.experiments.recall.model import RecallNet, StackedRecall
from attnscale.experiments.recall.task import eval_set
from attnscale.experiments.recall.trainer import (
    TRAIN_THREADS, RunResult, evaluate, run_all,
)
from attnscale.workers import num_threads

# The d_k grid of the logit-scaling exponent fit (the recall study's, attnscale.study.recall).
SCALING_D_KS = (16, 64, 256, 1024)
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


def logit_scaling(d_ks: Sequence[int] = SCALING_D_KS, config: RecallConfig | None = None,
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
    differ by more than :data:`~attnscale.experiments.recall.metrics.SEPARATION_REL`.  The runs
    may differ in length (the report trains init-reparam for fewer steps): they are compared
    over the shorter one's ``steps``, and the final losses are the smoothed losses at its end.
    """
    n = min(len(scaled.loss), len(reparam.loss))
    return {"seed": scaled.config.seed, "optimizer": scaled.config.optimizer, "steps": n,
            "step0_rel_gap": abs(reparam.loss[0] - scaled.loss[0]) / scaled.loss[0],
            "separation_step": metrics.separation_step(reparam.loss[:n], scaled.loss[:n]),
            "scaled_steps_to_loss_0_1": scaled.steps_to_loss_0_1,
            "reparam_steps_to_loss_0_1": reparam.steps_to_loss_0_1,
            "scaled_final_loss": scaled.smoothed[n - 1],
            "reparam_final_loss": reparam.smoothed[n - 1]}


def sgd_configs(config: RecallConfig | None = None, *, lr: float = SGD_LR) -> list[RecallConfig]:
    """The three runs of :func:`sgd_tracking` under SGD at ``lr``: init-reparam, scaled with
    ``qk_lr_mult = sqrt(d_k)``, and plain scaled, from the same init and data."""
    config = replace(config or RecallConfig(), optimizer="sgd", lr=lr)
    return [replace(config, mechanism="init-reparam"),
            replace(config, mechanism="scaled", qk_lr_mult=sqrt_dk(config)),
            replace(config, mechanism="scaled")]


def sgd_tracking(reparam: RunResult, boosted: RunResult, plain: RunResult) -> dict:
    """Under SGD, init-reparam at lr equals scaled with sqrt(d_k) * lr on W_Q and W_K.

    With W = d^(1/4) W' the forward passes agree, dL/dW' = d^(1/4) dL/dW, so an SGD step of lr on W'
    moves W by sqrt(d) lr dL/dW.  Three runs from the same init and data (:func:`sgd_configs`):
    init-reparam (lr), scaled with ``qk_lr_mult = sqrt(d_k)`` (should track it to float rounding;
    exactly, when d^1/4 is a power of two as at d_k = 256) and plain scaled (lr; separates).
    Returns the largest relative gap of the tracking pair over the whole run and the separation
    step of the plain pair.
    """
    config = reparam.config
    return {"optimizer": "sgd", "lr": config.lr, "d_k": config.d_k, "seed": config.seed,
            "qk_lr_mult": boosted.config.qk_lr_mult,
            "tracking_max_rel_gap": metrics.max_rel_gap(reparam.loss, boosted.loss),
            "plain_separation_step": metrics.separation_step(reparam.loss, plain.loss),
            "reparam_final_loss": reparam.final_loss, "boosted_final_loss": boosted.final_loss,
            "plain_final_loss": plain.final_loss, "runs": [reparam, boosted, plain]}


def init_reparam_sgd(config: RecallConfig | None = None, *, lr: float = SGD_LR,
                     show_progress: bool | None = None) -> dict:
    """:func:`sgd_tracking` of the runs of :func:`sgd_configs`, trained here."""
    return sgd_tracking(*run_all(sgd_configs(config, lr=lr), show_progress=show_progress))
