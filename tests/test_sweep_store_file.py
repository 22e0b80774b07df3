"""The sweep store's results file when another program replaces or removes it under a running
sweep (a checkout, a stash, an editor saving a copy): the next record goes to the file at the
path, never to the file the store had open."""

from __future__ import annotations

import os

import pytest

from attnscale.sweep.store import Store, record_line


def _record(trial: str) -> dict:
    return {"trial": trial, "config": {"seed": 0}, "status": "ok", "result": {"loss": 1.0},
            "wall_seconds": 1.0}


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_a_record_after_the_file_changed_under_the_store_goes_to_the_path(tmp_path, how):
    store = Store(tmp_path)
    try:
        store.append(_record("t1"))
        assert [r["trial"] for r in store.records()] == ["t1"]
        if how == "replaced":   # as git does: a new file renamed over the old one
            copy = tmp_path / "copy.jsonl"
            copy.write_text(record_line(_record("t0")))
            os.replace(copy, store.results_path)
        else:
            store.results_path.unlink()
        store.append(_record("t2"))
        expected = ["t0", "t2"] if how == "replaced" else ["t2"]
        assert [r["trial"] for r in store.records()] == expected
        store.append(_record("t3"))   # the handle now open is the path's: appends continue
        assert [r["trial"] for r in store.records()] == [*expected, "t3"]
    finally:
        store.close()


def test_an_unchanged_file_keeps_its_handle(tmp_path):
    store = Store(tmp_path)
    try:
        store.append(_record("t1"))
        handle = store._fh
        store.append(_record("t2"))
        assert store._fh is handle
        assert [r["trial"] for r in store.records()] == ["t1", "t2"]
    finally:
        store.close()
