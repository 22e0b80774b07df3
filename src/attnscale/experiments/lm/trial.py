"""The ``lm`` experiment: one small-LM training run as a sweep trial.

Its parameters are the fields of :class:`~attnscale.experiments.lm.train.RunConfig`, with the
same defaults, except that ``mechanism`` and ``options`` are one parameter, ``variant``
(``"qk-layernorm(divisor=False)"``, see :func:`~attnscale.experiments.lm.study.parse_variant`):
a grid is a Cartesian product, and a mechanism's options belong to that mechanism alone.  The
result is the run record of :func:`~attnscale.experiments.lm.train_lm` without its ``timing``
(the store's ``wall_seconds`` stands in), so it is the same bytes on any executor.
"""

from __future__ import annotations

import typing
from dataclasses import fields

from attnscale.experiments.lm.study import parse_variant
from attnscale.experiments.lm.train import RunConfig, train_lm
from attnscale.experiments.registry import Param, experiment

_JOINED = ("mechanism", "options")  # RunConfig fields given as one "variant"


def _params() -> dict[str, Param]:
    hints = typing.get_type_hints(RunConfig)
    out = {"variant": Param(str, RunConfig.mechanism)}
    for f in fields(RunConfig):
        if f.name in _JOINED:
            continue
        args = typing.get_args(hints[f.name])
        optional = type(None) in args
        kind = next(a for a in args if a is not type(None)) if optional else hints[f.name]
        out[f.name] = Param(kind, f.default, optional)
    return out


def run_config(config: dict) -> RunConfig:
    """The RunConfig of a trial config (``variant`` split into mechanism and options)."""
    rest = dict(config)
    name, options = parse_variant(rest.pop("variant"))
    return RunConfig(mechanism=name, options=options, **rest)


def _check(config: dict) -> None:
    run_config(config).validated()


@experiment("lm", params=_params(), check=_check, threads=1)
def lm_run(**config) -> dict:
    """Train one small LM and return its run record (without ``timing``)."""
    record = train_lm(run_config(config))
    record.pop("timing")
    return record
