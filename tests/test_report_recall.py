"""The training demo's claims over seeds: the stall as a rate with its Wilson interval, whose
verdict cannot change with which seeds stall on a given CPU; seed means with Student's t
interval; ``reproduce --full``."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from attnscale.constants import Z95
from attnscale.errors import ConfigError
from attnscale.report import Measurement, Section, judge
from attnscale.report.claims import CLAIMS_BY_ID, ONE_RUN_PLAUSIBLE
from attnscale.report.reproduce import reproduce
from attnscale.report.sections import recall
from attnscale.stats import t975, wilson_interval

STALL = {"start": 400, "end": 600, "level": 0.25}    # mid-training, above loss 0.1
TAIL = {"start": 700, "end": 900, "level": 0.007}    # a bump in the convergence tail
START = {"start": 0, "end": 150, "level": 3.4}       # the run finding its feet


def _run(seed: int, plateaus: list[dict]):
    """The fields of a RunResult that the stall count reads."""
    return SimpleNamespace(config=SimpleNamespace(seed=seed), plateaus=plateaus)


def _stall_fraction(k: int, n: int) -> Measurement:
    """The section's measurement for n unscaled runs of which the first k stall (the others
    have only plateaus that are not stalls) and n scaled runs without a plateau."""
    unscaled = [_run(s, [STALL] if s < k else [START, TAIL]) for s in range(n)]
    return recall._stall_fraction(unscaled, [_run(s, []) for s in range(n)])


# ---------------------------------------------------------------------------------------------
# The stall: a rate over seeds


@pytest.mark.parametrize("n", [recall.SECTION_SEEDS, recall.FULL_SEEDS])
def test_the_stall_verdict_is_the_same_whichever_seeds_stall(n):
    """Which seeds stall changes with the CPU's float rounding; at the report's seed counts the
    verdict does not, for any count of stalling seeds."""
    claim = CLAIMS_BY_ID["recall.plateau.unscaled.fraction"]
    for k in range(n + 1):
        m = _stall_fraction(k, n)
        assert m.value == k / n
        assert m.interval() == wilson_interval(k, n)
        assert judge(claim, m).agrees, (k, n, judge(claim, m))
        assert m.note.startswith(f"{k} of {n} seeds") and m.note.endswith(f"scaled: 0 of {n}")
        assert m.note.count("seed ") == k                 # each stall named by its seed


def test_the_stall_note_names_each_stall_and_counts_only_stalls():
    m = _stall_fraction(1, 3)
    assert m.note == "1 of 3 seeds: seed 0: 0.25 at steps 400-600; scaled: 0 of 3"
    assert _stall_fraction(0, 3).note == "0 of 3 seeds; scaled: 0 of 3"


def test_a_stall_rate_below_the_floor_differs():
    """Enough seeds without a stall reject the claim: a rate below ONE_RUN_PLAUSIBLE would make
    the essay's one stalling run an unlikely event."""
    claim = CLAIMS_BY_ID["recall.plateau.unscaled.fraction"]
    n = math.ceil(Z95 ** 2 * (1 - ONE_RUN_PLAUSIBLE) / ONE_RUN_PLAUSIBLE) + 1
    assert wilson_interval(0, n)[1] < ONE_RUN_PLAUSIBLE
    verdict = judge(claim, _stall_fraction(0, n))
    assert not verdict.agrees and verdict.text.startswith("differs")


@pytest.mark.parametrize("k, n", [(0, 3), (1, 3), (2, 3), (3, 3), (10, 32), (0, 100), (1, 1)])
def test_wilson_interval_ends_are_the_score_test_boundary(k, n):
    """The Wilson interval is {p : (k - n p)^2 <= z^2 n p (1 - p)}: each end inside (0, 1) is a
    root of the equality; at k = 0 (k = n) the lower (upper) end is 0 (1)."""
    lo, hi = wilson_interval(k, n)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    assert (lo == 0.0) == (k == 0) and (hi == 1.0) == (k == n)
    for p in (e for e in (lo, hi) if 0.0 < e < 1.0):
        score, bound = torch.tensor([(k - n * p) ** 2, Z95 ** 2 * n * p * (1 - p)],
                                    dtype=torch.float64)
        torch.testing.assert_close(score, bound, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("k, n, pattern", [(4, 3, "successes must be <= trials"),
                                           (-1, 3, "successes"), (0, 0, "trials"),
                                           (1.5, 3, "successes")])
def test_wilson_interval_refuses_bad_counts(k, n, pattern):
    with pytest.raises(ConfigError, match=pattern):
        wilson_interval(k, n)


# ---------------------------------------------------------------------------------------------
# Seed means


def test_seed_means_carry_students_t_interval():
    values = [2.0, 3.0, 7.0, None]         # None: a milestone this seed never reached
    m = recall._over_seeds(values)
    x = torch.tensor([2.0, 3.0, 7.0], dtype=torch.float64)
    mean, se = x.mean().item(), (x.std() / math.sqrt(3)).item()
    half = t975(2) * se
    torch.testing.assert_close(torch.tensor([m.value, m.se, *m.interval()]),
                               torch.tensor([mean, se, mean - half, mean + half]))
    assert m.note == "seeds: 2, 3, 7, never"
    one = recall._over_seeds([5.0, None])
    assert (one.value, one.se, one.interval()) == (5.0, None, None)
    assert recall._over_seeds([None, None]) is None


def test_many_seeds_are_summarised_by_their_range():
    values = [float(v) for v in range(recall.LISTED_SEEDS + 1)] + [None]
    text = recall._spread(values, "{:.0f}")
    assert text.startswith(f"0 to {recall.LISTED_SEEDS} (mean 4 ± ")
    assert text.endswith(f", {recall.LISTED_SEEDS + 1} seeds); never in 1")


# ---------------------------------------------------------------------------------------------
# reproduce --full


def _section(fig_dir, *, seed, full, seen):
    seen.append(full)
    return Section(name="Probe", rows=[], measurements={})


def test_reproduce_passes_full_to_every_section(tmp_path):
    seen: list[bool] = []
    probe = partial(_section, seen=seen)
    results = reproduce(tmp_path / "a", 0, sections=(probe,), full=True)
    assert seen == [True] and results["meta"]["full"] is True
    reproduce(tmp_path / "b", 0, sections=(probe,))
    assert seen == [True, False]
    with pytest.raises(ConfigError, match="full must be True or False"):
        reproduce(tmp_path / "c", 0, sections=(probe,), full="yes")
    assert not (tmp_path / "c").exists()


def test_reproduce_cli_full(cli, tmp_path, monkeypatch):
    import attnscale.cli.reproduce as command
    seen: list[bool] = []
    monkeypatch.setattr(command, "reproduce",
                        partial(reproduce, sections=(partial(_section, seen=seen),)))
    assert cli("reproduce", "--out", str(tmp_path / "a"), "--full")[0] == 0
    assert cli("reproduce", "--out", str(tmp_path / "b"))[0] == 0
    assert seen == [True, False]
