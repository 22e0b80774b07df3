"""The study folder's report: ``fragment.md``, ``fragment.json`` (title and claims), the study's
JSON of every table and claim, and its figures, written all or nothing.

The two fragment files are the contract ``attnscale reproduce --include DIR`` reads (see
:mod:`attnscale.report.include`), so every registered study is a folder the report takes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from attnscale.io import json_safe, staged_dir
from attnscale.plotting import save
from attnscale.study.spec import Analysis, Study

FRAGMENT_MD = "fragment.md"
FRAGMENT_JSON = "fragment.json"


def fragment_files(study: Study) -> tuple[str, ...]:
    """Every file :func:`write_fragment` may write for ``study``."""
    return (FRAGMENT_MD, FRAGMENT_JSON, study.summary, *study.figures)


def write_fragment(out: str | os.PathLike, study: Study, analysis: Analysis, *,
                   force: bool = False) -> dict[str, str]:
    """Write ``analysis`` into the study folder ``out`` (staged: all or nothing; only over files
    attnscale wrote unless ``force``); return ``{file name: path}`` of what was written."""
    unknown = sorted(set(analysis.figures) - set(study.figures))
    if unknown:
        raise ValueError(f"study {study.name!r} draws {unknown[0]!r}, which its spec does not "
                         "list in figures")
    out = Path(out)
    fragment = json_safe({"title": study.title, "claims": list(analysis.claims)})
    texts = {FRAGMENT_JSON: json.dumps(fragment, indent=1, allow_nan=False),
             study.summary: json.dumps(json_safe(dict(analysis.tables)), indent=1,
                                       allow_nan=False),
             FRAGMENT_MD: analysis.markdown}
    with staged_dir(out, param="--out", force=force) as staging:
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        for name, draw in analysis.figures.items():
            save(draw(), staging / name)
    return {name: str(out / name) for name in [*texts, *analysis.figures]}
