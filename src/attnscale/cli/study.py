"""``attnscale study NAME``: every registered study (:mod:`attnscale.study`), one command.

The parser of each study is built from its spec: the shared options (``--out``/``--resume``/
``--from``, ``--quick``, ``--workers``, ``--ray``, ``--set``, ``--json``) and the study's own
options, each of which sets a grid axis or a fixed setting of its stores.  No study has code here.
"""

from __future__ import annotations

import sys

from attnscale.cli._common import (
    add_command, add_executor_options, add_output, add_study_store_options,
    check_one_study_folder, format_table, print_json,
)
from attnscale.errors import ConfigError
from attnscale.study import STUDIES, get, launcher
from attnscale.study.fragment import fragment_files
from attnscale.study.spec import Option, Study

EXAMPLES = """
  attnscale study --list                            # the studies, their grids and what they measure
  attnscale study recall --out study/               # every mechanism x 4 d_k x 3 seeds
  attnscale study lm --out lm-study/ --quick        # the quick variant of a study
  attnscale study length --resume length/           # after Ctrl-C or a crash: the rest only
  attnscale study length --resume length/ --extend  # and the mechanisms added since
  attnscale study lm --from lm-study/               # redraw tables, figures and fragment
  attnscale reproduce --out report/ --include lm-study/ --include length/
"""


def _examples(study: Study) -> str:
    n = study.name
    shared = f"""
  attnscale study {n} --out {n}/                 # the full study, one trial per core
  attnscale study {n} --out {n}/ --quick         # {launcher.quick_doc(study)}
  attnscale study {n} --resume {n}/              # after Ctrl-C or a crash: the rest only
  attnscale study {n} --from {n}/                # redraw figures and fragment; no training
  attnscale study {n} --out {n}/ --ray auto      # on the Ray cluster of 'ray start'
"""
    return shared + study.examples.strip("\n") + "\n"


def _dest(option: Option) -> str:
    return option.key  # the experiment parameter it sets


def _shown(value) -> str:
    if callable(value):
        return "all"
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_text(study: Study, option: Option) -> str:
    """What ``option`` is when not given: the full study's grid axis or setting."""
    from attnscale.experiments import registry
    if option.default_text is not None:
        return option.default_text
    for trials in study.stores.values():
        if option.key in trials.grid:
            return _shown(trials.grid[option.key])
        if option.key in trials.fixed:
            return _shown(trials.fixed[option.key])
        exp = registry.get(trials.experiment)
        if option.key in exp.params:
            return _shown(exp.params[option.key].default)
    return "?"


def _add_study(studies, study: Study) -> None:
    q = add_command(studies, study.name, examples=_examples(study), help=study.doc)
    add_output(q, "--out", kind="dir", metavar="DIR",
               files=[launcher.STUDY_FILE, *fragment_files(study)],
               help="study folder: the runs' store" + ("s" if len(study.stores) > 1 else "")
                    + " (see 'attnscale sweep'), and the tables, figures and fragment drawn "
                      "from them; the same settings again continue it")
    add_study_store_options(q, "the tables, figures and fragment")
    q.add_argument("--extend", action="store_true",
                   help="with --resume: also grow the study to this version's grid (values and "
                        "stores added since, e.g. new mechanisms), running only the new trials")
    q.add_argument("--quick", action="store_true",
                   help=f"the quick variant: {launcher.quick_doc(study)} (options given "
                        "explicitly still win)")
    add_executor_options(q)
    q.add_argument("--set", action="append", default=[], metavar="[STORE:]KEY=VALUE",
                   help="one fixed setting of every store that has KEY (or of STORE alone); "
                        "repeatable")
    for option in study.options:
        q.add_argument(option.flag, *option.aliases, dest=_dest(option), choices=option.choices,
                       metavar=option.metavar or ("LIST" if option.axis else "VALUE"),
                       help=f"{option.help} (default: "
                            f"{default_text(study, option).replace('%', '%%')})")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_launch, study_name=study.name)


def _refused(args, study: Study, *, executor: bool) -> list[str]:
    """The options given that only a new run can honour (and the executor's, if ``executor``)."""
    out = [o.flag for o in study.options if getattr(args, _dest(o)) is not None]
    out += ["--set"] * bool(args.set) + ["--quick"] * bool(getattr(args, "quick", False))
    if executor:
        out += ["--workers"] * (args.workers is not None) + ["--ray"] * (args.ray is not None)
    return out


