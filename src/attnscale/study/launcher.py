"""The one launcher: :func:`run`, :func:`resume` and :func:`redraw` for every registered study, on
the sweep engine (:mod:`attnscale.sweep`).

The study folder ``DIR``::

    study.json                  which study, and the settings of each store (full or --quick)
    sweep.json, results.jsonl   the store, for a study of one store; else one subfolder per store
    fragment.md, fragment.json  the report fragment (``attnscale reproduce --include DIR``)
    <summary>.json, *.png       every table and claim, and the figures

The rules every study keeps, here once:

* **One folder, one study.**  The folder's manifest (:func:`attnscale.io.mark_folder`) records the
  command and the study that write it; another study's folder is refused, even with ``force``,
  unless it holds none of that study's files.
* **A failed start or resume changes nothing.**  Every setting, store and trial config is checked
  before the first file is written; a resume runs each store on the settings it holds, or, with
  ``extend``, grows them to the study's spec as it is now (new trials only).
* **An analysis never pools runs that differ in a setting it does not show.**  A study's analysis
  shows its stores' grid axes; records that differ in any other config field (a sweep extended by
  ``--grid steps=3,6``) are refused, naming the field.
* Failed and pending trials are left out of the drawing, and said so on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from attnscale.errors import ConfigError, check_int, spelled, split_key_value
from attnscale.io import atomic_write, check_output_path, folder_marks, mark_folder
from attnscale.study.fragment import fragment_files, write_fragment
from attnscale.study.registry import STUDIES
from attnscale.study.spec import Analysis, Option, Study, Trials

STUDY_FILE = "study.json"
_STORE_FILES = ("sweep.json", "results.jsonl")


@dataclass(frozen=True)
class Outcome:
    """What a run, resume or redraw drew: the analysis, the files written, and per store how
    many trials are ok, failed and pending."""
    study: Study
    folder: Path
    analysis: Analysis
    files: Mapping[str, str]
    runs: Mapping[str, dict]


# --- the folder -------------------------------------------------------------------------------

def store_paths(study: Study, folder: str | os.PathLike) -> dict[str, Path]:
    """Where each store of ``study`` lives in ``folder``: its :attr:`Trials.folder`, else the
    folder itself for a study of one store and a subfolder named by the store's key for more."""
    folder = Path(folder)
    out = {}
    for key, trials in study.stores.items():
        sub = trials.folder if trials.folder is not None else \
            "" if len(study.stores) == 1 else key
        out[key] = folder / sub if sub else folder
    return out


def _experiment_in(path: Path) -> str | None:
    """The experiment of the sweep stored in ``path``; None when there is none."""
    from attnscale.sweep.store import Store
    store = Store(path)
    if not store.exists():
        return None
    return store.read_spec().experiment


def owner(folder: str | os.PathLike) -> str | None:
    """The study that wrote ``folder``: its manifest's mark, or, for a folder written before
    folders were marked, the registered study whose stores it holds; None for neither."""
    marked = folder_marks(folder).get("study")
    if marked:
        return marked
    for study in STUDIES.values():
        paths = store_paths(study, folder)
        found = [key for key, path in paths.items()
                 if _experiment_in(path) == study.stores[key].experiment]
        if found:
            return study.name
    return None


def _holds_files(study: Study | None, folder: Path) -> bool:
    """Whether ``folder`` holds any file of ``study`` (of any study, for an unknown one)."""
    names = [STUDY_FILE, *_STORE_FILES]
    if study is None:
        names += ["fragment.md", "fragment.json"]
        return any((folder / n).exists() for n in names)
    names += fragment_files(study)
    paths = [folder / n for n in names]
    paths += [p / n for p in store_paths(study, folder).values() for n in _STORE_FILES]
    return any(p.exists() for p in paths)


def _check_owner(study: Study, folder: Path, param: str) -> None:
    """One folder, one study: refuse another study's folder (``--force`` does not override)."""
    other = owner(folder) if folder.is_dir() else None
    if other is None or other == study.name:
        return
    if _holds_files(STUDIES.get(other), folder):
        raise ConfigError(f"{param} {str(folder)!r} holds the {other} study; one folder holds one "
                          f"study, so choose another folder for the {study.name} study.")


