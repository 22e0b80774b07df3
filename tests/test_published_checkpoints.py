"""docs/results/checkpoints: every inspection published there (a folder with inspect.json: models
side by side, a model at several lengths, a training run) redraws its pages byte for byte from
its report stores, and the results page states what each shows with the numbers of inspect's own
analyses.  The figures are stubbed: their drawing is tested with the analyses; here the pages'
text is what must be current."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from attnscale.formatting import number
from attnscale.inspect import compare, lengths, trajectory
from attnscale.inspect.multi import INDEX, draw_pages, load_index
from attnscale.inspect.report import load

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
TOP = RESULTS / "checkpoints"
FOLDERS = sorted(p for p in TOP.iterdir() if (p / INDEX).is_file())
PAGES = (compare.PAGE, lengths.PAGE, trajectory.PAGE)
# What docs/results/checkpoints/make.py publishes: the comparison, three models against length,
# and a fine-tuning run.
PUBLISHED = {"compare", "all-MiniLM-L6-v2", "SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m",
             "run"}


def test_every_published_inspection_is_there():
    assert PUBLISHED <= {p.name for p in FOLDERS}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_published_pages_redraw_byte_for_byte(tmp_path, monkeypatch, folder):
    def stub(*args, **kwargs):
        Path(args[1]).write_bytes(b"\x89PNG\r\n\x1a\n")
        return Path(args[1])

    for module, name in ((compare, "draw_compare"), (lengths, "draw_lengths"),
                         (trajectory, "draw_trajectory")):
        monkeypatch.setattr(module, name, stub)
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    pages = [p.relative_to(folder) for p in folder.rglob("*.md") if p.name in PAGES]
    assert pages, folder
    for page in pages:
        (copy / page).unlink()
    draw_pages(copy)
    for page in pages:
        assert (copy / page).read_bytes() == (folder / page).read_bytes(), \
            f"run 'python docs/results/checkpoints/make.py --redraw' ({page})"


def _payloads(folder: Path) -> dict:
    return {e: load(folder / e.folder) for e in load_index(folder)["entries"]}


def test_the_results_page_states_each_inspection():
    # the shipped page: tests/test_results.py keeps it equal to what attnscale results draws
    text = (RESULTS / "README.md").read_text(encoding="utf-8")

    def g(x) -> str:
        return number(x, "{:.3g}")

    for folder in FOLDERS:
        got = _payloads(folder)
        sources = list(dict.fromkeys(e.source for e in got))
        first_n = min(e.seq_len for e in got)
        if len(sources) > 1:
            rows = compare.compare_rows([[p for e, p in got.items() if e.source == s
                                          and e.seq_len == first_n][-1] for s in sources])
            for r in rows:
                assert (f"median coherence {g(r['median_coherence'])}, logit std "
                        f"{g(r['median_logit_std'])}, ×{g(r['median_drift_logit_std'])} its "
                        "initialisation's") in text, r["name"]
            assert " ".join(compare.findings(rows)) in text
        for s in sources:
            mine = {e: p for e, p in got.items() if e.source == s}
            run = [(e.step, p) for e, p in mine.items()
                   if e.step is not None and e.seq_len == first_n]
            if run:
                assert trajectory.verdict(trajectory.trajectory_rows(run)) in text
            last = max(e.checkpoint for e in mine) if not run else \
                next(e.checkpoint for e in mine if e.step == run[-1][0])
            by_length = {e.seq_len: p for e, p in sorted(mine.items(), key=lambda x: x[0].seq_len)
                         if e.checkpoint == last}
            if len(by_length) > 1:
                fitted = [r for r in lengths.length_rows(by_length) if r["fitted"]]
                dispersing = sum(bool(r["dispersing"]) for r in fitted)
                assert f"{dispersing} of {len(fitted)} fitted heads disperse" in text, s
