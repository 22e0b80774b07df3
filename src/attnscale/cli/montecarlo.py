"""``attnscale variance`` and ``attnscale saturation``: the essay's Monte Carlo experiments."""

from __future__ import annotations

from attnscale.cli._common import add_command, format_table, print_json
from attnscale.errors import parse_int_list, parse_name_list
from attnscale.measure.montecarlo import ESSAY_D_KS, ESSAY_N, ESSAY_PAIRS, ESSAY_TRIALS, saturation, variance

_DK_DEFAULT = ",".join(map(str, ESSAY_D_KS))

VARIANCE_EXAMPLES = f"""
  attnscale variance                       # the essay's check: d_k = {_DK_DEFAULT}, 100k pairs
  attnscale variance --dk 64 --pairs 1000000 --seed 3
  attnscale variance --dk 4,16,64 --json | python -m json.tool
"""

SATURATION_EXAMPLES = """
  attnscale saturation                     # Figures 1-2: n=256 keys, 2000 trials, d_k=4..1024
  attnscale saturation --dk 4,16,64 --n 256 --trials 2000 --seed 0
  attnscale saturation --dk 4 --n 7        # a small head saturates only over < exp(d_k/2) keys
  attnscale saturation --dk 64 --n 65536 --trials 100 --json
"""


def _variance(args) -> int:
    rows = variance(parse_int_list("--dk", args.dk, minimum=1), args.pairs, args.seed)
    if args.json:
        print_json({"rows": rows})
    else:
        for r in rows:
            r["rel_error_%"] = 100.0 * r["rel_error"]
            r["std_ci95"] = [round(x, 4) for x in r["std_ci95"]]
        print(format_table(rows, ["d_k", "pairs", "std", "predicted", "rel_error_%", "std_ci95",
                                  "kurtosis_theory", "kurtosis_measured"]))
    return 0


def _saturation(args) -> int:
    rows = saturation(parse_int_list("--dk", args.dk, minimum=1), args.n, args.trials, args.seed,
                      parse_name_list("--mechanisms", args.mechanisms))
    if args.json:
        print_json({"rows": rows})
    else:
        print(format_table(rows, ["mechanism", "d_k", "n", "max_weight_mean", "max_weight_se",
                                  "entropy_mean", "entropy_se", "jacobian_fro_mean",
                                  "jacobian_fro_se", "logit_std_mean"]))
    return 0


def register(sub) -> None:
    p = add_command(sub, "variance", examples=VARIANCE_EXAMPLES,
                    help="Std of q.k for Gaussian q, k against the prediction sqrt(d_k).")
    p.add_argument("--dk", default=_DK_DEFAULT, help="comma-separated head sizes d_k "
                   "(default: %(default)s)")
    p.add_argument("--pairs", type=int, default=ESSAY_PAIRS, help="query-key pairs per d_k "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.set_defaults(func=_variance)

    p = add_command(sub, "saturation", examples=SATURATION_EXAMPLES,
                    help="Max weight, entropy and softmax-Jacobian norm of attention over n "
                         "random keys, per mechanism and d_k.")
    p.add_argument("--dk", default=_DK_DEFAULT, help="comma-separated head sizes d_k "
                   "(default: %(default)s)")
    p.add_argument("--n", type=int, default=ESSAY_N, help="keys per query (default: %(default)s)")
    p.add_argument("--trials", type=int, default=ESSAY_TRIALS, help="queries per d_k "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--mechanisms", default="scaled,unscaled",
                   help="comma-separated mechanism names (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.set_defaults(func=_saturation)