def _read_settings(folder: Path) -> dict | None:
    file = folder / STUDY_FILE
    if not file.is_file():
        return None
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(obj, dict) or not isinstance(obj.get("stores"), dict):
            raise ValueError("no 'stores' object")
        for key, entry in obj["stores"].items():
            if not (isinstance(entry, dict) and isinstance(entry.get("experiment"), str)
                    and isinstance(entry.get("grid"), dict)
                    and isinstance(entry.get("fixed"), dict)):
                raise ValueError(f"store {key!r} needs 'experiment', 'grid' and 'fixed'")
    except (ValueError, OSError) as err:
        raise ConfigError(f"{str(file)!r} is not a study file attnscale wrote ({err}).") from None
    return obj


# --- settings ---------------------------------------------------------------------------------

def split_list(flag: str, text: str) -> list[str]:
    """Comma-separated items; commas inside parentheses belong to an item
    (``softcap(cap=30, x=1)``).  An empty list or item is an error."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if not text.strip() or any(not v for v in out):
        raise ConfigError(f"{flag} must be a comma-separated list, got {text!r}.")
    return out


def _param(study: Study, key: str, what: str):
    """The experiment parameter ``key`` of the first store of ``study`` that has it."""
    from attnscale.experiments import registry
    for trials in study.stores.values():
        exp = registry.get(trials.experiment)
        if key in exp.params:
            return exp.params[key]
    raise ConfigError(f"{what}: no store of the {study.name} study has a setting {key!r}.")


def parse_option(study: Study, option: Option, text: str):
    """The value of one of ``study``'s own options from its command-line text: a list for a grid
    axis, one value for a fixed setting; typed, checked and free of repeats."""
    from attnscale.sweep.trial import canonical_json
    p = _param(study, option.key, option.flag)
    items = split_list(option.flag, text) if option.axis else [text]
    if option.axis and option.every is not None and items == ["all"]:
        values = list(option.every())
    else:
        values = [p.parse(option.flag, item) for item in items]
    for v in values:
        if option.minimum is not None and v < option.minimum:
            raise ConfigError(f"{option.flag} must be >= {option.minimum:g}, got {v!r}.")
    if option.check is not None:
        values = [option.check(v) for v in values]
    seen = set()
    for v in values:
        if canonical_json(v) in seen:
            raise ConfigError(f"{option.flag} lists {v!r} more than once; each value must be "
                              "distinct.")
        seen.add(canonical_json(v))
    return values if option.axis else values[0]


def parse_sets(study: Study, items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set KEY=VALUE`` (every store that has KEY) or ``--set STORE:KEY=VALUE`` (one store)
    as ``{store: {key: value}}``, each value typed by that store's experiment."""
    from attnscale.experiments import registry
    out: dict[str, dict[str, Any]] = {key: {} for key in study.stores}
    for text in items:
        target, raw = split_key_value("--set", text)
        store, sep, key = target.rpartition(":")
        keys = [store] if sep else list(study.stores)
        if sep and store not in study.stores:
            raise ConfigError(f"--set {text!r}: the {study.name} study has no store {store!r} "
                              f"(stores: {', '.join(study.stores)}).")
        hit = False
        for s in keys:
            exp = registry.get(study.stores[s].experiment)
            if key not in exp.params:
                continue
            if key in out[s]:
                raise ConfigError(f"--set {key} is given twice; give each setting once.")
            out[s][key] = exp.params[key].parse(f"--set {key}", raw)
            hit = True
        if not hit:
            exp = registry.get(study.stores[keys[0]].experiment)
            exp.key(key, "setting")  # a "did you mean" for the first store's keys
            raise ConfigError(f"--set {key}: no store of the {study.name} study has it.")
    return out


# The axis a study without a quick variant of its own is cut on for --quick (to its first value).
QUICK_AXIS = "seed"


def stores_for(study: Study, quick: bool = False) -> Mapping[str, Trials]:
    """The stores a run of ``study`` starts: the full study's, or with ``quick`` its quick
    variant.  ``--quick`` is one of the launcher's shared options, so a study that defines no
    quick variant gets one: its full grids on one seed (each ``seed`` axis cut to its first
    value); one with no seeds to cut is a ConfigError that says so."""
    if not quick:
        return study.stores
    if study.quick is not None:
        return study.quick
    cut = {}
    for key, trials in study.stores.items():
        seeds = trials.resolved()[0].get(QUICK_AXIS, [])
        cut[key] = trials if len(seeds) < 2 else \
            replace(trials, grid={**trials.grid, QUICK_AXIS: seeds[:1]})
    if cut == dict(study.stores):
        quick_flag = spelled("--quick", "quick=True")
        raise ConfigError(f"the {study.name} study defines no {quick_flag} variant, and none of "
                          f"its stores runs more than one {QUICK_AXIS} to cut; run it without "
                          f"{quick_flag}.")
    return cut


