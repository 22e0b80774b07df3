"""Running the length study: both sweeps into one folder, then the report drawn from them.

Layout of the study folder ``DIR``::

    length_settings.json      which settings (full or --quick) the study runs
    recall-length/            the sweep store of section 3 (see attnscale.sweep)
    lm-length/                the sweep store of section 4
    fragment.md, fragment.json, length_study.json, length_*.png    the report (``--include``)

Everything is resumable: running the same settings into ``DIR`` again runs only what is missing,
and :func:`redraw` draws the report from the stores alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.experiments.length import lm as lm_length
from attnscale.experiments.length import recall as recall_length

SETTINGS_FILE = "length_settings.json"
STORES = {"recall": "recall-length", "lm": "lm-length"}

# The full study (issue 13): 8 mechanisms x 3 seeds of recall at the essay's widths and
# LENGTH_CONFIG's 1200 steps; the LM (width 64, 2 layers) at 2000 steps, 3 mechanisms x 3 seeds.
FULL = {
    "recall": {"grid": {"mechanism": list(recall_length.MECHANISMS), "seed": [0, 1, 2]},
               "fixed": {}},
    "lm": {"grid": {"mechanism": list(lm_length.MECHANISMS), "seed": [0, 1, 2]}, "fixed": {}},
}
# --quick (about 10 minutes on 2 cores): 2 seeds; recall at width 64 (d_k = d_model = 64), 600
# steps, 500 held-out sequences per length; the LM at 600 steps on 16 windows.
QUICK = {
    "recall": {"grid": {"mechanism": list(recall_length.MECHANISMS), "seed": [0, 1]},
               "fixed": {"d_k": 64, "d_model": 64, "steps": 600, "eval_size": 500}},
    "lm": {"grid": {"mechanism": list(lm_length.MECHANISMS), "seed": [0, 1]},
           "fixed": {"steps": 600, "eval_windows": 16}},
}


def settings(quick: bool) -> dict:
    return QUICK if quick else FULL


def _read_settings(out: Path) -> dict | None:
    file = out / SETTINGS_FILE
    if not file.is_file():
        return None
    return json.loads(file.read_text("utf-8"))


def run_study(out: str | os.PathLike, *, quick: bool = False, resume: bool = False,
              workers: int | None = None, ray_address: str | None = None,
              force: bool = False, show_progress: bool | None = None) -> dict:
    """Run (or continue) both sweeps into ``out``, then write the report; returns
    :func:`~attnscale.experiments.length.report.write_report`'s result.

    ``resume`` continues the study stored in ``out`` with its own settings (``quick`` is then
    read from it).  A folder that holds the study under other settings is a ConfigError.
    """
    from attnscale import sweep
    from attnscale.io import atomic_write, check_output_path
    from attnscale.experiments.length.report import FRAGMENT_FILES
    param = "--resume" if resume else "--out"
    path = check_output_path(param, out, kind="dir",
                             files=[SETTINGS_FILE, *FRAGMENT_FILES.values()], force=force)
    stored = _read_settings(path)
    if resume:
        if stored is None:
            raise ConfigError(f"--resume {str(out)!r} holds no length study to resume "
                              f"(no {SETTINGS_FILE}).")
        quick = stored["quick"]
    elif stored is not None and stored["quick"] != quick:
        raise ConfigError(f"--out {str(out)!r} holds the {'quick' if stored['quick'] else 'full'}"
                          f" length study; resume it as it is or choose another folder.")
    chosen = settings(quick)
    atomic_write(path / SETTINGS_FILE, json.dumps({"quick": quick, **chosen}, indent=1),
                 param=param, force=force)
    executor = {"workers": workers, "ray_address": ray_address, "show_progress": show_progress}
    results = {key: sweep.run(STORES[key], chosen[key]["grid"], path / STORES[key],
                              fixed=chosen[key]["fixed"], force=force, **executor)
               for key in STORES}
    return _draw(path, results, force=force)


def redraw(out: str | os.PathLike, *, force: bool = False) -> dict:
    """Draw the report from the stores in ``out`` without running anything."""
    from attnscale import sweep
    path = Path(out)
    if not str(out).strip():
        raise ConfigError("--from must be a path, got ''.")
    if _read_settings(path) is None:
        raise ConfigError(f"--from {str(out)!r} holds no length study (no {SETTINGS_FILE}).")
    results = {key: sweep.load(path / STORES[key]) if (path / STORES[key]).is_dir() else None
               for key in STORES}
    return _draw(path, results, force=force)


def _draw(path: Path, results: dict, *, force: bool) -> dict:
    import sys

    from attnscale.experiments.length.report import write_report
    for key, res in results.items():
        if res is not None and (res.failed or res.pending):
            print(f"{STORES[key]}: drawing {len(res.ok)} trials; {len(res.failed)} failed and "
                  f"{len(res.pending)} pending are left out (attnscale sweep --show "
                  f"{path / STORES[key]})", file=sys.stderr)
    ok = {key: (res.ok if res is not None else []) for key, res in results.items()}
    return write_report(path, ok["recall"], ok["lm"], force=force)
