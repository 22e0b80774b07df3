"""Grids: which trials a sweep runs, parsed and checked against the experiment's parameters.

A sweep is an experiment, a grid ``{key: [values]}`` and fixed settings ``{key: value}``.  Its
trials are the Cartesian product of the grid values (the first key varies slowest), each on top
of the *base* config: every other parameter, from the fixed settings or its default.

CLI syntax (:func:`parse_grid`, :func:`parse_fixed`)::

    --grid mechanism=scaled,unscaled    comma-separated values, typed by the parameter
    --grid 'options=[{"cap": 30}, {}]'  a JSON list, for values that hold commas
    --set steps=600                     one fixed value (JSON for a dict parameter)

One value, one trial: every value is typed by its parameter (``--grid seed=1,1e0`` is the
integer 1 twice, ``lr=1`` is 1.0) and put in its canonical form (:attr:`Param.canonical`: a
mechanism's options by that mechanism's option types), and values are compared by value
(:func:`value_key`: 20, 20.0 and 2e1 are one), so a repeat is a ConfigError naming the key.  Two
sweeps are the same when their canonical settings are: a default written out (``--set n=256``) is
the sweep that leaves it out.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnscale.errors import ConfigError, parse_json, split_key_value
from attnscale.experiments.registry import Experiment
from attnscale.sweep.trial import Trial, canonical_json, trial_id


def _by_value(value: Any) -> Any:
    """``value`` with every integral float written as an integer (bools kept as they are)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, dict):
        return {k: _by_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_value(v) for v in value]
    return value


def value_key(value: Any) -> str:
    """What makes two values one: canonical JSON with numbers compared by value, so 20, 20.0 and
    2e1 (and ``{"cap": 20}``, ``{"cap": 2e1}``) are one value and 1e-3 is 0.001."""
    return canonical_json(_by_value(value))


def _unique(label: str, values: list) -> list:
    """Values must be distinct (compared by :func:`value_key`)."""
    seen = set()
    for v in values:
        key = value_key(v)
        if key in seen:
            raise ConfigError(f"{label} lists {canonical_json(v)} more than once; each value must "
                              f"be distinct.")
        seen.add(key)
    return values


