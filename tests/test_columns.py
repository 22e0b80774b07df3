"""The statistic names defined once (:mod:`attnscale.columns`) and what derives from them."""

from __future__ import annotations

import math

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
