"""Write ``report.md``, ``results.json`` and the figures, all or nothing.

Everything is first written into a hidden staging folder inside the output directory and moved into
place only when every section has finished, so an error or Ctrl-C leaves no half-written report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

from attnscale.constants import Z95
from attnscale.formatting import cell, number, with_interval  # noqa: F401  (the report's)
from attnscale.io import staged_dir
from attnscale.report.claims import CLAIMS, check_claim_ids
from attnscale.report.model import Measurement, Section, judge
from attnscale.report.parallel import run_sections

SectionFn = Callable[[Path], Section]  # receives the staging folder for its figures


def _ours(m: Measurement) -> str:
    return with_interval(m.value, m.interval())


def claims_table(measurements: dict[str, Measurement]) -> tuple[str, list[dict]]:
    """Markdown table with one row per measured claim, and the same rows as records.

    A measurement whose id is not in :data:`~attnscale.report.claims.CLAIMS` raises ``ValueError``.
    """
    check_claim_ids(measurements, "claims_table")
    lines = ["| section | quantity | essay | ours [95% CI] | verdict |",
             "|---|---|---|---|---|"]
    records = []
    for claim in CLAIMS:
        m = measurements.get(claim.id)
        if m is None:
            continue
        verdict = judge(claim, m)
        ours = _ours(m) + (f" ({m.note})" if m.note else "")
        cells = [claim.section, claim.quantity, claim.essay, ours,
                 f"{'✅' if verdict.agrees else '❌'} {verdict.text}"]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
        lo_hi = m.interval()
        records.append({"claim": claim.id, "section": claim.section, "quantity": claim.quantity,
                        "essay": claim.essay, "ours": m.value, "se": m.se,
                        "ci95": [v if math.isfinite(v) else None for v in lo_hi] if lo_hi else None, "agrees": verdict.agrees,
                        "verdict": verdict.text})
    return "\n".join(lines), records


def write_report(out_dir: Path, section_fns: Iterable[SectionFn], meta: dict, *,
                 force: bool = False, workers: int = 1) -> dict:
    """Run every section and write the report into ``out_dir`` (staged, see
    :func:`attnscale.io.staged_dir`); return the results object.  ``workers`` > 1 runs the
    sections side by side (:func:`attnscale.report.parallel.run_sections`); the bytes written
    are the same."""
    with staged_dir(out_dir, force=force) as staging:
        sections = run_sections(list(section_fns), staging, workers=workers)
        measurements: dict[str, Measurement] = {}
        for i, s in enumerate(sections):
            twice = sorted(s.measurements.keys() & measurements.keys())
            if twice or s.name in (t.name for t in sections[:i]):
                raise ValueError(f"section {s.name!r} repeats another section's "
                                 f"{'claim ' + repr(twice[0]) if twice else 'name'}")
            measurements.update(s.measurements)
        table, verdicts = claims_table(measurements)
        n_ok = sum(v["agrees"] for v in verdicts)
        results = {"meta": meta, "claims": verdicts,
                   "sections": {s.name: s.rows for s in sections}}
        md = ["# attnscale reproduction report", "",
              "Every number the essay quotes, our measurement with its 95% confidence interval, "
              "and a verdict. Monte Carlo claims agree when the gap between the essay's estimate "
              f"and ours is within {Z95:.2f} standard deviations of the difference of two independent "
              "estimates at the essay's sample size.", "",
              " · ".join(f"{k}: {v}" for k, v in meta.items()), "",
              f"**{n_ok} of {len(verdicts)} claims agree.**", "", table, ""]
        for s in sections:
            md += [f"## {s.name}", ""]
            if s.markdown:
                md += [s.markdown.rstrip(), ""]
            for png, caption in s.figures:
                md += [f"![{caption}]({png})", "", f"*{caption}*", ""]
        (staging / "report.md").write_text("\n".join(md), encoding="utf-8")
        (staging / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False),
                                              encoding="utf-8")
    return results