def _launch(args) -> int:
    study = get(args.study_name)
    # Every option's value first, so a bad one is reported whatever else is wrong.
    values = {o: launcher.parse_option(study, o, getattr(args, _dest(o)))
              for o in study.options if getattr(args, _dest(o)) is not None}
    sets = launcher.parse_sets(study, args.set)
    check_one_study_folder(args)
    if args.extend and args.resume is None:
        raise ConfigError("--extend grows a study folder on --resume DIR; give --resume.")
    if args.from_dir is not None:
        refused = _refused(args, study, executor=True)
        if refused:
            raise ConfigError(f"--from only redraws, running nothing; it takes no "
                              f"{', '.join(refused)}.")
        outcome = launcher.redraw(study, args.from_dir, force=args.force)
    elif args.resume is not None:
        refused = _refused(args, study, executor=False)
        if refused:
            raise ConfigError(f"--resume continues the study on the settings it holds; drop "
                              f"{', '.join(refused)} (or start another folder with --out).")
        outcome = launcher.resume(study, args.resume, workers=args.workers, ray=args.ray,
                                  extend=args.extend, force=args.force)
    else:
        axes = {o.key: v for o, v in values.items() if o.axis}
        for o, v in values.items():
            if not o.axis:
                _set_fixed(study, sets, o, v)
        outcome = launcher.run(study, args.out, quick=getattr(args, "quick", False), axes=axes,
                               fixed=sets, workers=args.workers, ray=args.ray,
                               force=args.force)
    _show(outcome, args.json)
    return 0


def _set_fixed(study: Study, fixed: dict, option: Option, value) -> None:
    """``option``'s value as a fixed setting of every store whose experiment has its key."""
    from attnscale.experiments import registry
    for key, trials in study.stores.items():
        if option.key in registry.get(trials.experiment).params:
            if option.key in fixed[key]:
                raise ConfigError(f"{option.flag} and --set {option.key} set the same value; "
                                  "give it once.")
            fixed[key][option.key] = value


def _show(outcome: launcher.Outcome, as_json: bool) -> None:
    a = outcome.analysis
    if as_json:
        print_json({**a.printed, "claims": list(a.claims), "files": dict(outcome.files),
                    "runs": dict(outcome.runs)})
        return
    print(format_table(a.table, a.columns))
    if a.table is not a.claims:
        for c in a.claims:
            print(f"{c['verdict']:>12}  {c['quantity']}")
    print(f"wrote {', '.join(outcome.files.values())}", file=sys.stderr)


def list_studies() -> str:
    """``attnscale study --list``: each study, its doc, what ``--quick`` runs, and its stores'
    grids (full and quick)."""
    lines = []
    for study in STUDIES.values():
        lines += [f"{study.name}: {study.title}", f"  {study.doc}",
                  f"  --quick: {launcher.quick_doc(study)}"]
        try:
            quick = launcher.stores_for(study, quick=True)
        except ConfigError:  # nothing to cut: --quick is refused, as the line above says
            quick = {}
        for label, stores in (("full", study.stores), ("quick", quick)):
            for key, trials in stores.items():
                grid, fixed = trials.resolved()
                axes = " x ".join(f"{k} ({len(v)})" for k, v in grid.items())
                n = 1
                for v in grid.values():
                    n *= len(v)
                lines.append(f"  {label:5} {key}: {trials.experiment}, {axes} = {n} trials"
                             + (f"; {', '.join(f'{k}={v}' for k, v in fixed.items())}"
                                if fixed else ""))
        if study.options:
            lines.append("  options: " + ", ".join(o.flag for o in study.options))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def _study_group(args) -> int:
    if not args.list:
        raise ConfigError(f"give a study ({', '.join(STUDIES)}) or --list.")
    print(list_studies())
    return 0


def register(sub) -> None:
    p = add_command(sub, "study", examples=EXAMPLES,
                    help="Multi-run studies on the sweep engine, each drawn into a report "
                         f"fragment: {', '.join(STUDIES)}.")
    p.add_argument("--list", action="store_true",
                   help="list the studies, their grids and what each measures")
    studies = p.add_subparsers(dest="study", metavar="STUDY", parser_class=type(p))
    for study in STUDIES.values():
        _add_study(studies, study)
    p.set_defaults(func=_study_group)


__all__ = ["list_studies", "register"]
