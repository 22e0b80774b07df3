"""The reproduction report: the essay's claims, our measurements and their verdicts.

An experiment contributes a :class:`Section`: its raw rows (for ``results.json``), a
:class:`Measurement` for each claim it covers (keyed by ``Claim.id`` from
:mod:`attnscale.report.claims`), and the figures it drew.  :func:`attnscale.report.writer.write_report`
assembles ``report.md``.
"""

from __future__ import annotations

from attnscale.report.model import Measurement, Section, Verdict, judge

__all__ = ["Measurement", "Section", "Verdict", "judge"]
