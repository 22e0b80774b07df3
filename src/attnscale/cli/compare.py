"""``attnscale compare``: several mechanisms trained side by side on associative recall, from the
same init on the same data."""

from __future__ import annotations

from attnscale.cli import _recall
from attnscale.cli._common import add_command
from attnscale.errors import parse_int_list
from attnscale.experiments.recall import compare

EXAMPLES = """
  attnscale compare                                 # the essay's demo: scaled vs unscaled
  attnscale compare --mechanisms scaled,unscaled --seed 0,1,2 --plot fig3.png
  attnscale compare --mechanisms scaled,init-reparam,qknorm --steps 800 --json
  attnscale compare --mechanisms scaled,unscaled --output runs.json   # written atomically
"""


def _compare(args) -> int:
    mechanisms = _recall.mechanisms(args.mechanisms)
    seeds = parse_int_list("--seed", args.seed, minimum=0)
    runs = compare(mechanisms, _recall.config(args), seeds=seeds)
    _recall.save(runs, args)
    _recall.show(runs, args)
    return 0


def register(sub) -> None:
    p = add_command(sub, "compare", examples=EXAMPLES,
                    help="Train several mechanisms from the same init on the same data.")
    p.add_argument("--mechanisms", default="scaled,unscaled",
                   help="comma-separated mechanism names (default: %(default)s)")
    p.add_argument("--seed", default="0", help="seed, or comma-separated seeds (default: 0)")
    _recall.add_training_options(p)
    _recall.add_run_outputs(p, plot=True)
    p.set_defaults(func=_compare)
