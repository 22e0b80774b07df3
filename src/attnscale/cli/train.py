"""``attnscale train``, ``attnscale compare`` and ``attnscale study recall``: the associative-recall
training demo (the essay's "A Training Demo") and every mechanism trained side by side."""

from __future__ import annotations

import argparse
import json
import sys

from attnscale.cli._common import add_command, add_force, format_table, print_json
from attnscale.errors import ConfigError, parse_int_list, parse_name_list
from attnscale.io import atomic_write
from attnscale.experiments.recall import RecallConfig, compare, train
from attnscale.experiments.recall.config import OPTIMIZERS
from attnscale.experiments.recall.experiments import STUDY_D_KS, STUDY_SEEDS, grad_decomposition, \
    milestone_ratios, study
from attnscale.experiments.recall.trainer import RunResult

_DEFAULT = RecallConfig()

TRAIN_EXAMPLES = """
  attnscale train                                   # scaled, d_k=256: the essay's setting
  attnscale train --mechanism unscaled --steps 1000 --seed 1
  attnscale train --mechanism softcap --option cap=30 --d-k 64
  attnscale train --mechanism init-reparam --optimizer sgd --lr 0.1 --json > run.json
"""

COMPARE_EXAMPLES = """
  attnscale compare                                 # the essay's demo: scaled vs unscaled
  attnscale compare --mechanisms scaled,unscaled --seed 0,1,2 --plot fig3.png
  attnscale compare --mechanisms scaled,init-reparam,qknorm --steps 800 --json
  attnscale compare --mechanisms scaled,unscaled --output runs.json   # written atomically
"""

STUDY_EXAMPLES = """
  attnscale study recall --out study/               # all 13 x 4 x 3 = 156 runs: ~30 min, 2 cores
  attnscale study recall --out study/ --mechanisms scaled,unscaled,qknorm --d-k 16,64 --seed 0
  attnscale study recall --out /tmp/s --steps 300 --d-k 16 --seed 0 --json
"""

_RUN_COLUMNS = ["mechanism", "seed", "steps_to_loss_1", "steps_to_loss_0_1", "final_loss",
                "eval_accuracy", "grad_wq_norm_step0", "plateaus", "wall_seconds"]


