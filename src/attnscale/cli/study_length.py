"""``attnscale study length``: temperature vs length (issue 13, sections 3 and 4) on the sweep
engine, drawn into a folder that ``attnscale reproduce --include`` takes."""

from __future__ import annotations

import sys

from attnscale.cli._common import (
    add_command, add_executor_options, add_output, add_study_store_options,
    check_one_study_folder, format_table, print_json,
)
from attnscale.errors import ConfigError, check_int

EXAMPLES = """
  attnscale study length --out length/              # the full study, one trial per core
  attnscale study length --out /tmp/len --quick     # ~10 minutes on 2 cores (fewer seeds/steps)
  attnscale study length --resume length/           # after Ctrl-C or a crash: the rest only
  attnscale study length --from length/             # redraw figures and fragment; no training
  attnscale study length --out length/ --ray auto   # on the Ray cluster of 'ray start'
  attnscale reproduce --out report/ --include length/
"""

COLUMNS = ["quantity", "ours", "ci", "verdict"]


def _run(args) -> int:
    from attnscale.experiments.length.study import redraw, run_study
    check_one_study_folder(args)
    if args.from_dir is not None:
        if args.quick or args.workers is not None or args.ray is not None:
            raise ConfigError("--from only redraws; it takes no --quick, --workers or --ray.")
        result = redraw(args.from_dir, force=args.force)
    else:
        if args.workers is not None:
            check_int("--workers", args.workers, minimum=1)
        if args.resume is not None and args.quick:
            raise ConfigError("--resume continues the study with its stored settings; drop "
                              "--quick.")
        result = run_study(args.out if args.resume is None else args.resume, quick=args.quick,
                           resume=args.resume is not None, workers=args.workers,
                           ray_address=args.ray, force=args.force)
    if args.json:
        print_json({"claims": result["claims"], "files": result["files"]})
    else:
        print(format_table(result["claims"], COLUMNS))
        print(f"wrote {', '.join(result['files'].values())}", file=sys.stderr)
    return 0


def register_study(studies) -> None:
    from attnscale.experiments.length.report import FRAGMENT_FILES
    from attnscale.experiments.length.study import SETTINGS_FILE
    q = add_command(studies, "length", examples=EXAMPLES,
                    help="Temperature vs length: recall trained at 16 pairs and scored to 512, "
                         "the small LM trained at context 128 and scored to 1024, and YaRN's "
                         "temperature law measured; writes figures and a report fragment.")
    add_output(q, "--out", kind="dir", files=[SETTINGS_FILE, *FRAGMENT_FILES.values()],
               metavar="DIR", help="study folder: the two sweep stores, the figures and "
                                   "fragment.md/fragment.json for 'reproduce --include'")
    q.add_argument("--quick", action="store_true",
                   help="2 seeds, fewer steps, recall at width 64: about 10 minutes on 2 cores")
    add_study_store_options(q, "the figures and fragment")
    add_executor_options(q)
    q.add_argument("--json", action="store_true", help="print the claims as one JSON object")
    q.set_defaults(func=_run)
