"""``attnscale study``: multi-run studies, one subcommand each; ``study recall`` lives here.

A study module exposes ``register_study(studies)``, which adds its parser to the ``study`` group's
subparsers and sets ``func``; adding a study is one line in :data:`STUDY_MODULES`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from attnscale.cli import _recall
from attnscale.cli._common import (
    add_command, add_executor_options, add_output, add_study_store_options,
    check_one_study_folder, format_table, print_json,
)
from attnscale.errors import ConfigError, parse_int_list
from attnscale.experiments.recall.experiments import STUDY_SEEDS
from attnscale.experiments.recall.outputs import STUDY_FILES
from attnscale.mechanisms import MECHANISMS

# One module per study subcommand, in the order ``attnscale study --help`` lists them.
STUDY_MODULES = (
    __name__,  # study recall (below)
    "attnscale.cli.study_lm",
    "attnscale.cli.study_length",
)

EXAMPLES = """
  attnscale study recall --out study/               # every mechanism x 4 d_k x 3 seeds
  attnscale study recall --out study/ --mechanisms scaled,unscaled,qknorm --d-k 16,64 --seed 0
  attnscale study recall --out /tmp/s --steps 300 --d-k 16 --seed 0 --json --workers 2
  attnscale study recall --resume study/            # after Ctrl-C or a crash: the rest only
  attnscale study recall --from study/              # redraw table, figure, markdown; no training
  attnscale study recall --out study/ --ray auto    # on the Ray cluster of 'ray start'
"""

SUMMARY_COLUMNS = ["mechanism", "d_k", "seeds", "steps_to_loss_0_1_mean", "steps_to_loss_0_1_std",
                   "reached_0_1", "accuracy_mean", "accuracy_min", "final_loss_mean"]


def study_sweep(args, experiment: str, study: str, start: Callable[[str, dict], Any]):
    """The conventions every ``study`` command on the sweep engine shares: exactly one of
    ``--out DIR`` (runs ``start(DIR, executor)``, which returns ``sweep.run``'s results; the same
    grid again continues it), ``--resume DIR`` or ``--from DIR`` (read only); the store must hold an
    ``experiment`` sweep with a finished run, and failed or pending runs are reported on stderr.
    ``study`` names the study in errors ("a recall study").  Returns (folder, results)."""
    from attnscale import sweep
    check_one_study_folder(args)
    executor = {"workers": args.workers, "ray_address": args.ray}
    if args.from_dir is not None:
        out, results = args.from_dir, sweep.load(args.from_dir)
    elif args.resume is not None:
        out, results = args.resume, sweep.resume(args.resume, **executor)
    else:
        out, results = args.out, start(args.out, executor)
    if results.spec.experiment != experiment:
        raise ConfigError(f"{out!r} holds a {results.spec.experiment!r} sweep, not {study}.")
    if not results.ok:
        raise ConfigError(f"{out!r} holds no finished run to draw from.")
    if results.failed or results.pending:
        print(f"drawing {len(results.ok)} runs; {len(results.failed)} failed and "
              f"{len(results.pending)} pending are left out (attnscale sweep --show {out})",
              file=sys.stderr)
    return out, results


def _recall_study(args) -> int:
    """Run the grid on the sweep engine (or continue it, or only read it), then draw the table,
    figure and markdown from the store in the same folder."""
    from attnscale import sweep
    from attnscale.experiments.recall.outputs import write_study
    from attnscale.experiments.recall.trial import run_result
    mechanisms = list(MECHANISMS) if args.mechanisms == "all" else \
        _recall.mechanisms(args.mechanisms)
    grid = {"mechanism": mechanisms, "d_k": parse_int_list("--d-k", args.d_k, minimum=1),
            "seed": parse_int_list("--seed", args.seed, minimum=0)}

    def start(out: str, executor: dict):
        base = _recall.config(args, d_k=_recall.DEFAULT.d_k)  # d_k: validated per run by the grid
        fixed = {k: getattr(base, k) for k in ("pairs", "steps", "lr", "batch_size", "optimizer")}
        return sweep.run("recall", grid, out, fixed=fixed, force=args.force, **executor)

    out, results = study_sweep(args, "recall", "a recall study", start)
    result = write_study(out, [run_result(r) for r in results.ok], force=args.force)
    if args.json:
        print_json({"rows": result["summary"]})
    else:
        print(format_table(result["summary"], SUMMARY_COLUMNS))
        print(f"wrote {', '.join(result['files'].values())}", file=sys.stderr)
    return 0


def register_study(studies) -> None:
    q = add_command(studies, "recall", examples=EXAMPLES,
                    help="Every registered mechanism on associative recall across d_k and seeds; "
                         "writes a table, a figure and a markdown fragment into --out.")
    add_output(q, "--out", kind="dir", files=STUDY_FILES.values(), metavar="DIR",
               help="output directory: the runs' store (see 'attnscale sweep'), and the table, "
                    "figure and markdown drawn from it")
    add_study_store_options(q, "the table, figure and markdown")
    add_executor_options(q)  # the runs of a d_k share one batched model per worker
    q.add_argument("--mechanisms", default="all",
                   help="comma-separated mechanism names, or 'all' (default: %(default)s)")
    q.add_argument("--seed", default=",".join(map(str, STUDY_SEEDS)),
                   help="comma-separated seeds (default: %(default)s)")
    _recall.add_training_options(q, d_k_list=True)
    q.set_defaults(func=_recall_study)


def register(sub) -> None:
    p = add_command(sub, "study", examples=EXAMPLES,
                    help="Multi-run studies; 'study recall' trains every mechanism x d_k x seed.")
    studies = p.add_subparsers(dest="study", metavar="STUDY", parser_class=type(p))
    studies.required = True
    for name in STUDY_MODULES:
        importlib.import_module(name).register_study(studies)
