"""Measurements, sections and the verdict rule that compares a measurement with a claim."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attnscale.constants import Z95
from attnscale.report.claims import AtMost, Claim, Estimate, Exact, Within, check_claim_ids


@dataclass(frozen=True)
class Measurement:
    """Our value for one claim.

    ``se`` is the standard error of a Monte Carlo estimate (None when deterministic); ``ci95`` is
    the 95% interval shown in the report (derived from ``se`` when not given).
    """
    value: float
    se: float | None = None
    ci95: tuple[float, float] | None = None
    note: str = ""

    def interval(self) -> tuple[float, float] | None:
        if self.ci95 is not None:
            return self.ci95
        if self.se is not None:
            return (self.value - Z95 * self.se, self.value + Z95 * self.se)
        return None


@dataclass
class Section:
    """What one experiment adds to the report."""
    name: str                                  # heading in report.md and key in results.json
    rows: list[dict]                           # tidy records, written to results.json
    measurements: dict[str, Measurement]       # claim id -> our value
    figures: list[tuple[str, str]] = field(default_factory=list)  # (png file name, caption)
    markdown: str = ""                         # extra prose/tables shown under the heading

    def __post_init__(self) -> None:
        # Fail where the section is built, not after every other section has run.
        check_claim_ids(self.measurements, f"section {self.name!r}")


@dataclass(frozen=True)
class Verdict:
    agrees: bool
    text: str   # "agrees" or "differs by ..." with the size of the gap


def _printed_half_unit(text: str) -> float:
    """Half a unit in the last printed digit of ``text`` ("7.9774" -> 5e-5, "11" -> 0.5)."""
    digits = text.strip().rstrip("%")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    scale = 0.01 if text.strip().endswith("%") else 1.0
    return 0.5 * 10.0 ** (-decimals) * scale


def essay_value(claim: Claim) -> float:
    """The claim's printed value as a float ("0.5%" -> 0.005)."""
    text = claim.essay.strip()
    if text.endswith("%"):
        return float(text[:-1]) / 100.0
    return float(text)


def judge(claim: Claim, m: Measurement) -> Verdict:
    """Compare measurement ``m`` with ``claim`` according to the claim's check."""
    check = claim.check
    if isinstance(check, (Within, AtMost)):
        lo, hi = (check.lo, check.hi) if isinstance(check, Within) else (-math.inf, check.bound)
        region = f"[{lo:g}, {hi:g}]" if isinstance(check, Within) else f"<= {hi:g}"
        if lo <= m.value <= hi:
            return Verdict(True, "agrees")
        # The point estimate is outside; a CI that still overlaps the claimed region means the
        # claim cannot be rejected at this sample size.
        ci = m.interval()
        if ci is not None and ci[0] <= hi and ci[1] >= lo:
            return Verdict(True, f"agrees within noise: {m.value:.4g} is outside {region} but "
                                 f"its 95% CI overlaps it")
        gap = lo - m.value if m.value < lo else m.value - hi
        return Verdict(False, f"differs: {m.value:.4g} is {gap:.3g} outside {region}")
    target = essay_value(claim)
    half_unit = _printed_half_unit(claim.essay)
    diff = m.value - target
    rel = diff / target if target else math.inf
    if isinstance(check, Estimate):
        if m.se is None:
            raise ValueError(f"claim {claim.id} is an Estimate but its measurement has no se")
        # Two independent estimates at the same sample size: the gap has sd sqrt(2) * se.
        sd_gap = math.sqrt(2.0) * m.se
        ok = abs(diff) <= Z95 * sd_gap + half_unit
        z = diff / sd_gap if sd_gap > 0 else math.inf
        detail = f"{diff:+.3g} ({rel:+.1%}, {z:+.1f} sd)"
        return Verdict(ok, f"agrees ({z:+.1f} sd)" if ok else f"differs by {detail}")
    if isinstance(check, Exact):
        ok = abs(diff) <= check.rel * abs(target) + half_unit
        return Verdict(ok, "agrees" if ok else f"differs by {diff:+.3g} ({rel:+.1%})")
    raise TypeError(f"unknown check {check!r}")  # pragma: no cover