def _parse_option(text: str) -> tuple[str, object]:
    """``key=value`` with value read as int, float or string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--option must look like key=value, got {text!r}.")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _config(args, **extra) -> RecallConfig:
    """The RecallConfig that the shared options describe."""
    return RecallConfig(d_k=args.d_k, pairs=args.pairs, steps=args.steps, lr=args.lr,
                        batch_size=args.batch_size, optimizer=args.optimizer, **extra)


def _show(runs: list[RunResult], args) -> None:
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


def _save(runs: list[RunResult], args) -> None:
    """Write ``--output`` (JSON) and ``--plot`` (PNG) atomically, if asked for."""
    if args.output:
        atomic_write(args.output, json.dumps({"runs": [r.to_json() for r in runs]},
                                             allow_nan=False), param="--output", force=args.force)
    if getattr(args, "plot", None):
        from attnscale.experiments.recall.figures import plot_loss_curves
        from attnscale.report.figures import new_figure, save
        fig, (ax,) = new_figure(width=6.0, height=4.0)
        plot_loss_curves(ax, runs)
        atomic_write(args.plot, lambda tmp: save(fig, tmp), param="--plot", force=args.force)


def _train(args) -> int:
    options = dict(_parse_option(o) for o in args.option)
    run = train(_config(args, mechanism=args.mechanism, seed=args.seed, options=options))
    _save([run], args)
    _show([run], args)
    return 0


def _compare(args) -> int:
    mechanisms = parse_name_list("--mechanisms", args.mechanisms)
    seeds = parse_int_list("--seed", args.seed, minimum=0)
    runs = compare(mechanisms, _config(args), seeds=seeds)
    _save(runs, args)
    _show(runs, args)
    return 0


def _study(args) -> int:
    from attnscale.mechanisms import MECHANISMS
    from attnscale.experiments.recall.outputs import write_study
    from attnscale.experiments.recall.outputs import check_study_out
    check_study_out(args.out, force=args.force)  # fail before hours of training, not after
    mechanisms = list(MECHANISMS) if args.mechanisms == "all" else \
        parse_name_list("--mechanisms", args.mechanisms)
    runs = study(mechanisms, parse_int_list("--d-k", args.d_k, minimum=1),
                 parse_int_list("--seed", args.seed, minimum=0),
                 RecallConfig(pairs=args.pairs, steps=args.steps, lr=args.lr,
                              batch_size=args.batch_size, optimizer=args.optimizer))
    result = write_study(args.out, runs, force=args.force)
    if args.json:
        print_json({"rows": result["summary"]})
    else:
        print(format_table(result["summary"], ["mechanism", "d_k", "seeds",
                                               "steps_to_loss_0_1_mean", "steps_to_loss_0_1_std",
                                               "reached_0_1", "accuracy_mean", "accuracy_min",
                                               "final_loss_mean"]))
        print(f"wrote {', '.join(result['files'].values())}", file=sys.stderr)
    return 0


def _add_training_options(p: argparse.ArgumentParser, *, d_k_list: bool = False) -> None:
    if d_k_list:
        p.add_argument("--d-k", "--dk", dest="d_k", default=",".join(map(str, STUDY_D_KS)),
                       help="comma-separated head sizes d_k (default: %(default)s)")
    else:
        p.add_argument("--d-k", "--dk", dest="d_k", type=int, default=_DEFAULT.d_k,
                       help="head size d_k of W_Q, W_K, W_V (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=_DEFAULT.pairs,
                   help=f"key-value pairs per sequence, <= {_DEFAULT.n_keys} key tokens "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=_DEFAULT.steps,
                   help="optimiser steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=_DEFAULT.lr,
                   help="learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=_DEFAULT.batch_size,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=_DEFAULT.optimizer,
                   help="optimizer (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_force(p)


def register(sub) -> None:
    p = add_command(sub, "train", examples=TRAIN_EXAMPLES,
                    help="Train one single-head attention model on associative recall.")
    p.add_argument("--mechanism", default=_DEFAULT.mechanism,
                   help="attention-temperature mechanism (default: %(default)s)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the mechanism, e.g. cap=30 (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default: %(default)s)")
    _add_training_options(p)
    p.add_argument("--output", metavar="FILE", help='also write {"runs": [...]} to FILE')
    p.set_defaults(func=_train)

    p = add_command(sub, "compare", examples=COMPARE_EXAMPLES,
                    help="Train several mechanisms from the same init on the same data.")
    p.add_argument("--mechanisms", default="scaled,unscaled",
                   help="comma-separated mechanism names (default: %(default)s)")
    p.add_argument("--seed", default="0", help="seed, or comma-separated seeds (default: 0)")
    _add_training_options(p)
    p.add_argument("--output", metavar="FILE", help='also write {"runs": [...]} to FILE')
    p.add_argument("--plot", metavar="PNG", help="also save the smoothed loss curves (Figure 3)")
    p.set_defaults(func=_compare)

    p = add_command(sub, "study", examples=STUDY_EXAMPLES,
                    help="Multi-run studies; 'study recall' trains every mechanism x d_k x seed.")
    studies = p.add_subparsers(dest="study", metavar="STUDY", parser_class=type(p))
    studies.required = True
    q = add_command(studies, "recall", examples=STUDY_EXAMPLES,
                    help="Every registered mechanism on associative recall across d_k and seeds; "
                         "writes a table, a figure and a markdown fragment into --out.")
    q.add_argument("--out", required=True, metavar="DIR", help="output directory")
    q.add_argument("--mechanisms", default="all",
                   help="comma-separated mechanism names, or 'all' (default: %(default)s)")
    q.add_argument("--seed", default=",".join(map(str, STUDY_SEEDS)),
                   help="comma-separated seeds (default: %(default)s)")
    _add_training_options(q, d_k_list=True)
    q.set_defaults(func=_study)
