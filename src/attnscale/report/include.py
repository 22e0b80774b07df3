"""Studies that run apart from ``reproduce``, added to its report as "Beyond the essay".

``attnscale reproduce --include DIR`` (API: ``reproduce(include=[DIR])``) takes a finished study
folder.  The contract a study writes into ``DIR``:

``fragment.md`` (required)
    UTF-8 markdown, inserted under a level-3 heading (the study's title) in the report's "Beyond
    the essay" section, so its own headings should be level 4 or deeper.  Every image it shows,
    ``![caption](name.png)`` (a file name without spaces), is a PNG file directly in ``DIR``: it
    is copied into the report folder as ``<study>-name.png`` and the link rewritten; ``<study>``
    is DIR's name.  Other PNGs in ``DIR`` are not copied.
``fragment.json`` (optional)
    ``{"title": str, "claims": [row, ...]}``, both keys optional.  ``title`` defaults to DIR's
    name.  Each claim row is the study's own verdict on one claim, shown as a table above the
    fragment and stored in ``results.json``::

        {"quantity": "LR sensitivity, qk-layernorm < scaled",  # what is claimed and measured
         "expected": "lower than scaled",                       # the source's value or statement
         "ours": 0.031,                                         # our number (null: not measured)
         "ci": [0.02, 0.04],                                    # optional 95% interval
         "verdict": "agrees",                                   # the study's verdict, in words
         "agrees": true,                                        # ... and as a bool
         "note": "3 seeds"}                                     # optional

The runs behind the fragment are the sweep stores in ``DIR`` (``DIR/sweep.json``, or one per
subfolder, as :mod:`attnscale.study` writes them): the report says how many of their runs
finished ("k of n runs") and which attnscale version ran them, and says so plainly when the
folder holds no store, some runs are missing, or another version ran them.

Everything is validated before any experiment runs (:func:`load_studies`); a folder that breaks
the contract is a :class:`~attnscale.errors.ConfigError` naming ``--include`` and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnscale.errors import ConfigError, check_unique
from attnscale.formatting import cell, with_interval
from attnscale.report.model import Section
from attnscale.study.fragment import FRAGMENT_JSON, FRAGMENT_MD
SECTION_NAME = "Beyond the essay"   # the report heading and the key in results.json "sections"
PARAM = "--include"

ROW_REQUIRED = ("quantity", "expected", "ours", "verdict", "agrees")
ROW_OPTIONAL = ("ci", "note")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A markdown image: ![caption](target) or ![caption](target "title").
_IMAGE = re.compile(r'!\[(?P<caption>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+"[^"]*")?\)')


@dataclass(frozen=True)
class Study:
    """One validated study folder."""
    path: Path                  # the folder, resolved
    name: str                   # its folder name: the prefix of its figures in the report
    title: str                  # the heading in "Beyond the essay"
    markdown: str               # fragment.md with its image links pointing at the copied PNGs
    figures: tuple[str, ...]    # PNG file names in ``path`` that fragment.md shows
    claims: tuple[dict, ...]    # fragment.json's claim rows, validated
    runs: dict | None = None    # {"ok", "total", "stores"} of its sweep stores; None: no store
    version: str | None = None  # the attnscale version that ran them (None: not recorded)


def _fail(path: str, what: str) -> ConfigError:
    return ConfigError(f"{PARAM} {path!r} {what}")


def _check_row(path: str, i: int, row: object) -> dict:
    """One claim row of fragment.json: required keys, known keys, right types."""
    where = f"{FRAGMENT_JSON} claim {i}"
    if not isinstance(row, dict):
        raise _fail(path, f"is not a valid study folder: {where} is not an object.")
    unknown = sorted(set(row) - set(ROW_REQUIRED) - set(ROW_OPTIONAL))
    missing = [k for k in ROW_REQUIRED if k not in row]
    if unknown or missing:
        raise _fail(path, f"is not a valid study folder: {where} "
                          + (f"has unknown key {unknown[0]!r}" if unknown else
                             f"lacks {missing[0]!r}")
                          + f" (keys: {', '.join(ROW_REQUIRED + ROW_OPTIONAL)}).")
    ours, ci = row["ours"], row.get("ci")

    def number(x: object) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    checks = {"quantity": isinstance(row["quantity"], str) and row["quantity"].strip(),
              "expected": isinstance(row["expected"], str),
              "verdict": isinstance(row["verdict"], str) and row["verdict"].strip(),
              "agrees": isinstance(row["agrees"], bool),
              "ours": ours is None or number(ours),
              "ci": ci is None or (isinstance(ci, list) and len(ci) == 2
                                   and all(v is None or number(v) for v in ci)),
              "note": isinstance(row.get("note", ""), str)}
    for key, ok in checks.items():
        if not ok:
            raise _fail(path, f"is not a valid study folder: {where} has a bad {key!r} "
                              f"({row.get(key)!r}).")
    return dict(row)


def _images(path: str, folder: Path, text: str) -> list[str]:
    """The PNG files fragment.md shows, each checked to be a PNG directly in ``folder``."""
    names = []
    for m in _IMAGE.finditer(text):
        target = m["target"]
        if "/" in target or "\\" in target or target in (".", ".."):
            raise _fail(path, f"is not a valid study folder: {FRAGMENT_MD} shows {target!r}; "
                              "figures must be PNG files directly in the study folder.")
        file = folder / target
        if not target.lower().endswith(".png") or not file.is_file():
            raise _fail(path, f"is not a valid study folder: {FRAGMENT_MD} shows {target!r}, "
                              "which is not a PNG file in the folder.")
        with open(file, "rb") as f:
            if f.read(len(PNG_MAGIC)) != PNG_MAGIC:
                raise _fail(path, f"is not a valid study folder: {target!r} is not a PNG image.")
        names.append(target)
    return list(dict.fromkeys(names))


def _read_json(path: str, file: Path) -> dict:
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(path, f"is not a valid study folder: {FRAGMENT_JSON} is not JSON ({err}).") \
            from None
    if not isinstance(meta, dict) or set(meta) - {"title", "claims"}:
        raise _fail(path, f"is not a valid study folder: {FRAGMENT_JSON} must be an object with "
                          "keys 'title' and 'claims' only.")
    if not isinstance(meta.get("title", ""), str) or not isinstance(meta.get("claims", []), list):
        raise _fail(path, f"is not a valid study folder: {FRAGMENT_JSON} needs a string 'title' "
                          "and a list 'claims'.")
    return meta


def load_study(path: str | os.PathLike) -> Study:
    """Validate one study folder against the contract above and read it."""
    shown = os.fspath(path)
    if not shown:
        raise ConfigError(f"{PARAM} must name a study folder, got ''.")
    folder = Path(shown)
    if not folder.exists():
        raise _fail(shown, "does not exist.")
    if not folder.is_dir():
        raise _fail(shown, "is not a folder.")
    md_file, json_file = folder / FRAGMENT_MD, folder / FRAGMENT_JSON
    if not md_file.is_file():
        raise _fail(shown, f"is not a study folder: it has no {FRAGMENT_MD}.")
    try:
        text = md_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _fail(shown, f"is not a valid study folder: {FRAGMENT_MD} cannot be read as "
                           f"UTF-8 ({err}).") from None
    if not text.strip():
        raise _fail(shown, f"is not a valid study folder: {FRAGMENT_MD} is empty.")
    meta = _read_json(shown, json_file) if json_file.exists() else {}
    folder = folder.resolve()
    name = folder.name
    claims = tuple(_check_row(shown, i, row) for i, row in enumerate(meta.get("claims", [])))
    figures = _images(shown, folder, text)
    markdown = _IMAGE.sub(lambda m: f"![{m['caption']}]({name}-{m['target']}{m['title'] or ''})",
                          text)
    runs, version = _runs(shown, folder)
    return Study(folder, name, meta.get("title") or name, markdown, tuple(figures), claims,
                 runs, version)


def _runs(shown: str, folder: Path) -> tuple[dict | None, str | None]:
    """The runs of the sweep stores in ``folder`` (itself, or its subfolders) and the attnscale
    version that ran them (several versions are listed together)."""
    from attnscale import sweep
    from attnscale.sweep.store import SPEC_FILE
    # The folder itself and its subfolders: a study keeps its stores in either or both (the LM
    # study's grid in the folder, its width-256 runs in wide/).
    stores = [folder] if (folder / SPEC_FILE).is_file() else []
    stores += sorted(p for p in folder.iterdir() if p.is_dir() and (p / SPEC_FILE).is_file())
    if not stores:
        return None, None
    ok = total = 0
    versions = []
    for store in stores:
        try:
            res = sweep.load(store)
            ran = json.loads((store / SPEC_FILE).read_text(encoding="utf-8")).get("attnscale")
        except (ConfigError, ValueError, OSError) as err:
            raise _fail(shown, f"holds a sweep store that cannot be read ({err}).") from None
        ok += len(res.ok)
        total += len(res) + len(res.pending)
        versions.append(str(ran) if ran is not None else None)
    known = sorted(set(v for v in versions if v is not None))
    return ({"ok": ok, "total": total, "stores": len(stores)},
            ", ".join(known) if known and None not in versions else None)


def provenance(s: Study) -> str:
    """One line on the runs behind a study's verdicts: "k of n runs; attnscale X", with what is
    missing or other said plainly."""
    from attnscale import __version__
    if s.runs is None:
        return (f"⚠️ No runs: the folder holds no sweep store (no results.jsonl), so these "
                f"verdicts cannot be traced to runs; this report is attnscale {__version__}.")
    k, n = s.runs["ok"], s.runs["total"]
    text = f"{k} of {n} runs"
    if k < n:
        text = f"⚠️ {text}: {n - k} failed or never ran, and the verdicts leave them out"
    if s.version is None:
        text += f"; the attnscale version that ran them is not recorded (this report is " \
                f"{__version__})"
    elif s.version != __version__:
        text += f"; ⚠️ run by attnscale {s.version}, not this report's {__version__}"
    else:
        text += f"; attnscale {s.version}"
    return text + "."


def load_studies(paths) -> list[Study]:
    """Validate every ``--include`` folder; a folder given twice, or two folders with the same
    name (their figures would collide in the report), is an error."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    studies = [load_study(p) for p in paths]
    check_unique(PARAM, [str(s.path) for s in studies])
    check_unique(f"{PARAM} (folder names)", [s.name for s in studies])
    return studies


