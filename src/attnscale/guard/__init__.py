"""Watch and hold the attention temperature inside a training run: :func:`guard`.

:mod:`~attnscale.guard.core` has the guard (records, alarms, the two clip modes);
:mod:`~attnscale.guard.clip` where QK-Clip acts in each model family, and its grouped-query rule;
:mod:`~attnscale.guard.log` the JSONL log (reading it, resuming it);
:mod:`~attnscale.guard.plot` the figure of a guard log.  The Hugging Face Trainer and Lightning
callbacks (:class:`attnscale.hf.TemperatureCallback`, :class:`attnscale.lightning.
TemperatureCallback`) are thin layers over :func:`guard`.
"""

from __future__ import annotations

from attnscale.guard.clip import ClipSite, clip_sites
from attnscale.guard.core import (
    Guard, GuardAlarm, guard, layer_rows, strict_rtol, to_frame, worst,
)
from attnscale.guard.log import ALARMS, GUARD_KEYS, read_log

__all__ = ["ALARMS", "GUARD_KEYS", "ClipSite", "Guard", "GuardAlarm", "clip_sites", "guard",
           "layer_rows", "read_log", "strict_rtol", "to_frame", "worst"]
