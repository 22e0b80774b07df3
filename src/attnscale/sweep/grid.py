"""Grids: which trials a sweep runs, parsed and checked against the experiment's parameters.

A sweep is an experiment, a grid ``{key: [values]}`` and fixed settings ``{key: value}``.  Its
trials are the Cartesian product of the grid values (the first key varies slowest), each on top
of the *base* config: every other parameter, from the fixed settings or its default.

CLI syntax (:func:`parse_grid`, :func:`parse_fixed`)::

    --grid mechanism=scaled,unscaled    comma-separated values, typed by the parameter
    --grid 'options=[{"cap": 30}, {}]'  a JSON list, for values that hold commas
    --set steps=600                     one fixed value (JSON for a dict parameter)
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attnscale.errors import ConfigError, split_key_value
from attnscale.experiments.registry import Experiment
from attnscale.sweep.trial import Trial, canonical_json, trial_id


def _unique(label: str, values: list) -> list:
    """Values must be distinct (compared by canonical JSON: 1e-3 and 0.001 are one value)."""
    seen = set()
    for v in values:
        text = canonical_json(v)
        if text in seen:
            raise ConfigError(f"{label} lists {text} more than once; each value must be distinct.")
        seen.add(text)
    return values


def check_grid(exp: Experiment, grid: Mapping[str, Sequence[Any]]) -> dict[str, list]:
    """Check API grid values against the parameter types; return the canonical grid."""
    if not isinstance(grid, Mapping):
        raise ConfigError(f"grid must be a mapping of key to a list of values, got {grid!r}.")
    out = {}
    for key, values in grid.items():
        p = exp.key(key)
        label = f"grid {key}"
        if hasattr(values, "tolist") and not isinstance(values, Sequence):  # a numpy array
            values = values.tolist()
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
            raise ConfigError(f"{label} must be a list of values, got {values!r}.")
        if not values:
            raise ConfigError(f"{label} must not be empty.")
        out[key] = _unique(label, [p.value(key, v) for v in values])
    return out


def check_fixed(exp: Experiment, fixed: Mapping[str, Any] | None,
                grid: Mapping[str, Any]) -> dict[str, Any]:
    """Check fixed settings; a key may not be both fixed and in the grid."""
    if fixed is not None and not isinstance(fixed, Mapping):
        raise ConfigError(f"fixed must be a mapping of key to value, got {fixed!r}.")
    fixed = dict(fixed or {})
    out = {}
    for key, value in fixed.items():
        p = exp.key(key, "setting")
        if key in grid:
            raise ConfigError(f"{key} is both in the grid and fixed; give it once.")
        out[key] = p.value(key, value)
    return out


def parse_grid(exp: Experiment, items: Sequence[str]) -> dict[str, list]:
    """``["key=v1,v2", 'key=[json, ...]']`` from ``--grid``, typed by the parameters."""
    grid: dict[str, list] = {}
    for text in items:
        key, raw = split_key_value("--grid", text)
        p = exp.key(key)
        if key in grid:
            raise ConfigError(f"--grid {key} is given twice; list all its values in one --grid.")
        if raw.lstrip().startswith("["):
            try:
                values = json.loads(raw)
            except ValueError as err:
                raise ConfigError(f"--grid {key}: not a JSON list ({err}).") from None
            if not isinstance(values, list):
                raise ConfigError(f"--grid {key}: not a JSON list, got {raw!r}.")
            grid[key] = [p.value(key, v) for v in values]
        else:
            parts = [part.strip() for part in raw.split(",")]
            if any(not part for part in parts):
                raise ConfigError(f"--grid {key} has an empty value in {raw!r}.")
            grid[key] = [p.parse(key, part) for part in parts]
    return check_grid(exp, grid)


def parse_fixed(exp: Experiment, items: Sequence[str]) -> dict[str, Any]:
    """``["key=value"]`` from ``--set``, typed by the parameters."""
    fixed: dict[str, Any] = {}
    for text in items:
        key, raw = split_key_value("--set", text)
        p = exp.key(key, "setting")
        if key in fixed:
            raise ConfigError(f"--set {key} is given twice.")
        fixed[key] = p.parse(key, raw.strip())
    return fixed


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep runs; stored in ``sweep.json`` (see :mod:`attnscale.sweep.store`)."""
    experiment: str
    module: str                    # imported by workers to find the experiment
    grid: dict[str, list]          # key -> values, in the order given
    fixed: dict[str, Any]          # the settings given explicitly
    base: dict[str, Any]           # every non-grid parameter: fixed, else its default

    @classmethod
    def build(cls, exp: Experiment, grid: Mapping[str, Sequence[Any]],
              fixed: Mapping[str, Any] | None = None) -> SweepSpec:
        grid = check_grid(exp, grid)
        fixed = check_fixed(exp, fixed, grid)
        full = exp.config({**fixed, **{k: v[0] for k, v in grid.items()}})
        base = {k: v for k, v in full.items() if k not in grid}
        return cls(exp.name, exp.module, grid, fixed, base)

    def trials(self) -> list[Trial]:
        """Every trial of the grid, in product order (first key slowest)."""
        keys = list(self.grid)
        out = []
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            # what varies first; a copy each, so no two trials share a mutable value
            config = copy.deepcopy({**dict(zip(keys, combo)), **self.base})
            out.append(Trial(trial_id(self.experiment, config), config))
        return out

    def to_json(self) -> dict:
        return {"experiment": self.experiment, "module": self.module, "grid": self.grid,
                "fixed": self.fixed, "base": self.base}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SweepSpec:
        return cls(obj["experiment"], obj["module"], dict(obj["grid"]), dict(obj["fixed"]),
                   dict(obj["base"]))