def quick_doc(study: Study) -> str:
    """What ``--quick`` runs for ``study``, in words."""
    if study.quick is not None:
        return study.quick_doc
    return f"the full grid on one {QUICK_AXIS} (the first of each store's)"


def settings(study: Study, *, quick: bool = False, axes: Mapping[str, Sequence] | None = None,
             fixed: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict]:
    """The stores a run starts: ``{key: {"experiment", "grid", "fixed"}}`` of the full study or
    its quick variant, with the grid axes in ``axes`` replaced wherever a store has them, and
    ``fixed`` (``{store: {key: value}}``) set.  A value for a key no store has, or a fixed value
    for a grid axis, is an error."""
    axes, fixed = dict(axes or {}), {k: dict(v) for k, v in (fixed or {}).items()}
    out, used = {}, set()
    for key, trials in stores_for(study, quick).items():
        if axes and trials.default_only:
            continue
        grid, fx = trials.resolved()
        for axis, values in axes.items():
            if axis in grid:
                grid[axis] = list(values)
                used.add(axis)
        for name, value in fixed.get(key, {}).items():
            if name in grid:
                raise ConfigError(f"{name} is a grid axis of the {study.name} study; give its "
                                  "values with the study's own option, not as one setting.")
            fx[name] = value
        out[key] = {"experiment": trials.experiment, "grid": grid, "fixed": fx}
    unused = sorted(set(axes) - used)
    if unused:
        raise ConfigError(f"{unused[0]} is not a grid axis of the {study.name} study.")
    return out


def check_executor(workers: int | None, ray: str | None) -> None:
    """``workers`` and ``ray`` before anything is written (the engine's own rules)."""
    flag, ray_flag = spelled("--workers", "workers"), spelled("--ray", "ray")
    if workers is not None:
        check_int(flag, workers, minimum=1)
        if ray is not None:
            raise ConfigError(f"{flag} applies to the local executor; with {ray_flag}, each "
                              "trial takes its share of the cluster.")
    if ray is not None and (not isinstance(ray, str) or not ray.strip()):
        raise ConfigError(f"{ray_flag} must be an address, 'local' or 'auto', got {ray!r}.")


# --- run, resume, redraw ----------------------------------------------------------------------

def run(study: Study, out: str | os.PathLike, *, quick: bool = False,
        axes: Mapping[str, Sequence] | None = None,
        fixed: Mapping[str, Mapping[str, Any]] | None = None, workers: int | None = None,
        ray: str | None = None, force: bool = False,
        show_progress: bool | None = None) -> Outcome:
    """Run ``study`` into ``out`` (the same settings again continue it), then draw it.

    Every store's settings and trial configs are checked, and a folder that holds other
    settings or another study is refused, before the first file is written."""
    from attnscale import sweep
    from attnscale.experiments import registry
    from attnscale.sweep.grid import SweepSpec, differences
    from attnscale.sweep.store import Store
    param = spelled("--out", "out")
    folder = check_output_path(param, out, kind="dir",
                               files=[STUDY_FILE, *fragment_files(study)],
                               force=force)
    _check_owner(study, folder, param)
    check_executor(workers, ray)
    plan = settings(study, quick=quick, axes=axes, fixed=fixed)
    stored = _read_settings(folder)
    held = "another" if stored is None else "the quick" if stored.get("quick") else "the full"
    paths = store_paths(study, folder)
    for key, s in plan.items():
        exp = registry.get(s["experiment"])
        spec = SweepSpec.build(exp, s["grid"], s["fixed"])
        store = Store(paths[key])
        old = None  # what the folder holds for this store, compared by canonical settings
        if store.exists():
            old = store.read_spec()
        elif stored is not None and key in stored["stores"]:
            kept = stored["stores"][key]
            old = SweepSpec.build(registry.get(kept["experiment"]), kept["grid"], kept["fixed"])
        if old is not None:
            diffs = differences(old, spec)
            if diffs:
                raise ConfigError(f"{param} {str(out)!r} holds {held} {study.name} study under "
                                  f"other settings ({'; '.join(diffs)}); resume it as it is "
                                  f"({spelled('--resume', 'resume()')}) or choose another "
                                  "folder.")
        if not store.exists():
            check_output_path(param, paths[key], kind="dir", files=_STORE_FILES, force=force)
            if exp.check is not None:
                for trial in spec.trials():
                    exp.check(dict(trial.config))
    mark_folder(folder, command=f"attnscale study {study.name}", study=study.name)
    if stored is None:
        atomic_write(folder / STUDY_FILE, json.dumps(
            {"study": study.name, "quick": quick, "stores": plan}, indent=1) + "\n",
            param=param, force=force)
    results = {key: sweep.run(s["experiment"], s["grid"], paths[key], fixed=s["fixed"],
                              workers=workers, ray_address=ray, force=force,
                              show_progress=show_progress)
               for key, s in plan.items()}
    return _draw(study, folder, results, force=force)


