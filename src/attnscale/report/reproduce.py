"""``attnscale.reproduce()``: run every essay experiment and write the report.

:data:`SECTIONS` lists the report's sections, in order, as the functions themselves: each has the
signature ``fn(fig_dir: Path, *, seed: int, full: bool) -> attnscale.report.Section``, saves its
PNG figures into ``fig_dir`` and returns its rows, measurements and captions (see
:mod:`attnscale.report.sections`).  Included study folders (:mod:`attnscale.report.include`) add
a last section, "Beyond the essay".
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Callable, Sequence

import torch

from attnscale.errors import ConfigError, check_int, check_unique
from attnscale.io import check_output_path
from attnscale.report.include import beyond_the_essay, load_studies
from attnscale.report.model import Section
from attnscale.report.sections import gradient, keys, montecarlo, recall
from attnscale.report.writer import write_report

SECTIONS: tuple[Callable[..., Section], ...] = (
    montecarlo.report_section,
    montecarlo.report_section_mechanisms,
    keys.report_section,
    gradient.report_section,
    recall.report_section,   # last: with workers > 1 the calling process runs it (the longest)
)
# Processes ``attnscale reproduce`` runs the sections on: the calling process runs the recall
# section (its training on sweep workers of its own) and, while the worker starts, Monte Carlo
# sections; one worker runs the other Monte Carlo sections (:mod:`.parallel`).
REPRODUCE_WORKERS = 2

# The files every report has (the sections add their figures).
REPORT_FILES = ("report.md", "results.json")


def _check_sections(sections: Sequence[Callable[..., Section]]) -> list[Callable[..., Section]]:
    """Section functions, each once (names as strings are not accepted: wire them by import)."""
    if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence) or not sections:
        raise ConfigError(f"sections must be a non-empty sequence of section functions, "
                          f"got {sections!r}.")
    for fn in sections:
        if not callable(fn):
            raise ConfigError(f"sections must hold section functions (such as "
                              f"attnscale.report.sections.montecarlo.report_section), got {fn!r}.")
    return check_unique("sections", list(sections))


def reproduce(out: str | os.PathLike = "attnscale-report", seed: int = 0,
              sections: Sequence[Callable[..., Section]] = SECTIONS,
              include: Sequence[str | os.PathLike] = (), *, force: bool = False,
              workers: int = 1, full: bool = False) -> dict:
    """Run the report ``sections`` and write ``report.md``, ``results.json`` and PNGs into ``out``
    (the output-folder policy of :mod:`attnscale.io`; ``force`` overwrites files it did not write).

    ``include`` lists finished study folders (or is one folder) to add as "Beyond the essay".
    ``workers`` > 1 runs the sections on this process and ``workers - 1`` worker processes
    (:func:`attnscale.report.parallel.run_sections`): the same report, sooner.  ``full`` runs
    the long form: claims measured over training seeds take
    :data:`~attnscale.report.sections.recall.FULL_SEEDS` seeds instead of
    :data:`~attnscale.report.sections.recall.SECTION_SEEDS` (minutes instead of seconds).
    Every argument is checked before any experiment runs.  Returns the ``results.json`` object.
    """
    seed = check_int("seed", seed, minimum=0)
    workers = check_int("workers", workers, minimum=1)
    if not isinstance(full, bool):
        raise ConfigError(f"full must be True or False, got {full!r}.")
    fns = [functools.partial(fn, seed=seed, full=full) for fn in _check_sections(sections)]
    studies = load_studies(include)
    out_dir = check_output_path("--out", out, kind="dir", files=REPORT_FILES, force=force)
    if studies:
        fns.append(functools.partial(beyond_the_essay, studies))
    from attnscale import __version__
    meta = {"attnscale": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "seed": seed, "full": full}
    return write_report(out_dir, fns, meta, force=force, workers=workers)