def _fmt(values: Any) -> str:
    if isinstance(values, list):
        return ",".join(canonical_json(v) for v in values)
    return canonical_json(values)


def differences(old: SweepSpec, new: SweepSpec) -> list[str]:
    """Human-readable differences between two specs, e.g. ``grid seed: 0,1 -> 0,1,2``."""
    diffs = []
    if old.experiment != new.experiment:
        diffs.append(f"experiment: {old.experiment} -> {new.experiment}")
        return diffs
    for what in ("grid", "fixed"):
        a, b = getattr(old, what), getattr(new, what)
        for key in list(a) + [k for k in b if k not in a]:
            if key not in b:
                diffs.append(f"{what} {key}: {_fmt(a[key])} -> (absent)")
            elif key not in a:
                diffs.append(f"{what} {key}: (absent) -> {_fmt(b[key])}")
            elif canonical_json(a[key]) != canonical_json(b[key]):
                diffs.append(f"{what} {key}: {_fmt(a[key])} -> {_fmt(b[key])}")
    return diffs


def extended(old: SweepSpec, new: SweepSpec) -> SweepSpec:
    """The spec that runs ``old``'s trials and ``new``'s: allowed only when ``new`` adds values.

    Every old grid value must stay; a key moved from the fixed settings or defaults into the grid
    must keep its old value among the new ones (so every old trial keeps its config, hence its id);
    other fixed settings may not change.  Otherwise a ConfigError names the offending key.
    """
    if old.experiment != new.experiment:
        raise ConfigError(f"--extend cannot change the experiment ({old.experiment} -> "
                          f"{new.experiment}).")
    for key, values in old.grid.items():
        if key not in new.grid:
            raise ConfigError(f"--extend can only add values: grid key {key} is missing.")
        have = {canonical_json(v) for v in new.grid[key]}
        lost = [v for v in values if canonical_json(v) not in have]
        if lost:
            raise ConfigError(f"--extend can only add values: grid {key} drops {_fmt(lost)}.")
    for key in new.grid:
        if key not in old.grid and canonical_json(old.base[key]) not in \
                {canonical_json(v) for v in new.grid[key]}:
            raise ConfigError(f"--extend: grid {key} must include the sweep's value "
                              f"{canonical_json(old.base[key])} to keep its trials.")
    for key in set(old.fixed) | set(new.fixed):
        if key not in new.grid and canonical_json(old.fixed.get(key)) != \
                canonical_json(new.fixed.get(key)):
            raise ConfigError(f"--extend cannot change a fixed setting: {key} "
                              f"{_fmt(old.fixed.get(key))} -> {_fmt(new.fixed.get(key))}.")
    return SweepSpec(old.experiment, old.module, dict(new.grid),
                     {k: v for k, v in old.fixed.items() if k not in new.grid},
                     {k: v for k, v in old.base.items() if k not in new.grid})
