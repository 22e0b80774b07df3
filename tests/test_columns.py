"""The statistic names defined once (:mod:`attnscale.columns`) and what derives from them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from attnscale import columns
from attnscale.measure.monitor import RECORD_KEYS, HeadStats, head_stats
from attnscale.measure.monitor.blocks import query_rows
from attnscale.measure.montecarlo import SATURATION_STATS, saturation
from attnscale.stats import row_stats


def test_every_row_statistic_has_a_formula_on_every_path():
    z = torch.randn(3, 5, dtype=torch.float64)
    assert row_stats(z).shape == (3, len(columns.ROW_STATS_COLUMNS))
    for normaliser, extra in (("sigmoid", {}), ("sink", {"sink": torch.zeros(1)})):
        assert row_stats(z, normaliser=normaliser, **extra).shape[-1] == len(
            columns.ROW_STATS_COLUMNS)


def test_the_monitor_and_the_experiments_take_their_keys_from_the_tables():
    assert RECORD_KEYS[4:] == columns.RECORD_STATS
    assert "logit_max" not in RECORD_KEYS                 # kept per head, not recorded
    # Saturation averages the same statistics and the keys' total weight (1 under softmax;
    # sigmoid and sink rows need it).
    assert SATURATION_STATS == (*columns.MEAN_STATS, "mass") and "mass" in columns.WEIGHT_COLUMNS
    row = saturation([4], 8, 4, 0, ["scaled"])[0]
    assert {f"{s}_{part}" for s in columns.MEAN_STATS for part in ("mean", "se")} <= set(row)
    stats = head_stats(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8))
    for s in columns.MONITOR_SUMMARIES:
        assert getattr(stats, s.field).shape == (2,)
    assert set(stats.means()) == {"queries"} | {s.key for s in columns.MONITOR_SUMMARIES}


def test_a_summary_starts_at_its_reductions_identity():
    start = {s.key: s.start for s in columns.MONITOR_SUMMARIES}
    assert start["entropy_mean"] == 0.0 and start["entropy_min"] == math.inf
    assert start["logit_absmax"] == 0.0 and start["logit_max"] == -math.inf
    empty = HeadStats.zeros(3)
    assert torch.equal(empty.entropy_min, torch.full((3,), math.inf, dtype=torch.float64))


def test_named_refuses_a_name_the_tables_do_not_have():
    assert columns.named("entropy", "entropy_mean") == ("entropy", "entropy_mean")
    with pytest.raises(ValueError, match="'entropy_max' is not a statistic"):
        columns.named("entropy_max")


def test_query_rows_keeps_every_query_in_place():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    keep = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    keep[..., :3, :] = False                               # the first block has no key at all
    rows = query_rows(q, k, mask=keep, block=3)            # (1, 2, 5, columns)
    assert rows.shape == (1, 2, 5, len(columns.ROW_STATS_COLUMNS))
    count = rows[..., columns.ROW_STATS_COLUMNS.index("count")]
    assert torch.equal(count, torch.tensor([0.0, 0, 0, 5, 5], dtype=torch.float64).expand(1, 2, 5))
    assert torch.equal(rows[..., :3, :], torch.zeros(1, 2, 3, rows.shape[-1], dtype=torch.float64))


# A Summary line added to attnscale.columns (its source patched before anything imports it),
# then the monitor, the guard and its log on one training forward of a MultiHeadAttention.
_ADDED = """
import importlib.util, json, os, sys
root = importlib.util.find_spec("attnscale").submodule_search_locations[0]
path = os.path.join(root, "columns.py")
source = open(path, encoding="utf-8").read()
start = source.index("MONITOR_SUMMARIES = (")
end = source.index("\\n)\\n", start)
source = (source[:end] + '\\n    Summary("logit_std_max", "logit_std", "max"),'
          + source[end:])
module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
    "attnscale.columns", path))
sys.modules["attnscale.columns"] = module
exec(compile(source, path, "exec"), module.__dict__)

import torch
import attnscale
from attnscale.guard import GUARD_KEYS, read_log
from attnscale.measure.monitor import RECORD_KEYS

out = sys.argv[1]
torch.manual_seed(0)
mha = attnscale.MultiHeadAttention(16, 2)
x = torch.randn(2, 6, 16)
with torch.no_grad(), attnscale.monitor(mha) as mon:
    mha(x, causal=True)
with attnscale.guard(mha, every=1, alarm_logit=None, log=os.path.join(out, "g.jsonl")) as g:
    mha(x, causal=True).sum().backward()
    g.step(0)
old = {k: v for k, v in g.records[0].items() if k != "logit_std_max"}
with open(os.path.join(out, "old.jsonl"), "w") as f:
    f.write(json.dumps(old) + "\\n")
print(json.dumps({
    "record_keys": list(RECORD_KEYS), "guard_keys": list(GUARD_KEYS),
    "monitor": [[r["logit_std"], r["logit_std_max"]] for r in mon.records],
    "guard": [[r["logit_std"], r["logit_std_max"]] for r in g.records],
    "log": [r["logit_std_max"] for r in read_log(os.path.join(out, "g.jsonl"))],
    "old": [str(r["logit_std_max"]) for r in read_log(os.path.join(out, "old.jsonl"))]}))
"""


def test_a_statistic_added_to_the_tables_reaches_every_record(tmp_path):
    """One Summary line in attnscale.columns (the largest row logit std per head) reaches the
    monitor's records, the guard's records and log, and a log written before it still reads."""
    done = subprocess.run([sys.executable, "-c", _ADDED, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert "logit_std_max" in got["record_keys"] and "logit_std_max" in got["guard_keys"]
    # the same pass in two records
    torch.testing.assert_close(torch.tensor(got["monitor"]), torch.tensor(got["guard"]))
    assert all(peak > mean > 0 for mean, peak in got["guard"])       # a max over rows > the mean
    assert got["log"] == [peak for _, peak in got["guard"]]
    assert got["old"] == ["nan"]