def _check_holds(study: Study, folder: Path, param: str) -> None:
    """``folder`` must exist and hold ``study``."""
    shown = str(folder)
    if not shown.strip():
        raise ConfigError(f"{param} must be a path, got ''.")
    if not folder.is_dir():
        raise ConfigError(f"{param} {shown!r} is not a study folder (no such folder).")
    other = owner(folder)
    if other is not None and other != study.name:
        raise ConfigError(f"{param} {shown!r} holds the {other} study, not a {study.name} study.")
    at_top = [k for k, p in store_paths(study, folder).items() if p == folder]
    if at_top:  # a plain sweep folder names its experiment
        found = _experiment_in(folder)
        want = study.stores[at_top[0]].experiment
        if found is not None and found != want:
            raise ConfigError(f"{param} {shown!r} holds a {found!r} sweep, not a {study.name} "
                              "study.")
    if other is None:
        raise ConfigError(f"{param} {shown!r} holds no {study.name} study.")


def resume(study: Study, folder: str | os.PathLike, *, workers: int | None = None,
           ray: str | None = None, show_progress: bool | None = None,
           extend: bool = False, force: bool = False) -> Outcome:
    """Continue the study in ``folder`` on the settings it holds (each store's ``sweep.json``,
    and ``study.json`` for a store not started yet), then draw it.  Everything is read and
    checked before any trial runs, the files it will draw included (``force``: overwrite those
    attnscale did not write), so a resume that fails changes nothing and one that runs can draw.

    ``extend``: also grow the study to its spec as it is now (the full study, or the quick
    variant for a folder started with ``--quick``): each grid axis of a store gains the values
    the spec has and the store lacks (a mechanism registered since, say), appended after its
    own, and a store the spec has gained is started.  Only the new trials run; every trial the
    stores hold keeps its config and its record."""
    from attnscale import sweep
    from attnscale.experiments import registry
    from attnscale.sweep.engine import experiment_of
    from attnscale.sweep.store import Store
    folder, param = Path(folder), spelled("--resume", "folder")
    _check_holds(study, folder, param)
    check_executor(workers, ray)
    check_output_path(param, folder, kind="dir", files=fragment_files(study), force=force)
    stored = _read_settings(folder) or {"stores": {}}
    grown = settings(study, quick=bool(stored.get("quick"))) if extend else {}
    paths = store_paths(study, folder)
    jobs = {}
    for key, path in paths.items():
        store = Store(path)
        if store.exists():
            spec = store.read_spec()
            experiment_of(spec)  # importable, and a readable spec
            check_output_path(param, path, kind="dir", files=("sweep.json",))
            jobs[key] = ("resume", grown_grid(spec, grown.get(key)))
        elif key in stored["stores"]:
            s = stored["stores"][key]
            registry.get(s["experiment"])
            jobs[key] = ("start", s)
        elif key in grown:  # a store the study has gained since the folder was written
            check_output_path(param, path, kind="dir", files=_STORE_FILES)
            jobs[key] = ("start", grown[key])
    if not jobs:
        raise ConfigError(f"{param} {str(folder)!r} holds no {study.name} study to resume.")
    results = {}
    for key, (how, s) in jobs.items():
        if how == "resume":
            results[key] = sweep.resume(paths[key], grid=s, extend=s is not None,
                                        workers=workers, ray_address=ray,
                                        show_progress=show_progress)
        else:
            results[key] = sweep.run(s["experiment"], s["grid"], paths[key], fixed=s["fixed"],
                                     workers=workers, ray_address=ray,
                                     show_progress=show_progress)
    return _draw(study, folder, results, force=force)


