"""Reading a sweep back: :func:`load` returns its records, and a table with :meth:`to_frame`.

Reading needs no experiment code: a store can be loaded (and shown) on a machine that cannot run
its trials.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from attnscale.sweep.grid import SweepSpec
from attnscale.sweep.store import Store
from attnscale.sweep.trial import Trial

RECORD_COLUMNS = ("trial", "status", "wall_seconds", "host", "error")


class SweepResults(Sequence[dict]):
    """The finished trials of a sweep (its records, one per trial, in grid order) plus the
    trials still pending.  Indexing and iteration give the record dicts."""

    def __init__(self, path: str | os.PathLike, spec: SweepSpec, records: list[dict],
                 pending: list[Trial]):
        self.path = path
        self.spec = spec
        self.records = records
        self.pending = pending

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):  # type: ignore[override]
        return self.records[index]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.records)

    def __repr__(self) -> str:
        return (f"SweepResults({self.spec.experiment!r}, ok={len(self.ok)}, "
                f"failed={len(self.failed)}, pending={len(self.pending)})")

    @property
    def ok(self) -> list[dict]:
        return [r for r in self.records if r["status"] == "ok"]

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.records if r["status"] == "error"]

    @property
    def complete(self) -> bool:
        """Every trial finished without error."""
        return not self.pending and not self.failed

    def rows(self) -> list[dict]:
        """One flat dict per record: trial, status, the config, then the result's keys (a key
        that clashes with a config or record key gets a ``result.`` prefix; a result that is not
        a dict is one ``result`` column), wall_seconds, host and the error's first line."""
        out = []
        for r in self.records:
            row = {"trial": r["trial"], "status": r["status"], **r["config"]}
            result = r.get("result")
            if isinstance(result, dict):
                for key, value in result.items():
                    row[f"result.{key}" if key in row or key in RECORD_COLUMNS else key] = value
            elif result is not None:
                row["result"] = result
            row.update(wall_seconds=r.get("wall_seconds"), host=r.get("host"),
                       error=(r.get("error") or "").split("\n", 1)[0] or None)
            out.append(row)
        return out

    def to_frame(self):
        """:meth:`rows` as a pandas DataFrame (pandas is needed for this method only)."""
        import pandas as pd
        return pd.DataFrame(self.rows())


def load(path: str | os.PathLike) -> SweepResults:
    """The sweep stored in ``path``: its spec, the last record of each trial, and what is
    pending.  A torn last line (a crash mid-write) is ignored."""
    store = Store(path)
    spec = store.read_spec()
    trials = spec.trials()
    latest = store.latest()
    known = {t.id for t in trials}
    records = [latest[t.id] for t in trials if t.id in latest]
    records += [r for t, r in latest.items() if t not in known]
    pending = [t for t in trials if t.id not in latest]
    return SweepResults(path, spec, records, pending)
