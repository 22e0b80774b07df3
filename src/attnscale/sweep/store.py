"""The sweep store: a folder that says what a sweep runs and holds every finished trial.

Layout of ``DIR``::

    sweep.json       what the sweep runs: experiment, module, grid, fixed settings, the full base
                     config, the attnscale version; written atomically and listed in the folder's
                     manifest (the output-folder policy of :mod:`attnscale.io`)
    results.jsonl    one JSON line per finished trial:
                     {"trial", "config", "status": "ok" | "error", "result", "error",
                      "wall_seconds", "host", "nulls"}

    .attnscale-lock  the writer's lock (:meth:`Store.locked`): one process writes a store

Only the driver process writes ``results.jsonl``, and only while it holds the store's lock: each
line is appended in one write, flushed and fsync'd before the next trial is counted as finished,
so a crash loses at most the trials in flight, never a finished one.  A crash in the middle of a
write leaves a last line without its newline: :meth:`Store.records` ignores it when it is not a
complete record, and :meth:`Store.repair` cuts it off before appending (a complete record that
only lacks its newline is kept, and the newline added).  A file replaced or removed under a
running sweep (a checkout, a stash) is opened again at its path before the next append, so no
record goes to a file that no path names.  Blank lines are skipped.  When a trial
has several lines (an error, then a retry), the last one counts; :meth:`Store.compact` rewrites
the file (atomically) with one line per trial.

Every record is checked on read (:func:`check_record`): a line changed by hand is a ConfigError
that names the file, the line and the field, never a traceback later.  That includes a result's
numbers: a trial's result is strict JSON (a diverged number is written as null, never NaN), and
``nulls`` lists where its result holds null (:func:`result_nulls`), so a ``NaN``, an infinity,
or a null where the trial recorded a number is such an error, not a null drawn into a report.
(Records from before ``nulls`` was written are checked for NaN and infinities only.)
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from attnscale.errors import ConfigError, parse_json
from attnscale.io import atomic_write, check_output_path, exclusive, fsync_dir, \
    replace_atomically
from attnscale.sweep.grid import SweepSpec

SPEC_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
FORMAT = "attnscale-sweep"
FORMAT_VERSION = 1
RECORD_KEYS = ("trial", "config", "status", "result", "error", "wall_seconds", "host", "nulls")
# A run of list entries in a path of ``nulls``: ``result.loss[57:100]`` is entries 57 to 99.
_RUN = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def _leaves(value: object, path: str) -> Iterator[tuple[str, object]]:
    """(path, value) of every number and null in a JSON value, in document order; paths as
    ``result.trace[3].loss``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        yield path, value


def result_nulls(result: object) -> list[str]:
    """Where ``result`` holds null, as paths (``result.final_loss``), consecutive list entries
    as one run (``result.loss[57:100]``: a diverged run's loss from step 57 on)."""
    out: list[list] = []   # [prefix, first, end] for a run, [path] otherwise
    for path, value in _leaves(result, "result"):
        if value is not None:
            continue
        prefix, _, index = path.rpartition("[")
        if index.endswith("]") and index[:-1].isdigit():
            i = int(index[:-1])
            if out and len(out[-1]) == 3 and out[-1][0] == prefix and out[-1][2] == i:
                out[-1][2] = i + 1
                continue
            out.append([prefix, i, i + 1])
        else:
            out.append([path])
    return [p[0] if len(p) == 1 else f"{p[0]}[{p[1]}]" if p[2] == p[1] + 1
            else f"{p[0]}[{p[1]}:{p[2]}]" for p in out]


def _recorded_nulls(nulls: list[str]) -> set[str]:
    """The single paths of ``nulls`` (its runs expanded)."""
    out = set()
    for path in nulls:
        run = _RUN.match(path)
        if run:
            out.update(f"{run[1]}[{i}]" for i in range(int(run[2]), int(run[3])))
        else:
            out.add(path)
    return out


