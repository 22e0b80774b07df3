"""Constants used across attnscale, each defined once.

Mechanism defaults (the soft-cap of 50, the cosine temperature init ln 10, ...) live in the
mechanism that uses them; this module holds the statistical and task-level constants.
"""

from __future__ import annotations

# Two-sided 95% normal quantile, Phi^{-1}(0.975).
Z95 = 1.959963984540054
