"""Experiments: a named trial function with typed, defaulted parameters.

An experiment is a function ``fn(**config) -> result`` whose result is JSON-serialisable.  It is
entered into :data:`EXPERIMENTS` under one name by :func:`experiment`, the way mechanisms are
registered; the name is the one used by the CLI, the store and the report::

    @experiment("saturation", threads=1)
    def saturation_cell(*, mechanism: str = "scaled", d_k: int = 64, seed: int = 0) -> dict: ...

Each parameter has a type (``int``, ``float``, ``str``, ``bool`` or ``dict``, optionally
``| None``) and a default, read from the function's signature or given as ``params=`` (see
:func:`params_from_dataclass`).  The type turns CLI text into a value and checks API values, so
``lr=1`` and ``lr=1.0`` are one trial, and so are ``seed=1`` and ``seed=1.0`` (an integral number
is an integer, from the CLI as from JSON).  ``check(config)`` validates a whole config up front
(unknown mechanism, inconsistent sizes) before any trial runs.

One value, one trial: a parameter may also say what its values mean beyond their type.
``canonical(value, settings)`` rewrites a value to the one form of everything equal to it (a
mechanism's options typed by that mechanism, ``{"cap": 20}`` -> ``{"cap": 20.0}``), given the
values every parameter takes in the sweep (``settings``: key -> list).  ``path=True`` marks a file
or folder: its value is stored absolute (resolved when the sweep is created, so a resume from
another directory, or a worker on another node, reads the same file), and ``fingerprint(path)``,
when given, says what it holds (sizes and a hash), which the store records and checks on resume.

``threads`` is the torch thread count every trial of the experiment runs on, whatever the worker
count: a fixed count keeps float reductions, hence results, bit-identical across executors.
``None`` lets the executor give each trial its share of the cores instead.

Batching (optional): ``run_batch(configs) -> [result, ...]`` runs several trials in one call (one
result per config, in order), and ``batch_key(config) -> hashable`` says which may share a call:
trials with equal keys, never one whose key is ``None``.  The executors then send compatible
pending trials to a worker together (see :mod:`attnscale.sweep.batch`), but a trial stays one
config with its own id, record and error, and its result must be the same bytes as when it runs
alone; a mechanism whose batched result differs must get a key of its own (or ``None``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import numbers
import sys
import types
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pathlib import Path

from attnscale.errors import ConfigError, did_you_mean, lookup, parse_json

# Parameter types a grid may hold; dict is a JSON object (a mechanism's options).
PARAM_TYPES = (int, float, str, bool, dict)
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
         dict: "a JSON object"}


@dataclass(frozen=True)
class Param:
    """One config key of an experiment: its type, default, and whether ``None`` is allowed."""
    type: type
    default: Any = inspect.Parameter.empty    # empty: required (must be in the grid or fixed)
    optional: bool = False                    # None is a valid value
    path: bool = False                        # a file or folder: stored resolved (absolute)
    fingerprint: Callable[[str], Any] | None = None   # what a path holds, pinned by the store
    canonical: Callable[[Any, Mapping[str, list]], Any] | None = None  # see the module doc

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty

    def describe(self) -> str:
        name = self.type.__name__ + (" | None" if self.optional else "")
        return name if self.required else f"{name} = {json.dumps(self.default)}"

    def value(self, key: str, value: Any) -> Any:
        """Check an API value against the type; return its canonical form (1 -> 1.0 for float)."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{key} must be {_KIND[self.type]}, got None.")
        t = self.type
        if t is bool:
            if isinstance(value, bool):
                return value
        elif t is int:  # numbers.Integral: numpy integers too
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                return int(value)
            if isinstance(value, float) and value.is_integer():
                return int(value)
        elif t is float:
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                value = float(value)
                if not math.isfinite(value):
                    raise ConfigError(f"{key} must be finite, got {value!r}.")
                return float(value)
        elif t is str:
            if isinstance(value, str):
                if self.path:  # '' is never a path; a relative one is pinned to this directory
                    if not value.strip():
                        raise ConfigError(f"{key} must be a path, got {value!r}.")
                    return str(Path(value).expanduser().resolve())
                return value
        elif t is dict:
            if isinstance(value, Mapping):
                try:  # canonical: a plain dict of JSON values
                    return json.loads(json.dumps(dict(value), allow_nan=False))
                except (TypeError, ValueError) as err:
                    raise ConfigError(f"{key} must be a JSON object ({err}).") from None
        raise ConfigError(f"{key} must be {_KIND[t]}, got {value!r}.")

    def parse(self, key: str, text: str) -> Any:
        """Turn CLI text into a value: ``none``/``null`` for None when optional, JSON for dict."""
        if self.optional and text.lower() in ("none", "null"):
            return None
        t = self.type
        if t is str:
            return self.value(key, text)
        if t is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
        elif t is dict:
            return self.value(key, parse_json(key, text, _KIND[t]))
        else:  # int, float: "1e3" is the integer 1000, as JSON's 1e3 is (one rule for both)
            try:
                value = int(text) if t is int and text.strip().lstrip("+-").isdigit() \
                    else float(text)
            except ValueError:
                value = None
            if value is not None:
                return self.value(key, value)
        raise ConfigError(f"{key} must be {_KIND[t]}, got {text!r}.")


