"""``attnscale study lm``: the small-LM stability study (issue 12) on the sweep engine: every
variant x learning rate x width x seed as ``lm`` trials in ``--out``, then the report fragment
(:func:`attnscale.experiments.lm.study.write_report`) drawn from the store."""

from __future__ import annotations

import sys

from attnscale.cli._common import (
    add_command, add_executor_options, add_output, add_study_store_options, format_table,
    print_json,
)
from attnscale.cli.study import study_sweep
from attnscale.errors import ConfigError, check_unique, parse_int_list
from attnscale.experiments.lm.study import (DEFAULT_SEEDS, DEFAULT_VARIANTS, DEFAULT_WIDTHS,
                                            FRAGMENT_FILES, QUICK_VARIANTS, WORTSMAN_LRS,
                                            parse_variant, sensitivity_rows, write_report)

EXAMPLES = """
  attnscale study lm --out lm-study/ --quick        # 4 mechanisms x 7 LRs, width 64, 1 seed
  attnscale study lm --out lm-study/                # the default study: 9 variants x 7 x 2 x 2
  attnscale study lm --out s/ --mechanisms "scaled,qk-layernorm(divisor=False)" --lrs 1e-3,1e-2
  attnscale study lm --resume lm-study/             # continue an interrupted study
  attnscale study lm --out lm-study/ --ray auto --workers 8
  attnscale study lm --from lm-study/               # redraw figures and fragment, no training
"""

COLUMNS = ["mechanism", "width", "seeds", "mean", "min", "max"]
# The list options' defaults: the default study (--quick narrows those left at their default).
_DEFAULTS = {"mechanisms": ",".join(DEFAULT_VARIANTS),
             "lrs": ",".join(f"{x:g}" for x in WORTSMAN_LRS),
             "widths": ",".join(map(str, DEFAULT_WIDTHS)), "seeds": ",".join(map(str, DEFAULT_SEEDS))}


def split_variants(text: str) -> list[str]:
    """Comma-separated variants; commas inside parentheses belong to a variant's options."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if not text.strip() or any(not v for v in out):
        raise ConfigError(f"--mechanisms must be a comma-separated list, got {text!r}.")
    return check_unique("--mechanisms", out)


def parse_lrs(text: str) -> list[float]:
    try:
        lrs = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--lrs must be comma-separated numbers, got {text!r}.") from None
    if any(not lr > 0 for lr in lrs):
        raise ConfigError(f"--lrs must all be > 0, got {text!r}.")
    return check_unique("--lrs", lrs)


def _study(args) -> int:
    """Run the grid on the sweep engine (or continue it, or only read it), then draw the report
    from the store in the same folder (the conventions of ``study recall``)."""
    from attnscale import sweep
    # Every list first, so a bad one is reported whatever else is wrong (as study recall does).
    variants = split_variants(args.mechanisms)
    for v in variants:
        parse_variant(v)
    lrs = parse_lrs(args.lrs)
    widths = parse_int_list("--widths", args.widths, minimum=1)
    seeds = parse_int_list("--seeds", args.seeds, minimum=0)
    if args.quick:  # --quick's lists, where no list was given explicitly
        variants = list(QUICK_VARIANTS) if args.mechanisms == _DEFAULTS["mechanisms"] else variants
        widths = [min(widths)] if args.widths == _DEFAULTS["widths"] else widths
        seeds = seeds[:1] if args.seeds == _DEFAULTS["seeds"] else seeds

    def start(out: str, executor: dict):
        grid = {"variant": variants, "lr": lrs, "d_model": widths, "seed": seeds}
        fixed = {k: v for k, v in (("steps", args.steps), ("data", args.data)) if v is not None}
        return sweep.run("lm", grid, out, fixed=fixed, force=args.force, **executor)

    out, results = study_sweep(args, "lm", "an lm study", start)
    records = [r["result"] for r in results.ok]
    report = write_report(records, out, force=args.force)
    rows = sensitivity_rows(records)
    if args.json:
        print_json({"sensitivity": rows, "claims": report["claims"],
                    "failed": len(results.failed), "pending": len(results.pending)})
    else:
        print(format_table(rows, COLUMNS))
        for c in report["claims"]:
            print(f"{c['verdict']:>12}  {c['claim']}")
        print(f"wrote {', '.join(report['files'].values())}", file=sys.stderr)
    return 0


def register_study(studies) -> None:
    q = add_command(studies, "lm", examples=EXAMPLES,
                    help="Which mechanism keeps a small LM trainable across learning rates "
                         "(Wortsman et al.'s LR sensitivity), on the sweep engine.")
    add_output(q, "--out", kind="dir", files=FRAGMENT_FILES.values(), metavar="DIR",
               help="study folder: the runs' store (see 'attnscale sweep'), and the figures and "
                    "fragment drawn from it; the same grid again continues it")
    add_study_store_options(q, "the figures and fragment")
    q.add_argument("--mechanisms", default=_DEFAULTS["mechanisms"],
                   help="comma-separated variants, e.g. 'scaled,qk-layernorm(divisor=False)' "
                        "(default: %(default)s)")
    q.add_argument("--lrs", default=_DEFAULTS["lrs"],
                   help="comma-separated peak learning rates (default: Wortsman's, %(default)s)")
    q.add_argument("--widths", default=_DEFAULTS["widths"],
                   help="comma-separated widths (default: %(default)s)")
    q.add_argument("--seeds", default=_DEFAULTS["seeds"],
                   help="comma-separated seeds (default: %(default)s)")
    q.add_argument("--steps", type=int, help="optimiser steps per run (default: 500)")
    q.add_argument("--data", metavar="PATH",
                   help="text file or folder (default: the running Python's stdlib .py files)")
    q.add_argument("--quick", action="store_true",
                   help="scaled, unscaled, qk-layernorm, softcap x 7 LRs x the smallest width x "
                        "the first seed (lists given explicitly still win)")
    add_executor_options(q)
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_study)
