"""``attnscale variance``: the std of ``q.k`` for Gaussian ``q, k`` against ``sqrt(d_k)``."""

from __future__ import annotations

from attnscale.cli._common import add_command, format_table, print_json
from attnscale.errors import parse_int_list
from attnscale.measure.montecarlo import ESSAY_D_KS, ESSAY_PAIRS, variance

DK_DEFAULT = ",".join(map(str, ESSAY_D_KS))

EXAMPLES = f"""
  attnscale variance                       # the essay's check: d_k = {DK_DEFAULT}, 100k pairs
  attnscale variance --dk 64 --pairs 1000000 --seed 3
  attnscale variance --dk 4,16,64 --json | python -m json.tool
"""


def _run(args) -> int:
    rows = variance(parse_int_list("--dk", args.dk, minimum=1), args.pairs, args.seed)
    if args.json:
        print_json({"rows": rows})
        return 0
    for r in rows:
        r["rel_error_%"] = 100.0 * r["rel_error"]
        r["std_ci95"] = [round(x, 4) for x in r["std_ci95"]]
    print(format_table(rows, ["d_k", "pairs", "std", "predicted", "rel_error_%", "std_ci95",
                              "kurtosis_theory", "kurtosis_measured"]))
    return 0


def register(sub) -> None:
    p = add_command(sub, "variance", examples=EXAMPLES,
                    help="Std of q.k for Gaussian q, k against the prediction sqrt(d_k).")
    p.add_argument("--dk", default=DK_DEFAULT, help="comma-separated distinct head sizes d_k "
                   "(default: %(default)s)")
    p.add_argument("--pairs", type=int, default=ESSAY_PAIRS, help="query-key pairs per d_k "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.set_defaults(func=_run)