def _check_result(record: dict) -> None:
    """A ValueError naming the first number of an ok record's result that is not finite, or
    null where the trial recorded a number (when the record says where it wrote null)."""
    nulls = record.get("nulls")
    if nulls is not None and not (isinstance(nulls, list)
                                  and all(isinstance(p, str) for p in nulls)):
        raise ValueError(f"field 'nulls' must be a list of result paths, got {json.dumps(nulls)}")
    recorded = _recorded_nulls(nulls) if nulls is not None else None
    for path, value in _leaves(record.get("result"), "result"):
        if value is None:
            if recorded is not None and path not in recorded:
                raise ValueError(f"field {path!r} must be a finite number, as the trial "
                                 "recorded it, got null")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"field {path!r} must be a finite number, got {json.dumps(value)}")


def check_record(record: object) -> dict:
    """``record`` if it is a trial record as attnscale writes it, else a ValueError naming the
    first field that is not."""
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object, got {json.dumps(record)}")
    for key in ("trial", "config", "status", "wall_seconds"):
        if key not in record:
            raise ValueError(f"field {key!r} is missing")
    checks = {
        "trial": (isinstance(record["trial"], str) and record["trial"], "a trial id"),
        "config": (isinstance(record["config"], dict), "an object"),
        "status": (record["status"] in ("ok", "error"), '"ok" or "error"'),
        "error": (record.get("error") is None or isinstance(record["error"], str),
                  "null or a message"),
        "wall_seconds": (isinstance(record["wall_seconds"], (int, float))
                         and not isinstance(record["wall_seconds"], bool)
                         and record["wall_seconds"] >= 0, "a number of seconds"),
        "host": (record.get("host") is None or isinstance(record["host"], str),
                 "null or a host name"),
    }
    for key, (good, what) in checks.items():
        if not good:
            raise ValueError(f"field {key!r} must be {what}, got {json.dumps(record.get(key))}")
    if record["status"] == "error" and not record.get("error"):
        raise ValueError("field 'error' must hold the message of a failed trial, got "
                         f"{json.dumps(record.get('error'))}")
    if record["status"] == "ok":
        _check_result(record)
    return record


