"""The ``lm`` experiment: one small-LM training run as a sweep trial.

Its parameters are the fields of :class:`~attnscale.experiments.lm.train.LMRunConfig`, with the
same defaults, except that ``mechanism`` and ``options`` are one parameter, ``variant``
(``"qk-layernorm(divisor=False)"``, see :func:`~attnscale.experiments.lm.study.parse_variant`):
a grid is a Cartesian product, and a mechanism's options belong to that mechanism alone.  The
result is the run record of :func:`~attnscale.experiments.lm.train_lm` without its ``timing``
(the store's ``wall_seconds`` stands in), so it is the same bytes on any executor.
"""

from __future__ import annotations

from attnscale.experiments.lm.study import parse_variant
from attnscale.experiments.lm.train import LMRunConfig, train_lm
from attnscale.experiments.registry import Param, experiment, params_from_dataclass

_JOINED = ("mechanism", "options")  # LMRunConfig fields given as one "variant"


def _params() -> dict[str, Param]:
    """LMRunConfig's fields as sweep parameters, with mechanism and options joined as ``variant``."""
    return {"variant": Param(str, LMRunConfig.mechanism),
            **{k: p for k, p in params_from_dataclass(LMRunConfig).items() if k not in _JOINED}}


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
