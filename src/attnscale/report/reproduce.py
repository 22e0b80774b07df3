"""``attnscale reproduce``: run every essay experiment and write the report.

Each entry of :data:`REPORT_SECTIONS` is ``"module:function"`` where the function has the signature
``fn(fig_dir: Path, *, seed: int) -> attnscale.report.Section``; it saves its PNG figures into
``fig_dir`` and returns its rows, measurements and captions.
"""

from __future__ import annotations

import functools
import importlib
import platform
from pathlib import Path

import torch

from attnscale.errors import check_int
from attnscale.io import check_output_path
from attnscale.report.writer import write_report

REPORT_SECTIONS = (
    "attnscale.report.sections.montecarlo:report_section",
    "attnscale.report.sections.montecarlo:report_section_mechanisms",
    "attnscale.report.sections.mechanisms:report_section",
    "attnscale.report.sections.recall:report_section",
)

# The files every report has (the sections add their figures).
REPORT_FILES = ("report.md", "results.json")


def _load(spec: str):
    module, fn = spec.split(":")
    return getattr(importlib.import_module(module), fn)


def reproduce(out: str | Path = "attnscale-report", seed: int = 0,
              sections: tuple[str, ...] = REPORT_SECTIONS, *, force: bool = False) -> dict:
    """Run the report sections and write ``report.md``, ``results.json`` and PNGs into ``out``
    (the output-folder policy of :mod:`attnscale.io`; ``force`` overwrites files it did not write)."""
    seed = check_int("seed", seed, minimum=0)
    out_dir = check_output_path("--out", out, kind="dir", files=REPORT_FILES, force=force)
    from attnscale import __version__
    fns = [functools.partial(_load(s), seed=seed) for s in sections]
    meta = {"attnscale": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "seed": seed}
    return write_report(out_dir, fns, meta, force=force)
