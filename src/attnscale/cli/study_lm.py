"""``attnscale study lm``: the small-LM stability study (issue 12) on the sweep engine: every
variant x learning rate x width x seed as ``lm`` trials in ``--out``, then the report fragment
(:func:`attnscale.experiments.lm.study.write_report`) drawn from the store."""

from __future__ import annotations

import sys

from attnscale.cli._common import add_command, add_output, format_table, print_json
from attnscale.errors import ConfigError, check_unique, parse_int_list
from attnscale.experiments.lm.study import (DEFAULT_SEEDS, DEFAULT_VARIANTS, DEFAULT_WIDTHS,
                                            FRAGMENT_FILES, QUICK_VARIANTS, WORTSMAN_LRS,
                                            parse_variant, sensitivity_rows, write_report)

EXAMPLES = """
  attnscale study lm --out lm-study/ --quick        # 4 mechanisms x 7 LRs, width 64, 1 seed
  attnscale study lm --out lm-study/                # the default study: 9 variants x 7 x 2 x 2
  attnscale study lm --out s/ --mechanisms "scaled,qk-layernorm(divisor=False)" --lrs 1e-3,1e-2
  attnscale study lm --out lm-study/ --resume       # continue an interrupted study
  attnscale study lm --out lm-study/ --ray auto --workers 8
  attnscale study lm --from lm-study/               # redraw figures and fragment, no training
"""

COLUMNS = ["mechanism", "width", "seeds", "mean", "min", "max"]


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
    from attnscale import sweep
    if args.from_dir is not None:
        results = sweep.load(args.from_dir)
        out = args.from_dir
    else:
        if args.out is None:
            raise ConfigError("--out DIR is required (or --from DIR to redraw a finished study).")
        variants = split_variants(args.mechanisms) if args.mechanisms else \
            list(QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS)
        for v in variants:
            parse_variant(v)
        widths = parse_int_list("--widths", args.widths, minimum=1) if args.widths else \
            [min(DEFAULT_WIDTHS)] if args.quick else list(DEFAULT_WIDTHS)
        seeds = parse_int_list("--seeds", args.seeds, minimum=0) if args.seeds else \
            [DEFAULT_SEEDS[0]] if args.quick else list(DEFAULT_SEEDS)
        lrs = parse_lrs(args.lrs) if args.lrs else list(WORTSMAN_LRS)
        grid = {"variant": variants, "lr": lrs, "d_model": widths, "seed": seeds}
        fixed = {k: v for k, v in (("steps", args.steps), ("data", args.data)) if v is not None}
        options = {"workers": args.workers, "ray_address": args.ray}
        results = sweep.run("lm", grid, args.out, fixed=fixed, resume=args.resume,
                            force=args.force, **options)
        out = args.out
    records = [r["result"] for r in results.ok]
    if not records:
        raise ConfigError(f"no finished lm trial in {str(out)!r}.")
    report = write_report(records, out, force=True)  # the folder is this study's own
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
    add_output(q, "--out", kind="dir", metavar="DIR",
               help="study folder: the sweep store, figures and fragment.md")
    q.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="redraw the figures and fragment of a finished study, no training")
    q.add_argument("--mechanisms", help="comma-separated variants, e.g. "
                   "'scaled,qk-layernorm(divisor=False)' (default: the study's nine)")
    q.add_argument("--lrs", help="comma-separated peak learning rates (default: Wortsman's "
                   + ",".join(f"{x:g}" for x in WORTSMAN_LRS) + ")")
    q.add_argument("--widths", help="comma-separated widths (default: "
                   + ",".join(map(str, DEFAULT_WIDTHS)) + ")")
    q.add_argument("--seeds", help="comma-separated seeds (default: "
                   + ",".join(map(str, DEFAULT_SEEDS)) + ")")
    q.add_argument("--steps", type=int, help="optimiser steps per run (default: 500)")
    q.add_argument("--data", metavar="PATH",
                   help="text file or folder (default: the running Python's stdlib .py files)")
    q.add_argument("--quick", action="store_true",
                   help="scaled, unscaled, qk-layernorm, softcap x 7 LRs x the smallest width x "
                        "1 seed (explicit lists still win)")
    q.add_argument("--resume", action="store_true",
                   help="continue the study in --out (on by default for the same grid)")
    q.add_argument("--workers", type=int, metavar="N", help="local worker processes")
    q.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="run trials on Ray (needs pip install 'attnscale[ray]')")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_study)
