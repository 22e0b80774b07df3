"""The sweep engine: every study runs as a resumable grid of trials, locally or on Ray.

* :mod:`attnscale.experiments.registry`: experiments, registered by name with typed parameters
  (a leaf module, so that an experiment anywhere can register without importing the engine);
* :mod:`~attnscale.sweep.grid`: grids and the trials they expand to;
* :mod:`~attnscale.sweep.trial`: trial ids and running one trial in a worker;
* :mod:`~attnscale.sweep.store`: ``sweep.json`` and ``results.jsonl``;
* :mod:`~attnscale.sweep.local`, :mod:`~attnscale.sweep.ray_exec`: the executors;
* :mod:`~attnscale.sweep.engine`: :func:`run`, :func:`resume`;
* :mod:`~attnscale.sweep.results`: :func:`load`.

Example::

    from attnscale import sweep
    sweep.run("recall", {"mechanism": ["scaled", "unscaled"], "seed": [0, 1, 2]}, "out/",
              fixed={"steps": 600}, workers=2)
    frame = sweep.load("out/").to_frame()
"""

from __future__ import annotations

from attnscale.experiments.registry import EXPERIMENTS, Experiment, Param, experiment, \
    params_from_dataclass
from attnscale.sweep.results import SweepResults, load
from attnscale.sweep.engine import resume, run
from attnscale.sweep import builtin  # noqa: F401,E402  (registers the built-in experiments)

__all__ = ["EXPERIMENTS", "Experiment", "Param", "SweepResults", "experiment", "load",
           "params_from_dataclass", "resume", "run"]
