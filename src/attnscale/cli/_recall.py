"""Options and output shared by the recall commands ``train`` and ``compare``."""

from __future__ import annotations

import argparse
import json

from attnscale.cli._common import add_output, format_table, print_json
from attnscale.errors import parse_name_list
from attnscale.experiments.recall import RecallConfig
from attnscale.experiments.recall.config import OPTIMIZERS
from attnscale.experiments.recall.experiments import grad_decomposition, milestone_ratios
from attnscale.experiments.recall.trainer import RunResult
from attnscale.io import atomic_write, figure_suffixes
from attnscale.mechanisms import check_mechanism

DEFAULT = RecallConfig()

_RUN_COLUMNS = ["mechanism", "seed", "steps_to_loss_1", "steps_to_loss_0_1", "final_loss",
                "eval_accuracy", "grad_wq_norm_step0", "plateaus", "wall_seconds"]


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The model and optimiser options every recall command shares, and ``--json``."""
    p.add_argument("--d-k", "--dk", dest="d_k", type=int, default=DEFAULT.d_k,
                   help="head size d_k of W_Q, W_K, W_V (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=DEFAULT.pairs,
                   help=f"key-value pairs per sequence, <= {DEFAULT.n_keys} key tokens "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=DEFAULT.steps,
                   help="optimiser steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=DEFAULT.lr,
                   help="learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=DEFAULT.batch_size,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=DEFAULT.optimizer,
                   help="optimizer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_run_outputs(p: argparse.ArgumentParser, *, plot: bool) -> None:
    """``--output FILE`` (the run records as JSON) and, if ``plot``, ``--plot FIGURE``."""
    add_output(p, "--output", metavar="FILE", help='also write {"runs": [...]} to FILE')
    if plot:
        add_output(p, "--plot", metavar="FIGURE", suffixes=figure_suffixes(),
                   help="also save the smoothed loss curves (Figure 3); .png, .pdf, .svg, ...")


def mechanisms(text: str) -> list[str]:
    """The registry names of a ``--mechanisms`` list, each checked, none repeated."""
    return [check_mechanism(m, param="--mechanisms") for m in parse_name_list("--mechanisms", text)]


def config(args, **extra) -> RecallConfig:
    """The RecallConfig that the shared options describe."""
    fields = dict(d_k=args.d_k, pairs=args.pairs, steps=args.steps, lr=args.lr,
                  batch_size=args.batch_size, optimizer=args.optimizer)
    return RecallConfig(**{**fields, **extra})


def show(runs: list[RunResult], args) -> None:
    """Print the runs as JSON or as a table (plus the essay's ratios for scaled vs unscaled)."""
    if args.json:
        print_json({"runs": [r.to_json() for r in runs]})
        return
    rows = []
    for r in runs:
        row = r.to_json()
        row["plateaus"] = ", ".join(f"{p['start']}-{p['end']}@{p['level']:.3g}"
                                    for p in r.plateaus) or None
        rows.append(row)
    print(format_table(rows, _RUN_COLUMNS))
    by_key = {(r.mechanism, r.config.seed): r for r in runs}
    for (mech, seed), s in by_key.items():
        u = by_key.get(("unscaled", seed))
        if mech != "scaled" or u is None:
            continue
        ratios, grad = milestone_ratios(s, u), grad_decomposition(s, u)
        print(f"seed {seed}, unscaled/scaled: steps to loss 1.0 "
              f"{_times(ratios['steps_to_loss_1_ratio'])}, to 0.1 "
              f"{_times(ratios['steps_to_loss_0_1_ratio'])}, final loss "
              f"{_times(ratios['final_loss_ratio'])}; grad W_Q at step 0 {_times(grad['ratio'])} = "
              f"sqrt(d_k) {grad['sqrt_d_k']:.3g} x saturation {grad['saturation']:.3f}")


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def save(runs: list[RunResult], args) -> None:
    """Write ``--output`` (JSON) and ``--plot`` (a figure) atomically, if asked for; both paths
    were checked before training (:func:`attnscale.cli._common.check_outputs`)."""
    if args.output is not None:
        text = json.dumps({"runs": [r.to_json() for r in runs]}, allow_nan=False)
        atomic_write(args.output, text, param="--output", force=args.force)
    if getattr(args, "plot", None) is not None:
        from attnscale.experiments.recall.figures import plot_loss_curves
        from attnscale.plotting import new_figure, save as save_figure
        fig, (ax,) = new_figure(width=6.0, height=4.0)
        plot_loss_curves(ax, runs)
        atomic_write(args.plot, lambda tmp: save_figure(fig, tmp), param="--plot",
                     force=args.force)
