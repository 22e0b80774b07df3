"""``attnscale reproduce``: every essay number and figure, with our value, CI and verdict."""

from __future__ import annotations

import sys
from pathlib import Path

from attnscale.cli._common import add_command, add_output
from attnscale.report.include import SECTION_NAME
from attnscale.report.reproduce import REPORT_FILES, REPRODUCE_WORKERS, reproduce
from attnscale.report.sections.recall import FULL_SEEDS, SECTION_SEEDS

EXAMPLES = """
  attnscale reproduce                          # writes ./attnscale-report/report.md and figures
  attnscale reproduce --out /tmp/report --seed 1
  attnscale reproduce --full --out /tmp/full   # the training demo over 32 seeds (minutes)
  attnscale reproduce --out /tmp/report --include lm-study --include length-study
                                               # add finished studies as "Beyond the essay"
"""


def _run(args) -> int:
    results = reproduce(args.out, args.seed, include=args.include, force=args.force,
                        workers=args.workers, full=args.full)
    claims = results["claims"]
    n_ok = sum(c["agrees"] for c in claims)
    for c in claims:
        mark = "ok  " if c["agrees"] else "DIFF"
        print(f"{mark} {c['quantity']}: essay {c['essay']}, ours {c['ours']:.4g} — {c['verdict']}")
    summary = f"{n_ok}/{len(claims)} claims agree."
    studied = [r for r in results["sections"].get(SECTION_NAME, []) if r["kind"] == "claim"]
    for c in studied:
        mark = "ok  " if c["agrees"] else "DIFF"
        ours = "—" if c["ours"] is None else f"{c['ours']:.4g}"
        print(f"{mark} [{c['study']}] {c['quantity']}: expected {c['expected']}, ours {ours} — "
              f"{c['verdict']}")
    if studied:
        summary += (f" Included studies: {sum(c['agrees'] for c in studied)}/{len(studied)} "
                    "of their claims agree.")
    print(f"{summary} Report: {Path(args.out) / 'report.md'}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = add_command(sub, "reproduce", examples=EXAMPLES,
                    help="Run every essay experiment; write report.md, results.json and figures.")
    add_output(p, "--out", kind="dir", files=REPORT_FILES, default="attnscale-report",
               help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--workers", type=int, default=REPRODUCE_WORKERS,
                   help="processes the sections run on, this one included; the report is the "
                        "same for any count (default: %(default)s)")
    p.add_argument("--full", action="store_true",
                   help=f"the long form: the training demo's seed-counted claims (the stall rate, "
                        f"the ratios) over {FULL_SEEDS} seeds instead of {SECTION_SEEDS}; minutes "
                        "instead of the default's half minute")
    p.add_argument("--include", metavar="DIR", action="append", default=[],
                   help="a finished study folder (fragment.md, optional fragment.json, its PNGs) "
                        "to add to the report as 'Beyond the essay'; repeat for several")
    p.set_defaults(func=_run)