def _claims_markdown(claims: tuple[dict, ...]) -> list[str]:
    """The study's claim rows as a table in the layout of the report's own claims table."""
    lines = ["| quantity | expected | ours [95% CI] | verdict |", "|---|---|---|---|"]
    for c in claims:
        ours = with_interval(c["ours"], c.get("ci"))
        if c.get("note"):
            ours += f" ({c['note']})"
        cells = [c["quantity"], c["expected"], ours,
                 f"{'✅' if c['agrees'] else '❌'} {c['verdict']}"]
        lines.append("| " + " | ".join(cell(x) for x in cells) + " |")
    return lines


def beyond_the_essay(studies: list[Study], fig_dir: Path) -> Section:
    """The report section of the included studies: copies their figures into ``fig_dir``."""
    md = ["Studies run apart from `reproduce` and included with `--include`; each states its "
          "own verdicts, which are not counted in the essay's claims above.", ""]
    rows = []
    for s in studies:
        for png in s.figures:
            dest = fig_dir / f"{s.name}-{png}"
            if dest.exists():
                raise ConfigError(f"{PARAM} {str(s.path)!r}: figure {dest.name!r} would replace "
                                  "a figure of the report; rename the study folder.")
            shutil.copyfile(s.path / png, dest)
        md += [f"### {s.title}", "", f"*{provenance(s)}*", ""]
        if s.claims:
            md += [*_claims_markdown(s.claims), ""]
        md += [s.markdown.strip(), ""]
        rows.append({"kind": "study", "study": s.name, "title": s.title, "source": str(s.path),
                     "figures": [f"{s.name}-{png}" for png in s.figures], "runs": s.runs,
                     "attnscale": s.version})
        rows += [{"kind": "claim", "study": s.name, **c} for c in s.claims]
    return Section(SECTION_NAME, rows, {}, [], "\n".join(md))
