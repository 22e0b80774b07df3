"""``attnscale guard plot``: the figure of one or more guard logs (JSONL from attnscale.guard)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from attnscale.cli._common import add_command, add_output
from attnscale.errors import ConfigError
from attnscale.io import atomic_write, figure_suffixes

EXAMPLES = """
  attnscale guard plot runs/guard.jsonl --out guard.png
  attnscale guard plot runs/no-clip.jsonl runs/qk-clip.jsonl --out compare.png   # one colour each
"""


def _plot(args) -> int:
    from attnscale.guard import read_log
    from attnscale.guard.plot import plot_guard
    from attnscale.plotting import save

    runs = {}
    for log in args.logs:
        label = Path(log).stem
        if label in runs:
            raise ConfigError(f"two logs are named {label!r}; give each run its own file name.")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            runs[label] = read_log(log)
        for warning in said:  # a torn last line, left out: said once, on one line
            print(f"note: {warning.message}", file=sys.stderr)
    fig = plot_guard(runs)
    atomic_write(args.out, lambda tmp: save(fig, tmp), param="--out", force=args.force)
    print(f"wrote {args.out}")
    return 0


def register(sub) -> None:
    p = add_command(sub, "guard", examples=EXAMPLES,
                    help="figures of attnscale.guard logs (max logit and entropy per layer over "
                         "training steps)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    plot = add_command(actions, "plot", examples=EXAMPLES,
                       help="per layer: every head's max logit (log scale) and the heads' mean "
                            "entropy on [0, ln n] over steps, alarms marked")
    plot.add_argument("logs", nargs="+", metavar="LOG", help="guard JSONL log(s)")
    add_output(plot, "--out", metavar="FIGURE", required=True, suffixes=figure_suffixes(),
               help="figure file to write (.png, .pdf, .svg, ...)")
    plot.set_defaults(func=_plot)
