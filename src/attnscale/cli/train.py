"""``attnscale train``: one single-head attention model trained on associative recall (the essay's
"A Training Demo")."""

from __future__ import annotations

from attnscale.cli import _recall
from attnscale.cli._common import add_command, parse_options
from attnscale.experiments.recall import train
from attnscale.mechanisms import check_mechanism

EXAMPLES = """
  attnscale train                                   # scaled, d_k=256: the essay's setting
  attnscale train --mechanism unscaled --steps 1000 --seed 1
  attnscale train --mechanism softcap --option cap=30 --d-k 64
  attnscale train --mechanism init-reparam --optimizer sgd --lr 0.1 --json > run.json
"""


def _train(args) -> int:
    check_mechanism(args.mechanism, param="--mechanism")
    options = parse_options(args.option, args.mechanism)
    check_mechanism(args.mechanism, options, param="--mechanism")
    run = train(_recall.config(args, mechanism=args.mechanism, seed=args.seed, options=options))
    _recall.save([run], args)
    _recall.show([run], args)
    return 0


def register(sub) -> None:
    p = add_command(sub, "train", examples=EXAMPLES,
                    help="Train one single-head attention model on associative recall.")
    p.add_argument("--mechanism", default=_recall.DEFAULT.mechanism,
                   help="attention-temperature mechanism (default: %(default)s)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the mechanism, e.g. cap=30 (repeatable, each key once)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default: %(default)s)")
    _recall.add_training_options(p)
    _recall.add_run_outputs(p, plot=False)
    p.set_defaults(func=_train)
