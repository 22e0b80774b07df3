"""``attnscale study``: multi-run studies, one subcommand each; ``study recall`` lives here.

A study module exposes ``register_study(studies)``, which adds its parser to the ``study`` group's
subparsers and sets ``func``; adding a study is one line in :data:`STUDY_MODULES`.
"""

from __future__ import annotations

import importlib
import sys

from attnscale.cli import _recall
from attnscale.cli._common import add_command, add_output, format_table, print_json
from attnscale.errors import parse_int_list, parse_name_list
from attnscale.experiments.recall.experiments import STUDY_SEEDS, study
from attnscale.experiments.recall.outputs import STUDY_FILES
from attnscale.mechanisms import MECHANISMS, check_mechanism

# One module per study subcommand, in the order ``attnscale study --help`` lists them.
STUDY_MODULES = (
    __name__,  # study recall (below)
)

EXAMPLES = """
  attnscale study recall --out study/               # all 13 x 4 x 3 = 156 runs: ~30 min, 2 cores
  attnscale study recall --out study/ --mechanisms scaled,unscaled,qknorm --d-k 16,64 --seed 0
  attnscale study recall --out /tmp/s --steps 300 --d-k 16 --seed 0 --json
"""

SUMMARY_COLUMNS = ["mechanism", "d_k", "seeds", "steps_to_loss_0_1_mean", "steps_to_loss_0_1_std",
                   "reached_0_1", "accuracy_mean", "accuracy_min", "final_loss_mean"]


def _recall_study(args) -> int:
    from attnscale.experiments.recall.outputs import write_study
    mechanisms = list(MECHANISMS) if args.mechanisms == "all" else \
        [check_mechanism(m, param="--mechanisms")
         for m in parse_name_list("--mechanisms", args.mechanisms)]
    d_ks = parse_int_list("--d-k", args.d_k, minimum=1)
    seeds = parse_int_list("--seed", args.seed, minimum=0)
    base = _recall.config(args, d_k=_recall.DEFAULT.d_k)  # d_k: validated per run by the grid
    runs = study(mechanisms, d_ks, seeds, base)
    result = write_study(args.out, runs, force=args.force)
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
    add_output(q, "--out", kind="dir", files=STUDY_FILES.values(), required=True, metavar="DIR",
               help="output directory")
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