def canonical(exp: Experiment, grid: Mapping[str, list], fixed: Mapping[str, Any]
              ) -> tuple[dict[str, list], dict[str, Any]]:
    """Grid and fixed values (already typed) in the canonical form their parameters give them
    (:attr:`Param.canonical`, which sees every key's values in this sweep); a grid value that
    becomes another one's twin is a ConfigError naming the key."""
    settings = {k: list(grid[k]) if k in grid else [fixed[k] if k in fixed else p.default]
                for k, p in exp.params.items()}

    def one(key: str, value: Any) -> Any:
        p = exp.params[key]
        return value if p.canonical is None or value is None else p.canonical(value, settings)

    return ({k: _unique(f"grid {k}", [one(k, v) for v in values]) for k, values in grid.items()},
            {k: one(k, v) for k, v in fixed.items()})


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
            values = parse_json(f"--grid {key}", raw, "a JSON list")
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
    pinned: dict[str, dict] = field(default_factory=dict)  # path key -> {path: fingerprint}
    script: str | None = None      # the script that defines the experiment (module __main__)

    @classmethod
    def build(cls, exp: Experiment, grid: Mapping[str, Sequence[Any]],
              fixed: Mapping[str, Any] | None = None) -> SweepSpec:
        grid = check_grid(exp, grid)
        fixed = check_fixed(exp, fixed, grid)
        grid, fixed = canonical(exp, grid, fixed)
        full = exp.config({**fixed, **{k: v[0] for k, v in grid.items()}})
        base = {k: v for k, v in full.items() if k not in grid}
        return cls(exp.name, exp.module, grid, fixed, base, pins(exp, grid, base), exp.script)

    def trials(self) -> list[Trial]:
        """Every trial of the grid, in product order (first key slowest)."""
        keys = list(self.grid)
        out = []
        for combo in itertools.product(*(self.grid[k] for k in keys)):
            # what varies first; a copy each, so no two trials share a mutable value
            config = copy.deepcopy({**dict(zip(keys, combo)), **self.base})
            out.append(Trial(trial_id(self.experiment, config), config))
        return out

    def settings(self) -> dict[str, list]:
        """Every key's values: its grid list, or its one base value."""
        return {**self.grid, **{k: [v] for k, v in self.base.items() if k not in self.grid}}

    def to_json(self) -> dict:
        obj = {"experiment": self.experiment, "module": self.module, "grid": self.grid,
               "fixed": self.fixed, "base": self.base, "pinned": self.pinned}
        return {**obj, "script": self.script} if self.script else obj

    @classmethod
    def from_json(cls, obj: Any) -> SweepSpec:
        """The spec of a ``sweep.json`` object; a ValueError naming the first field that is not
        what attnscale writes."""
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        for name, kind in (("experiment", str), ("module", str), ("grid", dict),
                           ("fixed", dict), ("base", dict)):
            if not isinstance(obj.get(name), kind):
                raise ValueError(f"field {name!r} must be "
                                 f"{'a string' if kind is str else 'an object'}, "
                                 f"got {json.dumps(obj.get(name))}")
        for key, values in obj["grid"].items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"field 'grid' key {key!r} must be a non-empty list of values, "
                                 f"got {json.dumps(values)}")
        pinned = obj.get("pinned", {})
        if not isinstance(pinned, dict) or not all(isinstance(v, dict) for v in pinned.values()):
            raise ValueError(f"field 'pinned' must be an object of objects, "
                             f"got {json.dumps(pinned)}")
        script = obj.get("script")
        if script is not None and not isinstance(script, str):
            raise ValueError(f"field 'script' must be a path, got {json.dumps(script)}")
        return cls(obj["experiment"], obj["module"], dict(obj["grid"]), dict(obj["fixed"]),
                   dict(obj["base"]), dict(pinned), script)


def pins(exp: Experiment, grid: Mapping[str, list], base: Mapping[str, Any]) -> dict[str, dict]:
    """``{key: {path: fingerprint}}`` for every path a trial reads (the path parameters with a
    ``fingerprint``), so a resume can tell when a file changed under the sweep."""
    out: dict[str, dict] = {}
    for key in exp.paths():
        p = exp.params[key]
        values = grid.get(key, [base.get(key)])
        if p.fingerprint is not None:
            found = {v: p.fingerprint(v) for v in values if v is not None}
            if found:
                out[key] = found
    return out


def check_pins(exp: Experiment, spec: SweepSpec, where: str) -> None:
    """Every pinned path must still hold what it held when the sweep in ``where`` was made."""
    for key, found in spec.pinned.items():
        p = exp.params.get(key)
        if p is None or p.fingerprint is None:
            continue
        for path, was in found.items():
            try:
                now = p.fingerprint(path)
            except ConfigError as err:
                raise ConfigError(f"{key} {path!r}, which the sweep in {where!r} reads, cannot be "
                                  f"read now ({str(err).rstrip('.')}); restore it, or start the "
                                  f"sweep again in a new folder.") from None
            if canonical_json(now) != canonical_json(was):
                raise ConfigError(f"{key} {path!r} changed since the sweep in {where!r} was "
                                  f"created (then {canonical_json(was)}, now "
                                  f"{canonical_json(now)}); its trials would mix two data sets: "
                                  f"restore it, or start the sweep again in a new folder.")


def _fmt(values: Any) -> str:
    if isinstance(values, list):
        return ",".join(canonical_json(v) for v in values)
    return canonical_json(values)


