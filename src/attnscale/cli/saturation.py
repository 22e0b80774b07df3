"""``attnscale saturation``: max weight, entropy and ``||J||_F`` of attention over ``n`` random
keys, per mechanism, ``d_k`` and ``n`` (the essay's Figures 1-2)."""

from __future__ import annotations

from attnscale.cli._common import add_command, format_table, print_json
from attnscale.cli.variance import DK_DEFAULT
from attnscale.errors import parse_int_list, parse_name_list
from attnscale.measure.montecarlo import ESSAY_N, ESSAY_TRIALS, saturation

EXAMPLES = """
  attnscale saturation                     # Figures 1-2: n=256 keys, 2000 trials, d_k=4..1024
  attnscale saturation --dk 4,16,64 --n 256 --trials 2000 --seed 0
  attnscale saturation --dk 4 --n 7        # a small head saturates only over < exp(d_k/2) keys
  attnscale saturation --dk 64 --n 16,64,256,1024,4096,16384,65536 --trials 100 --json
"""


def _run(args) -> int:
    rows = saturation(parse_int_list("--dk", args.dk, minimum=1),
                      parse_int_list("--n", args.n, minimum=1), args.trials, args.seed,
                      parse_name_list("--mechanisms", args.mechanisms))
    if args.json:
        print_json({"rows": rows})
        return 0
    print(format_table(rows, ["mechanism", "d_k", "n", "max_weight_mean", "max_weight_se",
                              "entropy_mean", "entropy_se", "jacobian_fro_mean",
                              "jacobian_fro_se", "logit_std_mean", "mass_mean"]))
    return 0


def register(sub) -> None:
    p = add_command(sub, "saturation", examples=EXAMPLES,
                    help="Max weight, entropy and softmax-Jacobian norm of attention over n "
                         "random keys, per mechanism, d_k and n.")
    p.add_argument("--dk", default=DK_DEFAULT, help="comma-separated distinct head sizes d_k "
                   "(default: %(default)s)")
    p.add_argument("--n", default=str(ESSAY_N), help="comma-separated distinct numbers of keys "
                   "per query (default: %(default)s)")
    p.add_argument("--trials", type=int, default=ESSAY_TRIALS,
                   help="queries per (d_k, n) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--mechanisms", default="scaled,unscaled",
                   help="comma-separated distinct mechanism names (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.set_defaults(func=_run)
