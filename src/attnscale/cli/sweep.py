"""``attnscale sweep``: run an experiment over a grid, resumably, locally or on a Ray cluster."""

from __future__ import annotations

import sys

from attnscale.cli._common import (
    add_command, add_executor_options, add_output, format_table, print_json,
)
from attnscale.errors import ConfigError
from attnscale.sweep.store import SPEC_FILE

EXAMPLES = """
  attnscale sweep --list                                    # experiments and their parameters
  attnscale sweep recall --grid mechanism=scaled,unscaled,qk-layernorm --grid d_k=16,64,256 \\
      --grid seed=0,1,2 --set steps=600 --out runs/recall --workers 2
  attnscale sweep saturation --grid mechanism=scaled,ssmax --grid d_k=16,64,256 --out runs/sat
  attnscale sweep recall --grid 'options=[{"cap": 20}, {"cap": 50}]' --set mechanism=softcap \\
      --out runs/cap
  attnscale sweep --resume runs/recall                      # after Ctrl-C or a crash
  attnscale sweep --resume runs/recall --retry-errors       # re-run the failed trials too
  attnscale sweep --resume runs/recall --extend --grid seed=0,1,2,3,4   # add seeds 3 and 4
  attnscale sweep --resume runs/recall --force  # continue it as its hand-edited sweep.json reads
  attnscale sweep --show runs/recall                        # finished, failed, pending
  attnscale sweep recall --grid seed=0,1,2,3 --out runs/r --ray          # a local Ray instance
  attnscale sweep recall --grid seed=0,1,2,3 --out runs/r --ray auto     # 'ray start' cluster
"""

# Characters of an error's first line shown in the --show table.
ERROR_WIDTH = 70


def _table(results) -> list[dict]:
    """One row per trial (finished or pending): id, status, the grid values, wall time, error."""
    keys = list(results.spec.grid)
    rows = []
    for r in results.records:
        error = (r.get("error") or "").split("\n", 1)[0]
        rows.append({"trial": r["trial"], "status": r["status"],
                     **{k: r["config"].get(k) for k in keys}, "wall_seconds": r["wall_seconds"],
                     "error": error[:ERROR_WIDTH] + ("..." if len(error) > ERROR_WIDTH else "")
                     or None})
    rows += [{"trial": t.id, "status": "pending", **{k: t.config.get(k) for k in keys}}
             for t in results.pending]
    return rows


def _report(results, args, *, show: bool) -> int:
    rows = _table(results)
    counts = {"ok": len(results.ok), "failed": len(results.failed),
              "pending": len(results.pending)}
    if args.json:
        print_json({"experiment": results.spec.experiment, "dir": str(results.path), **counts,
                    "trials": rows})
    else:
        print(format_table(rows, ["trial", "status", *results.spec.grid, "wall_seconds",
                                  "error"]))
        print(f"{results.spec.experiment}: {counts['ok']} ok, {counts['failed']} failed, "
              f"{counts['pending']} pending", file=sys.stdout if show else sys.stderr)
    if show or not (results.failed or results.pending):
        return 0
    if results.failed:
        print(f"{len(results.failed)} trials failed; see 'attnscale sweep --show {results.path}', "
              f"and rerun them with 'attnscale sweep --resume {results.path} --retry-errors'.",
              file=sys.stderr)
    if results.pending:  # the run ended without an interrupt, yet some trials have no record
        n = len(results.pending)
        print(f"{n} {'trial is' if n == 1 else 'trials are'} still pending; run "
              f"{'it' if n == 1 else 'them'} with "
              f"'attnscale sweep --resume {results.path}'.", file=sys.stderr)
    return 1


def _list(args) -> int:
    from attnscale.sweep import EXPERIMENTS
    rows = [{"experiment": name, "key": key, "type": p.describe()}
            for name, exp in EXPERIMENTS.items() for key, p in exp.params.items()]
    if args.json:
        print_json({"experiments": {name: {key: p.describe() for key, p in exp.params.items()}
                                    for name, exp in EXPERIMENTS.items()}})
    else:
        print(format_table(rows, ["experiment", "key", "type"]))
    return 0


def _executor_options(args) -> dict:
    return {"workers": args.workers, "ray_address": args.ray,
            "cpus_per_trial": args.cpus_per_trial, "gpus_per_trial": args.gpus_per_trial or 0}


def _sweep(args) -> int:
    from attnscale import sweep
    from attnscale.experiments.registry import get as get_experiment
    from attnscale.sweep.grid import parse_fixed, parse_grid
    modes = [m for m, on in (("EXPERIMENT", args.experiment), ("--resume", args.resume),
                             ("--show", args.show), ("--list", args.list)) if on is not None
             and on is not False]
    if len(modes) != 1:
        raise ConfigError("give one of EXPERIMENT (with --out), --resume DIR, --show DIR or "
                          f"--list{'' if not modes else ', not ' + ' and '.join(modes)}.")
    if args.list:
        return _list(args)
    if args.show is not None:
        return _report(sweep.load(args.show), args, show=True)
    if args.set and args.resume is not None:
        raise ConfigError("--set cannot change a stored sweep; its fixed settings are kept.")
    if args.resume is not None:
        if args.out is not None:
            raise ConfigError("--out goes with EXPERIMENT; --resume DIR names the folder.")
        grid = None
        if args.grid:
            from attnscale.sweep.engine import experiment_of
            from attnscale.sweep.store import Store
            store = Store(args.resume)
            grid = parse_grid(experiment_of(store.read_spec(), store), args.grid)
        results = sweep.resume(args.resume, grid=grid, extend=args.extend,
                               retry_errors=args.retry_errors, force=args.force,
                               **_executor_options(args))
        return _report(results, args, show=False)
    if args.out is None:
        raise ConfigError("--out DIR is required: the folder that holds the sweep.")
    exp = get_experiment(args.experiment)
    results = sweep.run(exp.name, parse_grid(exp, args.grid), args.out,
                        fixed=parse_fixed(exp, args.set), extend=args.extend,
                        retry_errors=args.retry_errors, force=args.force,
                        **_executor_options(args))
    return _report(results, args, show=False)


def register(sub) -> None:
    p = add_command(sub, "sweep", examples=EXAMPLES,
                    help="Run an experiment over a grid of settings, resumably, in parallel "
                         "worker processes or on a Ray cluster.")
    p.add_argument("experiment", nargs="?", metavar="EXPERIMENT",
                   help="registered experiment (see --list)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="values of one parameter; the sweep runs every combination "
                        "(repeatable; KEY=[JSON list] for values that hold commas)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a fixed setting (repeatable); other parameters keep their defaults")
    add_output(p, "--out", kind="dir", files=(SPEC_FILE,), metavar="DIR",
               help="folder of the sweep's store (new or empty, or holding this same sweep to "
                    "continue it)")
    p.add_argument("--resume", metavar="DIR", help="continue the sweep stored in DIR")
    p.add_argument("--show", metavar="DIR", help="list finished, failed and pending trials")
    p.add_argument("--list", action="store_true", help="list experiments and their parameters")
    p.add_argument("--retry-errors", action="store_true",
                   help="also re-run the trials that failed")
    p.add_argument("--extend", action="store_true",
                   help="let --grid add values to the stored grid (runs just the new trials)")
    add_executor_options(p)
    p.add_argument("--cpus-per-trial", type=float, metavar="C",
                   help="Ray: CPUs (and torch threads) per trial (default: the experiment's "
                        "thread count, else 1)")
    p.add_argument("--gpus-per-trial", type=float, metavar="G",
                   help="Ray: GPUs per trial, may be fractional (default: 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_sweep)
