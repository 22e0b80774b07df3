"""``attnscale results DIR``: the results page (:mod:`attnscale.study.page`), drawn from the study
folders in DIR; ``--check`` says whether the page is up to date with their stores."""

from __future__ import annotations

import sys

from attnscale.cli._common import add_command, add_force

EXAMPLES = """
  attnscale study lm --out results/lm && attnscale study length --out results/length
  attnscale results results/            # writes results/README.md from results/lm, results/length
  attnscale results docs/results --check  # exit 1 when the page differs from its stores
"""


def _run(args) -> int:
    from attnscale.study import page
    root = page.check_root(args.dir)
    if not page.studies_in(root):
        from attnscale.errors import ConfigError
        raise ConfigError(f"DIR {args.dir!r} holds none of the study folders "
                          f"{', '.join(page.STUDY_FOLDERS)}.")
    if args.check:
        if page.stale(root):
            print(f"{root / page.PAGE} is out of date with its stores; run "
                  f"'attnscale results {args.dir}' to redraw it", file=sys.stderr)
            return 1
        print(f"{root / page.PAGE} is up to date")
        return 0
    print(f"wrote {page.write(root, force=args.force)}")
    return 0


def register(sub) -> None:
    p = add_command(sub, "results", examples=EXAMPLES,
                    help="write the results page DIR/README.md (which mechanism should my model "
                         "use?) from the study folders in DIR (lm, length, recall)")
    p.add_argument("dir", metavar="DIR", help="folder holding the study folders")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when DIR/README.md differs from its stores")
    add_force(p)
    p.set_defaults(func=_run)
