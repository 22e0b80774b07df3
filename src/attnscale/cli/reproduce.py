"""``attnscale reproduce``: every essay number and figure, with our value, CI and verdict."""

from __future__ import annotations

import sys
from pathlib import Path

from attnscale.cli._common import add_command, add_output
from attnscale.report.reproduce import REPORT_FILES, reproduce

EXAMPLES = """
  attnscale reproduce                          # writes ./attnscale-report/report.md and figures
  attnscale reproduce --out /tmp/report --seed 1
"""


def _run(args) -> int:
    results = reproduce(args.out, args.seed, force=args.force)
    claims = results["claims"]
    n_ok = sum(c["agrees"] for c in claims)
    for c in claims:
        mark = "ok  " if c["agrees"] else "DIFF"
        print(f"{mark} {c['quantity']}: essay {c['essay']}, ours {c['ours']:.4g} — {c['verdict']}")
    print(f"{n_ok}/{len(claims)} claims agree. Report: {Path(args.out) / 'report.md'}",
          file=sys.stderr)
    return 0


def register(sub) -> None:
    p = add_command(sub, "reproduce", examples=EXAMPLES,
                    help="Run every essay experiment; write report.md, results.json and figures.")
    add_output(p, "--out", kind="dir", files=REPORT_FILES, default="attnscale-report",
               help="output directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.set_defaults(func=_run)
