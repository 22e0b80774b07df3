"""The reproduction report: the essay's claims, our measurements and their verdicts.

One package, one home per part:

- :mod:`~attnscale.report.claims`: every number the essay prints, once (``CLAIMS``, ``QUOTES``);
- :mod:`~attnscale.report.model`: :class:`Measurement`, :class:`Section` and the verdict rule
  :func:`judge`;
- :mod:`~attnscale.report.sections`: one module per experiment, each a section function;
- :mod:`~attnscale.report.figures`: plotting helpers (styles from :mod:`attnscale.styles`);
- :mod:`~attnscale.report.include`: finished study folders added as "Beyond the essay";
- :mod:`~attnscale.report.writer`: assembles ``report.md`` and ``results.json``;
- :mod:`~attnscale.report.reproduce`: :func:`attnscale.reproduce`, the sections in order.

A section returns its raw rows (for ``results.json``), a :class:`Measurement` for each claim it
covers (keyed by ``Claim.id``; an id the table does not know is an error) and the figures it drew.
"""

from __future__ import annotations

from attnscale.report.model import Measurement, Section, Verdict, judge

__all__ = ["Measurement", "Section", "Verdict", "judge"]