@dataclass(frozen=True)
class Experiment:
    """A registered trial function and its parameters (see the module docstring)."""
    name: str
    fn: Callable[..., Any]
    params: Mapping[str, Param]
    check: Callable[[dict], None] | None = None
    threads: int | None = 1
    doc: str = ""
    batch_key: Callable[[dict], Hashable | None] | None = None
    run_batch: Callable[[Sequence[dict]], Sequence[Any]] | None = None

    @property
    def module(self) -> str:
        """The module that registers this experiment: a worker imports it to find the name."""
        return self.fn.__module__

    @property
    def script(self) -> str | None:
        """The script that defines this experiment, when it is defined in one (module
        ``__main__``, which another process cannot import by that name), else None."""
        if self.module != "__main__":
            return None
        file = getattr(sys.modules.get("__main__"), "__file__", None)
        return str(Path(file).resolve()) if file else None

    def paths(self) -> tuple[str, ...]:
        """The parameters that name a file or folder (``Param.path``)."""
        return tuple(k for k, p in self.params.items() if p.path)

    def key(self, key: str, param: str = "grid key") -> Param:
        """The parameter ``key``; an unknown key is a ConfigError with a "did you mean"."""
        if key not in self.params:
            raise ConfigError(f"Unknown {param} {key!r} for experiment {self.name!r}."
                              f"{did_you_mean(key, self.params)} "
                              f"Keys: {', '.join(self.params)}.")
        return self.params[key]

    def config(self, values: Mapping[str, Any]) -> dict:
        """The full config: every parameter, from ``values`` or its default, in declared order."""
        out = {}
        for key, p in self.params.items():
            if key in values:
                out[key] = values[key]
            elif p.required:
                raise ConfigError(f"experiment {self.name!r} needs {key} ({p.describe()}): "
                                  f"give it in the grid or as a fixed setting.")
            else:
                out[key] = p.default
        return out


EXPERIMENTS: dict[str, Experiment] = {}


def experiment(name: str, *, params: Mapping[str, Param] | None = None,
               check: Callable[[dict], None] | None = None, threads: int | None = 1,
               batch_key: Callable[[dict], Hashable | None] | None = None,
               run_batch: Callable[[Sequence[dict]], Sequence[Any]] | None = None):
    """Decorator entering ``fn`` into :data:`EXPERIMENTS` under ``name`` (duplicates are refused).

    ``params`` defaults to the keyword parameters of ``fn``'s signature (annotation and default).
    ``batch_key`` and ``run_batch`` (both or neither) let trials run together (module docstring).
    """
    if (batch_key is None) != (run_batch is None):
        raise ValueError("batch_key and run_batch go together: give both or neither")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be None or an integer >= 1, got {threads!r}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in EXPERIMENTS:
            raise ValueError(f"experiment {name!r} is already registered "
                             f"(by {EXPERIMENTS[name].module}.{EXPERIMENTS[name].fn.__qualname__})")
        spec = dict(params) if params is not None else params_from_signature(fn)
        for key, p in spec.items():
            if p.type not in PARAM_TYPES:
                raise ValueError(f"experiment {name!r}: parameter {key} has type {p.type!r}; "
                                 f"supported: {', '.join(t.__name__ for t in PARAM_TYPES)}")
            if (p.path or p.fingerprint is not None) and (p.type is not str or not p.path):
                raise ValueError(f"experiment {name!r}: parameter {key} is a path: give it "
                                 f"type str and path=True (and a fingerprint, if any)")
            if not p.required:
                p.value(key, p.default)  # a default must be a valid value of its own type
        EXPERIMENTS[name] = Experiment(name, fn, spec, check, threads,
                                       inspect.getdoc(fn) or "", batch_key, run_batch)
        return fn
    return add


def get(name: str) -> Experiment:
    """The experiment registered as ``name``; unknown names get a "did you mean"."""
    return lookup(EXPERIMENTS, name, "experiment", "Experiments")


def _param(annotation: Any, default: Any, where: str) -> Param:
    """A :class:`Param` from a type annotation such as ``int``, ``float | None`` or ``Mapping``."""
    optional = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            annotation, optional = rest[0], True
    origin = typing.get_origin(annotation) or annotation
    if origin is Mapping:  # Mapping[str, Any] (a config dataclass's options) is a JSON object
        origin = dict
    if origin not in PARAM_TYPES:
        raise ValueError(f"{where}: type {annotation!r} is not one of "
                         f"{', '.join(t.__name__ for t in PARAM_TYPES)}")
    return Param(origin, default, optional)


def params_from_signature(fn: Callable[..., Any]) -> dict[str, Param]:
    """Parameters of ``fn`` (each annotated with a supported type) as :class:`Param` specs."""
    hints = typing.get_type_hints(fn)
    out = {}
    for key, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[key] = _param(hints.get(key, type(p.default)), p.default, f"{fn.__qualname__}.{key}")
    return out


def params_from_dataclass(cls: type) -> dict[str, Param]:
    """Parameters from a config dataclass: one per field, with its type and default."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        out[f.name] = _param(hints[f.name], default, f"{cls.__qualname__}.{f.name}")
    return out
