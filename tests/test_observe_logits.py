"""Logits a model forms itself, handed to the pipeline's observers (``observe_logits``): the
monitor and the guard see them as the attention call the pipeline would have made, and the
recall trainer's records come from the guard."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from attnscale.attention import MultiHeadAttention
from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.model import BatchIndex, RecallNet, StackedRecall
from attnscale.experiments.recall.task import train_chunk
from attnscale.experiments.recall.trainer import stack_batches, train_runs
from attnscale.columns import MONITOR_SUMMARIES
from attnscale.guard import guard
from attnscale.measure.monitor import monitor
from attnscale.mechanisms import MECHANISMS
from attnscale.pipeline import key_mask, observe_logits
from attnscale.pipeline import run as pipeline_run
from attnscale.stats import columns, row_stats


class _SelfFormed(nn.Module):
    """A layer that hands over logits it formed itself (here: the pipeline's materialised
    logits of ``mha``'s call, masked), with the call's output gate."""

    def __init__(self, mha: MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor):
        super().__init__()
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, mha.n_heads, -1).transpose(1, 2)
                   for w in (mha.w_q, mha.w_k, mha.w_v))
        self.mech = mha.mechanism
        self.gate = self.mech.gate_values(x) if self.mech.gate else None
        trace = pipeline_run(q, k, v, self.mech, mask=mask, causal=True, trace=True, gate=self.gate,
                             log_forget=mha._forget_gates(x, None, True))
        keep = key_mask(mask, True, q, k)
        if self.mech.normaliser == "differential":  # two maps side by side
            keep = torch.cat([keep, keep], -1)
        self.logits = trace.logits.masked_fill(~keep, -math.inf)

    def forward(self) -> None:
        observe_logits(self.logits, self.mech, gate=self.gate)


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_monitor_sees_handed_logits_as_the_pipeline_call(name):
    """For every mechanism, its normaliser's statistics of the handed logits equal those the
    monitor takes of the same layer's pipeline call."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, name, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 4] = False                                          # a query with no key
    with torch.no_grad(), monitor(mha) as direct:
        mha(x, mask=mask, causal=True)
    with torch.no_grad():
        own = _SelfFormed(mha, x, mask)
    with monitor(own) as handed:
        own()
    assert len(handed.records) == len(direct.records) == 2
    for got, want in zip(handed.records, direct.records):
        assert got["queries"] == want["queries"]
        for key in want:
            if key not in ("layer", "head", "module", "queries"):
                assert_close(got[key], want[key], rtol=1e-9, atol=1e-12, msg=key)


def test_handed_logits_fold_qk_clip_s_max_in_training_only():
    mech = MultiHeadAttention(8, 2, "qk-clip").mechanism
    z = torch.tensor([[[[1.0, 5.0]], [[-2.0, float("-inf")]]]])   # (1, 2 heads, 1, 2)
    mech.eval()
    observe_logits(z, mech)
    assert torch.isneginf(mech.s_max).all()
    mech.train()
    observe_logits(z, mech)
    assert_close(mech.s_max, torch.tensor([5.0, -2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="logits must be"):
        observe_logits(z[0], mech)


TINY = replace(RecallConfig(), d_k=16, steps=6, log_every=2, batch_size=8, eval_size=40)


def test_guard_records_one_layer_per_stacked_run():
    runs = [replace(TINY, mechanism=m) for m in ("scaled", "sigmoid", "sink")]
    model = StackedRecall([RecallNet(c) for c in runs]).train()
    batch = stack_batches([train_chunk(c, 0) for c in runs])
    idx = BatchIndex.build(batch, TINY.n_keys, TINY.n_values).step(0)
    with guard(model, every=1, alarm_logit=None, alarm_entropy_fraction=None) as g:
        out = model(idx)
        records = g.step(0)
    assert [r["layer"] for r in records] == [0, 1, 2]
    for m, r in enumerate(records):  # each run under its own normaliser
        mech = model.mechanisms[m]
        sink = mech.sink_logits().detach() if mech.normaliser == "sink" else None
        rows = columns(row_stats(out.z[m].detach(), normaliser=mech.normaliser, sink=sink))
        # float32 logits: the compiled row kernel and PyTorch agree to float32 rounding
        assert_close(r["entropy_mean"], float(rows["entropy"].mean()), rtol=1e-6, atol=0.0)
        assert_close(r["jacobian_fro_mean"], float(rows["jacobian_fro"].mean()), rtol=1e-6,
                     atol=0.0)
        assert r["n_keys"] == TINY.pairs


def test_recall_trace_is_the_guard_record_of_each_recorded_step(monkeypatch):
    """Each run's trace row at a recorded step is the guard's record of that run's layer at
    that step, statistic by statistic (the guard the trainer builds, kept by a spy)."""
    import attnscale.experiments.recall.trainer as trainer

    guards = []

    def spy(*args, **kwargs):
        guards.append(guard(*args, **kwargs))
        return guards[-1]

    monkeypatch.setattr(trainer, "guard", spy)
    runs = train_runs([replace(TINY, mechanism=m) for m in ("unscaled", "qk-clip")],
                      show_progress=False)
    (g,) = guards
    means = {s.column: s.key for s in MONITOR_SUMMARIES if s.reduce == "mean"}
    for m, run in enumerate(runs):
        assert [row["step"] for row in run.trace] == [0, 2, 4, 5]   # and the last step
        assert all(0.0 < row["entropy"] <= math.log(TINY.pairs) + 1e-9 for row in run.trace)
        for row in run.trace:
            (record,) = [r for r in g.records if r["step"] == row["step"] and r["layer"] == m]
            assert {k: v for k, v in row.items() if k != "step"} == {
                name: record[means[name]] for name in row if name != "step"}
    # the runs differ at every step, so a row given to the other run would not match
    assert all(a["entropy"] != b["entropy"] for a, b in zip(runs[0].trace, runs[1].trace))


def test_record_next_records_a_step_off_the_grid():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).train()
    x = torch.randn(1, 5, 8)
    with guard(mha, every=10) as g:
        steps = []
        for t in range(4):
            if t == 3:
                g.record_next()
            mha(x)
            steps += sorted({r["step"] for r in g.step(t)})
    assert steps == [0, 3]
