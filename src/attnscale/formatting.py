"""How numbers and table cells read in every markdown table attnscale writes (the report's claims
table, a study's claims and tables): one place, so that the report and the studies agree."""

from __future__ import annotations

# The report's precision: four significant digits.
NUMBER = "{:.4g}"


def cell(text: str) -> str:
    """Escape a markdown table cell (quantities such as ||J||_F contain pipes)."""
    return text.replace("|", "\\|")


def number(x: float | None, fmt: str = NUMBER) -> str:
    """A number as the tables show it (``fmt``, the report's four significant digits unless a
    table states its own precision); None (not measured) is a dash."""
    return "—" if x is None else fmt.format(x)


def with_interval(value: float | None, interval, fmt: str = NUMBER) -> str:
    """``value [lo, hi]``, or ``value`` alone when there is no interval."""
    text = number(value, fmt)
    if interval is not None:
        text += f" [{number(interval[0], fmt)}, {number(interval[1], fmt)}]"
    return text
