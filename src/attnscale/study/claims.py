"""Claims over seeds: one wording and one set of verdict rules for every study.

A study's number is measured once per seed and summarised by :func:`attnscale.study.seeds.spread`
(mean and the seed-to-seed range [min, max]).  Two such ranges compare as ``lower``, ``higher``
or ``overlap`` (:func:`compare`): a claim that one is lower agrees only when every range says
so, is inconclusive when the ranges overlap, and differs when the order is the opposite.  With
one seed there is no range, so any gap counts (the claim's note says so).

A best value found by a search over a grid (YaRN's multiplier) is a verdict only when it lies
inside the grid: at an edge the true optimum may lie beyond it, and a seed range that spans the
whole grid says nothing (:func:`search_inconclusive`).

Numbers read as everywhere else (:mod:`attnscale.formatting`), at the precision a study states.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnscale.formatting import number, with_interval

# Seed ranges, and every number in a study's claims, to 3 decimals.
FMT = "{:.3f}"
SIDES = ("lower", "higher")
AGREES = "agrees"
OVERLAP = "inconclusive: the seed ranges overlap"
OPPOSITE = "differs: the opposite order"
SEPARATE = "differs: the seed ranges separate"
NOT_RUN = "not run"


def range_text(s: dict, fmt: str = FMT) -> str:
    """A seed spread as ``mean [min, max]``, the mean alone for one seed, ``n/a`` for none."""
    if s["mean"] is None:
        return "n/a"
    return number(s["mean"], fmt) if s["n"] == 1 else with_interval(s["mean"],
                                                                    [s["min"], s["max"]], fmt)


def interval(s: dict) -> list | None:
    """The seed-to-seed range [min, max] of a spread; None when nothing was measured."""
    return None if s["mean"] is None else [s["min"], s["max"]]


def compare(a: dict, b: dict) -> str:
    """``lower``, ``higher`` or ``overlap``: the seed range of spread ``a`` against ``b``'s."""
    if a["max"] < b["min"]:
        return "lower"
    if a["min"] > b["max"]:
        return "higher"
    return "overlap"


def verdict(outcomes: Sequence[str], expect: str) -> tuple[str, bool]:
    """The verdict on the claim that every comparison in ``outcomes`` is ``expect`` (``lower``,
    ``higher`` or ``overlap``), and whether it agrees."""
    if expect == "overlap":
        agrees = all(o == "overlap" for o in outcomes)
        return (AGREES if agrees else SEPARATE), agrees
    if expect not in SIDES:
        raise ValueError(f"expect must be 'lower', 'higher' or 'overlap', got {expect!r}")
    if all(o == expect for o in outcomes):
        return AGREES, True
    return (OPPOSITE if any(o not in (expect, "overlap") for o in outcomes) else OVERLAP), False


def side(value: float, reference: float) -> str:
    """``lower`` or ``higher``: where ``value`` lies against ``reference`` (a number)."""
    return "lower" if value < reference else "higher"


def search_inconclusive(best: Sequence[float], at_edge: Sequence[bool],
                        grid: Sequence[float]) -> str | None:
    """Why best values found by a search over ``grid`` (one per seed) give no verdict: one sits
    at an edge of the grid, or their seed range spans it; None when they are a verdict."""
    if any(at_edge):
        return "inconclusive: a best value sits at the search grid's edge"
    if best and min(best) <= min(grid) and max(best) >= max(grid):
        return "inconclusive: the seed range spans the search grid"
    return None


def claim(quantity: str, expected: str, ours: float | None, ci: list | None, verdict_text: str,
          agrees: bool, note: str = "") -> dict:
    """One claim row of ``fragment.json`` (the contract of :mod:`attnscale.report.include`)."""
    return {"quantity": quantity, "expected": expected, "ours": ours, "ci": ci,
            "verdict": verdict_text, "agrees": agrees, "note": note}