def grown_grid(spec, plan: Mapping[str, Any] | None) -> dict[str, list] | None:
    """The grid of stored sweep ``spec`` with each of its axes grown by the values ``plan`` (a
    store of :func:`settings`) has and it lacks, appended in the plan's order; None when ``plan``
    is None or adds nothing."""
    from attnscale.experiments import registry
    from attnscale.sweep.grid import SweepSpec, extended, value_key
    if plan is None or plan["experiment"] != spec.experiment:
        return None
    exp = registry.get(spec.experiment)
    want = SweepSpec.build(exp, plan["grid"], plan["fixed"]).grid   # canonical values
    grid, added = {}, False
    for axis, values in spec.grid.items():
        have = {value_key(v) for v in values}
        new = [v for v in want.get(axis, []) if value_key(v) not in have]
        grid[axis] = [*values, *new]
        added |= bool(new)
    if not added:
        return None
    # The checks sweep.resume makes, now, so that a resume that fails runs nothing.
    extended(spec, SweepSpec.build(exp, grid, {k: v for k, v in spec.base.items()
                                               if k not in grid}), exp)
    return grid


def redraw(study: Study, folder: str | os.PathLike, *, force: bool = False) -> Outcome:
    """Draw the study in ``folder`` from its stores alone, running nothing."""
    from attnscale import sweep
    from attnscale.sweep.store import Store
    folder, param = Path(folder), spelled("--from", "folder")
    _check_holds(study, folder, param)
    check_output_path(param, folder, kind="dir", files=fragment_files(study), force=force)
    results = {key: sweep.load(path) if Store(path).exists() else None
               for key, path in store_paths(study, folder).items()}
    return _draw(study, folder, results, force=force)


def run_trials(trials: Trials, out: str | os.PathLike, *, workers: int | None = None,
               show_progress: bool | None = False) -> list[dict]:
    """Run one store's trials (``trials``, its grid values resolved) into the sweep store
    ``out`` and return their records in grid order; a failed trial is an error naming it.  For
    a caller that needs every run of a grid, such as the report's own recall section."""
    from attnscale import sweep
    grid, fixed = trials.resolved()
    results = sweep.run(trials.experiment, grid, out, fixed=fixed, workers=workers,
                        show_progress=show_progress)
    if results.failed or results.pending:
        bad = (results.failed or [{"trial": results.pending[0].id, "error": "pending"}])[0]
        first = (bad.get("error") or "").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"{trials.experiment} trial {bad['trial']} did not finish: {first[0]}")
    return list(results.ok)


def check_pooling(study: Study, key: str, records: Sequence[dict], *,
                  where: str | None = None) -> None:
    """Records may differ only in the grid axes the study's analysis shows; a record set that
    differs in another config field would be pooled as seeds, and is refused naming it."""
    from attnscale.sweep.trial import canonical_json
    axes = set(study.stores[key].grid)
    values: dict[str, dict[str, Any]] = {}
    for r in records:
        for field, value in r["config"].items():
            values.setdefault(field, {})[canonical_json(value)] = value
    for field, seen in values.items():
        if field not in axes and len(seen) > 1:
            shown = ", ".join(sorted(seen)[:3]) + (", ..." if len(seen) > 3 else "")
            if where is None:
                where = "" if len(study.stores) == 1 else f" in store {key!r}"
            raise ConfigError(f"the {study.name} study's runs{where} differ in {field} "
                              f"({shown}), which its analysis does not show: drawing them would "
                              f"pool them as seeds.  Keep one {field} per study folder.")


def _draw(study: Study, folder: Path, results: Mapping[str, Any], *, force: bool) -> Outcome:
    runs = {}
    for key, res in results.items():
        if res is None:
            continue
        runs[key] = {"ok": len(res.ok), "failed": len(res.failed), "pending": len(res.pending)}
        if res.failed or res.pending:
            prefix = "" if len(study.stores) == 1 else f"{key}: "
            print(f"{prefix}drawing {len(res.ok)} runs; {len(res.failed)} failed and "
                  f"{len(res.pending)} pending are left out (attnscale sweep --show "
                  f"{res.path})", file=sys.stderr)
    records = {key: (list(res.ok) if res is not None else []) for key, res in results.items()}
    if not any(records.values()):
        raise ConfigError(f"{str(folder)!r} holds no finished run of the {study.name} study to "
                          "draw from.")
    for key, recs in records.items():
        check_pooling(study, key, recs)
    analysis = study.analyse(records)
    files = write_fragment(folder, study, analysis, force=force)
    mark_folder(folder, command=f"attnscale study {study.name}", study=study.name)
    return Outcome(study, folder, analysis, files, runs)
