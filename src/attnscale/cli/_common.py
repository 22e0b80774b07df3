"""Helpers shared by the subcommands: argparse formatting, JSON output and plain-text tables."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence


def add_command(sub, name: str, *, help: str, examples: str) -> argparse.ArgumentParser:
    """Add a subcommand whose ``--help`` ends with worked ``examples``."""
    return sub.add_parser(
        name, help=help, description=help,
        epilog="examples:\n" + examples.strip("\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_force(p: argparse.ArgumentParser) -> None:
    """``--force``: overwrite output files attnscale did not write (see :mod:`attnscale.io`)."""
    p.add_argument("--force", action="store_true",
                   help="overwrite existing files in the way that attnscale did not write")


def print_json(obj: object) -> None:
    """Print exactly one JSON object on stdout."""
    json.dump(obj, sys.stdout, allow_nan=False)
    sys.stdout.write("\n")


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    return "-" if value is None else str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Render ``rows`` as an aligned plain-text table over ``columns``."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
