"""The ``lm`` experiment: one small-LM training run as a sweep trial.

Its parameters are the fields of :class:`~attnscale.experiments.lm.train.LMRunConfig`, with the
same defaults, except that ``mechanism`` and ``options`` are one parameter, ``variant``
(``"qk-layernorm(divisor=False)"``, see :func:`~attnscale.experiments.lm.study.parse_variant`):
a grid is a Cartesian product, and a mechanism's options belong to that mechanism alone.  The
result is the run record of :func:`~attnscale.experiments.lm.train_lm` without its ``timing``
(the store's ``wall_seconds`` stands in), so it is the same bytes on any executor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnscale.experiments.lm.data import DATA_PARAM
from attnscale.mechanisms import parse_variant
from attnscale.experiments.lm.train import LMRunConfig, train_lm
from attnscale.experiments.registry import Param, experiment, params_from_dataclass
from attnscale.mechanisms import canonical_options

_JOINED = ("mechanism", "options")  # LMRunConfig fields given as one "variant"


def _params() -> dict[str, Param]:
    """LMRunConfig's fields as sweep parameters, with mechanism and options joined as ``variant``."""
    return {"variant": Param(str, LMRunConfig.mechanism, canonical=canonical_variant),
            **{k: p for k, p in params_from_dataclass(LMRunConfig).items() if k not in _JOINED},
            "data": DATA_PARAM}


def format_variant(name: str, options: Mapping[str, Any]) -> str:
    """``name``, or ``name(key=value, ...)`` with the options in sorted order: the one text of a
    variant (the inverse of :func:`~attnscale.experiments.lm.study.parse_variant`)."""
    if not options:
        return name
    return name + "(" + ", ".join(f"{k}={options[k]}" for k in sorted(options)) + ")"


def canonical_variant(text: str, settings: Mapping[str, list] | None = None) -> str:
    """The canonical text of a variant: ``scaled()`` is ``scaled``, and ``softcap(cap=20)``,
    ``softcap(cap=20.0)`` and ``softcap(cap=2e1)`` are ``softcap(cap=20.0)`` (options typed by
    the mechanism, :func:`attnscale.mechanisms.canonical_options`)."""
    name, options = parse_variant(text)
    return format_variant(name, canonical_options(name, options))


def run_config(config: dict) -> LMRunConfig:
    """The LMRunConfig of a trial config (``variant`` split into mechanism and options)."""
    rest = dict(config)
    name, options = parse_variant(rest.pop("variant"))
    return LMRunConfig(mechanism=name, options=options, **rest)


def _check(config: dict) -> None:
    run_config(config).validated()


@experiment("lm", params=_params(), check=_check, threads=1)
def lm_run(**config) -> dict:
    """Train one small LM and return its run record (without ``timing``)."""
    record = train_lm(run_config(config))
    record.pop("timing")
    return record
