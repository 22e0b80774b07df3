"""The sweep store: a folder that says what a sweep runs and holds every finished trial.

Layout of ``DIR``::

    sweep.json       what the sweep runs: experiment, module, grid, fixed settings, the full base
                     config, the attnscale version; written atomically and listed in the folder's
                     manifest (the output-folder policy of :mod:`attnscale.io`)
    results.jsonl    one JSON line per finished trial:
                     {"trial", "config", "status": "ok" | "error", "result", "error",
                      "wall_seconds", "host"}

Only the driver process writes ``results.jsonl``: each line is appended in one write, flushed and
fsync'd before the next trial is counted as finished, so a crash loses at most the trials in
flight, never a finished one.  A crash in the middle of a write leaves a last line without its
newline; :meth:`Store.records` ignores it and :meth:`Store.repair` cuts it off before appending.
When a trial has several lines (an error, then a retry), the last one counts; :meth:`Store.compact`
rewrites the file (atomically) with one line per trial.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable
from pathlib import Path

from attnscale.errors import ConfigError
from attnscale.io import atomic_write, check_output_path, fsync_dir, replace_atomically
from attnscale.sweep.grid import SweepSpec

SPEC_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
FORMAT = "attnscale-sweep"
FORMAT_VERSION = 1
RECORD_KEYS = ("trial", "config", "status", "result", "error", "wall_seconds", "host")


def record_line(record: dict) -> str:
    """One line of ``results.jsonl`` (strict JSON, fixed key order, newline-terminated)."""
    return json.dumps({k: record.get(k) for k in RECORD_KEYS}, allow_nan=False) + "\n"


class Store:
    """``sweep.json`` and ``results.jsonl`` in one folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        if not str(os.fspath(path)).strip():
            raise ConfigError("out must be a path, got an empty string.")
        self.path = Path(path)
        self.spec_path = self.path / SPEC_FILE
        self.results_path = self.path / RESULTS_FILE
        self._fh = None

    # -- the folder ---------------------------------------------------------------------------

    def exists(self) -> bool:
        """True when the folder holds a sweep (a ``sweep.json``)."""
        return self.spec_path.is_file()

    def check(self, *, new: bool, force: bool = False) -> None:
        """Before any trial runs: the folder must be writable and, for a new sweep, new, empty or
        attnscale's (the output-folder policy of :mod:`attnscale.io`; ``force`` overrides it)."""
        check_output_path("out", self.path, kind="dir",
                          files=(SPEC_FILE, RESULTS_FILE) if new else (SPEC_FILE,),
                          force=force)

    # -- sweep.json ---------------------------------------------------------------------------

    def read_spec(self) -> SweepSpec:
        """The spec of the sweep in this folder; a ConfigError when there is none or it is not
        attnscale's."""
        if not self.spec_path.is_file():
            raise ConfigError(f"{str(self.path)!r} holds no sweep (no {SPEC_FILE}).")
        try:
            obj = json.loads(self.spec_path.read_text(encoding="utf-8"))
            if obj.get("format") != FORMAT:
                raise ValueError("not an attnscale sweep")
            if obj.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {obj.get('version')!r}, "
                                 f"this attnscale reads {FORMAT_VERSION}")
            return SweepSpec.from_json(obj)
        except (ValueError, KeyError, AttributeError, TypeError) as err:
            raise ConfigError(f"{str(self.spec_path)!r} is not a sweep attnscale wrote "
                              f"({err}).") from None

    def write_spec(self, spec: SweepSpec) -> None:
        from attnscale import __version__
        obj = {"format": FORMAT, "version": FORMAT_VERSION, "attnscale": __version__,
               "written": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               **spec.to_json()}
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.spec_path, json.dumps(obj, indent=1, allow_nan=False) + "\n",
                     param="out")

    # -- results.jsonl ------------------------------------------------------------------------

    def _lines(self) -> tuple[list[dict], int]:
        """Complete records, and the byte length of the file up to the last complete line."""
        if not self.results_path.exists():
            return [], 0
        data = self.results_path.read_bytes()
        end = data.rfind(b"\n") + 1                      # a torn last line has no newline
        records = []
        for number, line in enumerate(data[:end].splitlines(), start=1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "trial" not in record \
                        or record.get("status") not in ("ok", "error"):
                    raise ValueError("not a trial record")
            except ValueError:
                raise ConfigError(f"{str(self.results_path)!r} line {number} is not a trial "
                                  f"record; the file was changed by something other than "
                                  f"attnscale.") from None
            records.append(record)
        return records, end

    def records(self) -> list[dict]:
        """Every complete record in file order (a torn last line is ignored)."""
        return self._lines()[0]

    def repair(self) -> bool:
        """Cut off a torn last line before appending; True if there was one."""
        records, end = self._lines()
        if self.results_path.exists() and self.results_path.stat().st_size > end:
            with open(self.results_path, "r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())
            return True
        return False

    def latest(self) -> dict[str, dict]:
        """The last record of each trial id."""
        return {r["trial"]: r for r in self.records()}

    def append(self, record: dict) -> None:
        """Append one record and make it durable before returning."""
        if self._fh is None:
            created = not self.results_path.exists()
            self._fh = open(self.results_path, "ab")
            if created:
                fsync_dir(self.path)
        self._fh.write(record_line(record).encode())
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def compact(self, order: Iterable[str]) -> None:
        """Rewrite ``results.jsonl`` with one line per trial (the last), in ``order`` first,
        when some trial has more than one line."""
        records = self.records()
        latest = {r["trial"]: r for r in records}
        if len(latest) == len(records):
            return
        self.close()
        ids = [t for t in order if t in latest] + [t for t in latest if t not in set(order)]
        replace_atomically(self.results_path, "".join(record_line(latest[t]) for t in ids),
                           durable=True)

