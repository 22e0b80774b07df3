"""The small LM: a causal byte-level LM on attnscale's attention,
Wortsman et al.'s training recipe, and the learning-rate sensitivity analysis.

* :mod:`~attnscale.experiments.lm.model`: :class:`LM`, :class:`LMConfig`, :func:`build_lm`;
* :mod:`~attnscale.experiments.lm.data`: the byte-level corpus (the stdlib's ``.py`` files);
* :mod:`~attnscale.experiments.lm.train`: :class:`LMRunConfig` and :func:`train_lm`, one run;
* :mod:`~attnscale.experiments.lm.study`: mechanism variants, the study's grid, LR sensitivity.

The stability study (tables, claims, figures) is :mod:`attnscale.study.lm`.
"""

from attnscale.experiments.lm.model import LM, LMConfig, build_lm
from attnscale.experiments.lm.train import LMRunConfig, train_lm

__all__ = ["LM", "LMConfig", "LMRunConfig", "build_lm", "train_lm"]