def _canonical_settings(spec: SweepSpec, exp: Experiment | None) -> dict[str, list]:
    """The spec's settings in canonical form (stored values as this attnscale reads them)."""
    settings = spec.settings()
    if exp is None:
        return settings
    out = {}
    for key, values in settings.items():
        p = exp.params.get(key)
        try:
            out[key] = [v if p is None or p.canonical is None or v is None
                        else p.canonical(p.value(key, v), settings) for v in values]
        except ConfigError:
            out[key] = values
    return out


def differences(old: SweepSpec, new: SweepSpec, exp: Experiment | None = None) -> list[str]:
    """Human-readable differences between the canonical settings of two specs, e.g.
    ``grid seed: 0,1 -> 0,1,2``: a grid key's set of values, every other key's value (a setting
    given explicitly at its default is no difference)."""
    if old.experiment != new.experiment:
        return [f"experiment: {old.experiment} -> {new.experiment}"]
    a, b = _canonical_settings(old, exp), _canonical_settings(new, exp)
    diffs = []
    keys = dict.fromkeys([*old.grid, *new.grid, *a, *b])  # the grid keys first
    for key in keys:
        where = "grid" if key in old.grid or key in new.grid else "setting"
        if key not in b:
            diffs.append(f"{where} {key}: {_fmt(a[key])} -> (absent)")
        elif key not in a:
            diffs.append(f"{where} {key}: (absent) -> {_fmt(b[key])}")
        elif {value_key(v) for v in a[key]} != {value_key(v) for v in b[key]}:
            diffs.append(f"{where} {key}: {_fmt(a[key])} -> {_fmt(b[key])}")
    return diffs


def extended(old: SweepSpec, new: SweepSpec, exp: Experiment | None = None) -> SweepSpec:
    """The spec that runs ``old``'s trials and ``new``'s: allowed only when ``new`` adds values.

    Every old grid value must stay; a key moved from the fixed settings or defaults into the grid
    must keep its old value among the new ones; other settings may not change.  A value equal to
    a stored one keeps its stored form, so every old trial keeps its config, hence its id.
    Otherwise a ConfigError names the offending key.
    """
    if old.experiment != new.experiment:
        raise ConfigError(f"--extend cannot change the experiment ({old.experiment} -> "
                          f"{new.experiment}).")
    a, b = _canonical_settings(old, exp), _canonical_settings(new, exp)
    for key in old.grid:
        if key not in new.grid:
            raise ConfigError(f"--extend can only add values: grid key {key} is missing.")
        have = {value_key(v) for v in b[key]}
        lost = [v for v in a[key] if value_key(v) not in have]
        if lost:
            raise ConfigError(f"--extend can only add values: grid {key} drops {_fmt(lost)}.")
    for key in new.grid:
        if key not in old.grid and key in a and value_key(a[key][0]) not in \
                {value_key(v) for v in b[key]}:
            raise ConfigError(f"--extend: grid {key} must include the sweep's value "
                              f"{canonical_json(a[key][0])} to keep its trials.")
    for key in set(a) | set(b):
        if key not in new.grid and key not in old.grid and \
                [value_key(v) for v in a.get(key, [None])] != \
                [value_key(v) for v in b.get(key, [None])]:
            raise ConfigError(f"--extend cannot change a setting: {key} "
                              f"{_fmt(a.get(key, [None])[0])} -> {_fmt(b.get(key, [None])[0])}.")
    grid = {}
    for key in new.grid:  # the new order, each value in its stored form where it has one
        stored = {value_key(c): v for c, v in zip(a[key], old.settings()[key])} if key in a \
            else {}
        grid[key] = [stored.get(value_key(c), v) for c, v in zip(b[key], new.grid[key])]
    pinned = {k: {**new.pinned.get(k, {}), **old.pinned.get(k, {})}
              for k in set(old.pinned) | set(new.pinned)}
    return SweepSpec(old.experiment, old.module, grid,
                     {k: v for k, v in old.fixed.items() if k not in new.grid},
                     {k: v for k, v in old.base.items() if k not in new.grid}, pinned,
                     old.script)
