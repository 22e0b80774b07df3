"""The experiments attnscale ships, one import each (importing a module registers it).

A new experiment is a module that decorates its trial function with
:func:`attnscale.experiments.registry.experiment` (import it from there, not from
:mod:`attnscale.sweep`, which imports this list), and one line here.
"""

from attnscale.experiments.recall import trial as recall_trial  # noqa: F401  "recall"
from attnscale.experiments import saturation  # noqa: F401                      "saturation"
from attnscale.experiments.lm import trial as lm_trial  # noqa: F401            "lm"
from attnscale.experiments.length import lm as lm_length  # noqa: F401,E402         "lm-length"
from attnscale.experiments.length import recall as recall_length  # noqa: F401,E402 "recall-length"
from attnscale.experiments import extend  # noqa: F401,E402                     "extend"