def record_line(record: dict) -> str:
    """One line of ``results.jsonl`` (strict JSON, fixed key order, newline-terminated); an ok
    record gets its ``nulls`` (:func:`result_nulls`) when it has none yet."""
    line = {k: record.get(k) for k in RECORD_KEYS}
    if line["status"] == "ok" and line["nulls"] is None:
        line["nulls"] = result_nulls(line["result"])
    return json.dumps(line, allow_nan=False) + "\n"


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
        attnscale's (the output-folder policy of :mod:`attnscale.io`; ``force`` overrides it);
        for a sweep in it, ``results.jsonl`` must take appends."""
        if new:
            check_output_path("out", self.path, kind="dir", files=(SPEC_FILE, RESULTS_FILE),
                              force=force)
            return
        check_output_path("out", self.path, kind="dir", force=True)  # writable, a folder
        if self.results_path.exists() or self.results_path.is_symlink():
            try:
                with open(self.results_path, "ab"):
                    pass
            except OSError as err:
                raise ConfigError(f"{str(self.results_path)!r} is not writable "
                                  f"({err.strerror or err}); make it writable (chmod u+w, "
                                  f"chattr -i) and run this again.") from None

    def locked(self):
        """Context manager: hold the store's writer lock (:func:`attnscale.io.exclusive`)."""
        return exclusive(self.path, param="out")

    # -- sweep.json ---------------------------------------------------------------------------

    def read_spec(self) -> SweepSpec:
        """The spec of the sweep in this folder; a ConfigError when there is none or it is not
        attnscale's."""
        if not self.spec_path.is_file():
            raise ConfigError(f"{str(self.path)!r} holds no sweep (no {SPEC_FILE}).")
        try:
            obj = parse_json(SPEC_FILE, self.spec_path.read_bytes())
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise ValueError("not an attnscale sweep")
            if obj.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {obj.get('version')!r}, "
                                 f"this attnscale reads {FORMAT_VERSION}")
            return SweepSpec.from_json(obj)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{str(self.spec_path)!r} is not a sweep attnscale wrote "
                              f"({str(err).rstrip('.')}); "
                              f"restore it, or start the sweep again in a new folder.") from None

    def write_spec(self, spec: SweepSpec) -> None:
        from attnscale import __version__
        obj = {"format": FORMAT, "version": FORMAT_VERSION, "attnscale": __version__,
               "written": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               **spec.to_json()}
        self.path.mkdir(parents=True, exist_ok=True)
        # force: the folder passed Store.check, and a sweep.json changed by hand gets here only
        # when the user chose to continue it as it reads (--force); written, it is ours again.
        try:
            atomic_write(self.spec_path, json.dumps(obj, indent=1, allow_nan=False) + "\n",
                         param="out", force=True)
        except OSError as err:  # before any trial runs: the spec is written first
            raise ConfigError(f"cannot write {str(self.spec_path)!r} ({err.strerror or err}); "
                              f"make it and its folder writable (chmod u+w, chattr -i) and run "
                              f"this again.") from None

    # -- results.jsonl ------------------------------------------------------------------------

    def _lines(self) -> tuple[list[dict], int, bool]:
        """Complete records; the byte length of the file up to the last complete record; and
        whether that record is a last line missing only its newline."""
        if not self.results_path.exists():
            return [], 0, False
        try:
            data = self.results_path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{str(self.results_path)!r} cannot be read "
                              f"({err.strerror or err}); it must be the sweep's results "
                              f"file.") from None
        end = data.rfind(b"\n") + 1                      # a torn last line has no newline
        records = [self._record(number, line)
                   for number, line in enumerate(data[:end].split(b"\n"), start=1)
                   if line.strip()]
        tail = data[end:]
        if tail.strip():  # complete JSON that lacks its newline is a record, not a torn write
            try:
                record = check_record(parse_json("record", tail))
            except ValueError:
                return records, end, False
            return records + [record], len(data), True
        return records, len(data) if not tail else end, False

    def _record(self, number: int, line: bytes) -> dict:
        try:
            return check_record(parse_json("record", line))
        except ValueError as err:
            raise ConfigError(f"{str(self.results_path)!r} line {number} is not a trial record "
                              f"({str(err).rstrip('.')}); the file was changed by something "
                              f"other than attnscale: restore it, or delete that line to run "
                              f"its trial again.") from None

    def records(self) -> list[dict]:
        """Every complete record in file order (a torn last line is ignored)."""
        return self._lines()[0]

    def repair(self) -> bool:
        """Before appending: cut off a torn last line, or end a complete last record with its
        newline; True if there was anything to repair."""
        _, end, unterminated = self._lines()
        if unterminated:
            with open(self.results_path, "ab") as fh:
                fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            return True
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
        try:
            if self._fh is not None and not self._same_file():
                # Another program replaced or removed the file (a checkout, a stash, an editor
                # saving a copy): appends to the open handle would go to a file no path names,
                # so the record goes to the file at the path now, and a resume reruns whatever
                # the replacement dropped.
                self.close()
            if self._fh is None:
                created = not self.results_path.exists()
                self._fh = open(self.results_path, "ab")
                if created:
                    fsync_dir(self.path)
            self._fh.write(record_line(record).encode())
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as err:
            raise ConfigError(f"cannot write {str(self.results_path)!r} "
                              f"({err.strerror or err}); make it writable, then resume the "
                              f"sweep to run the trials not recorded.") from None

    def _same_file(self) -> bool:
        """Whether the open handle is still the file at ``results.jsonl``'s path."""
        try:
            here = os.stat(self.results_path)
        except FileNotFoundError:
            return False
        open_ = os.fstat(self._fh.fileno())
        return (here.st_dev, here.st_ino) == (open_.st_dev, open_.st_ino)

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

