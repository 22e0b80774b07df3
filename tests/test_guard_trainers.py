"""The guard inside real trainers, tried as a demanding user would: which forward passes count
(validation, no_grad, gradient checkpointing), strict mode and a second clipping guard, resuming
from a checkpoint, torch.compile, the HF Trainer's own loss log.  Each test fails on a guard
that gets its class of case wrong; tiny models, CPU, a few steps."""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

import attnscale
from attnscale import MultiHeadAttention
from attnscale.errors import ConfigError
from attnscale.guard import read_log
from attnscale.hf import TemperatureCallback
from test_guard import batches, make_hf
from test_guard_integrations import _trainer

D, HEADS, SEQ = 16, 2, 8


class Stack(nn.Module):
    """An input projection, then residual attention blocks, on continuous inputs (B, N, D);
    ``ckpt`` runs each block in training under torch's gradient checkpointing ("reentrant" or
    "non-reentrant")."""

    def __init__(self, layers: int = 2, ckpt: str | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(MultiHeadAttention(D, HEADS) for _ in range(layers))
        self.ckpt = ckpt

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            if self.ckpt and self.training:
                x = x + checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = x + block(x)
        return x


def inputs(n: int, scale: float = 1.0, seq: int = SEQ, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, seq, D, generator=g) * scale for _ in range(n)]


def loop(model, xs, *, between=None, lr: float = 0.5, **options):
    """A plain loop: SGD, loss -mean(out²) (it grows the logits); ``between(model)`` runs after
    each step, inside the guard.  Returns the guard."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with attnscale.guard(model, optimizer=opt, alarm_logit=None, **options) as g:
        for step, x in enumerate(xs):
            model(x).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
            if between is not None:
                between(model)
    return g


def same_records(got: list[dict], want: list[dict]) -> None:
    assert [(r["step"], r["module"], r["head"], r["queries"], r["n_keys"]) for r in got] == \
        [(r["step"], r["module"], r["head"], r["queries"], r["n_keys"]) for r in want]
    for key in ("logit_max", "entropy_mean", "logit_std_ratio", "s_max"):
        a = torch.tensor([math.nan if r[key] is None else r[key] for r in got], dtype=torch.float64)
        b = torch.tensor([math.nan if r[key] is None else r[key] for r in want],
                         dtype=torch.float64)
        assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True, msg=key)


def same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------------------
# Only training forwards count


def test_a_no_grad_pass_in_training_mode_is_not_observed():
    """A validation pass without eval() but under no_grad, on out-of-range inputs of another
    length, changes neither the records nor the clip."""
    xs = inputs(4)
    big = inputs(1, scale=30.0, seq=12, seed=9)[0]

    def validate(model):
        with torch.no_grad():
            model(big)

    plain, watched = Stack(), Stack()
    want = loop(plain, xs, every=1, qk_clip=5.0)
    got = loop(watched, xs, between=validate, every=1, qk_clip=5.0)
    same_records(got.records, want.records)
    same_weights(watched, plain)
    assert all(r["queries"] == 4 * SEQ for r in got.records)


def _lightning(tmp_path, callbacks, **options):
    import lightning

    return lightning.Trainer(**{
        "max_steps": 6, "callbacks": callbacks, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
        "devices": 1, "default_root_dir": str(tmp_path), **options})


def _lit(stack: nn.Module, lr: float = 0.5, split: bool = False, log_loss: bool = False):
    """The usual LightningModule: ``training_step`` calls the model it holds (never itself);
    ``split`` feeds a projection's output to the model instead (an activation); ``log_loss``
    logs the loss as "loss"."""
    import lightning

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = stack
            self.proj = nn.Linear(D, D) if split else None

        def training_step(self, batch, index):
            (x,) = batch
            if self.proj is not None:
                x = self.proj(x)
            loss = self.model(x).square().mean().neg()
            if log_loss:
                self.log("loss", loss)
            return loss

        def validation_step(self, batch, index):
            (x,) = batch
            self.log("val", self.model(x).square().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Lit()


def _loader(xs):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs)),
                                       batch_size=4)


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_lightning_validation_is_never_recorded_nor_clipped(tmp_path, quiet):
    """Validation every 2 steps (and the sanity check) on out-of-range inputs of another length:
    records and weights as without validation."""
    from attnscale.lightning import TemperatureCallback as LightningCallback

    xs, big = inputs(6), inputs(2, scale=30.0, seq=12, seed=9)
    runs = {}
    for name, val in (("plain", None), ("validated", _loader(big))):
        stack = Stack()
        callback = LightningCallback(every=1, qk_clip=5.0, alarm_logit=None)
        trainer = _lightning(tmp_path, [callback], val_check_interval=2,
                             limit_val_batches=1, num_sanity_val_steps=1)
        trainer.fit(_lit(stack), _loader(xs), val)
        runs[name] = (stack, callback.guard.records)
    same_records(runs["validated"][1], runs["plain"][1])
    same_weights(runs["validated"][0], runs["plain"][0])
    assert {r["queries"] for r in runs["validated"][1]} == {4 * SEQ}


def test_monitor_observes_a_forward_that_enters_at_a_submodule():
    """Which passes ``every`` selects is decided wherever a pass enters the model, not only at
    its root: a direct call of a block after an unselected root pass is still observed."""
    model = Stack()
    x = inputs(1)[0]
    with attnscale.monitor(model, every=2) as mon:
        model(x)             # step 0: observed
        model(x)             # step 1: not
        model.blocks[0](x)   # enters at a submodule, at step 2: observed
    assert [r["queries"] for r in mon.records] == [2 * 4 * SEQ] * HEADS + [4 * SEQ] * HEADS


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing: the recomputation in backward is not an observation


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_checkpointed_blocks_are_observed_once(ckpt):
    xs = inputs(3)
    want = loop(Stack(), xs, every=1, qk_clip=1.0)
    model = Stack(ckpt=ckpt)
    got = loop(model, xs, every=1, qk_clip=1.0)
    same_records(got.records, want.records)
    assert {r["queries"] for r in got.records} == {4 * SEQ}
    assert any(r["clip_gamma"] < 1 for r in got.records)
    plain = Stack()
    loop(plain, xs, every=1, qk_clip=1.0)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_is_observed_once(reentrant):
    data = batches(2)

    def run(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with attnscale.guard(model, optimizer=opt, every=1, alarm_logit=None) as g:
            for step, batch in enumerate(data):
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                g.step(step)
        return g.records

    want = run(make_hf("llama"))
    model = make_hf("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                                                                      reentrant})
    same_records(run(model.train()), want)


def test_monitor_does_not_count_a_checkpoint_recomputation():
    model = Stack(ckpt="non-reentrant")
    with attnscale.monitor(model) as mon:
        model(inputs(1)[0]).sum().backward()
    assert {r["queries"] for r in mon.records} == {4 * SEQ}


# ---------------------------------------------------------------------------------------------
# Strict mode in every trainer, and one clipping guard per layer


def _max_logit(stack: Stack, x: torch.Tensor) -> float:
    """The largest logit over every block and head, recomputed in float64 in eval mode."""
    out = -math.inf
    with torch.no_grad():
        x = stack.inp(x)
        for block in stack.blocks:
            q = block._split(block.w_q(x)).double()
            k = block._split(block.w_k(x)).double()
            out = max(out, float((q @ k.transpose(-1, -2)).amax()) / math.sqrt(D // HEADS))
            x = x + block(x)
    return out


def test_lightning_strict_mode_bounds_every_head(tmp_path, quiet):
    from attnscale.lightning import TemperatureCallback as LightningCallback

    tau = 1.0
    xs = inputs(6)
    free = Stack()
    _lightning(tmp_path, []).fit(_lit(free), _loader(xs))
    assert _max_logit(free, xs[-1]) > tau  # the clip has work to do
    stack = Stack()
    callback = LightningCallback(every=1, qk_clip=tau, strict=True, alarm_logit=None)
    _lightning(tmp_path, [callback]).fit(_lit(stack), _loader(xs))
    assert all(r["s_max"] is not None for r in callback.guard.records)
    assert any(r["clip_gamma"] < 1 for r in callback.guard.records)
    assert _max_logit(stack, xs[-1]) <= tau * (1 + 1e-6)


def test_strict_mode_refuses_a_pass_entered_on_an_activation(tmp_path, quiet):
    from attnscale.lightning import TemperatureCallback as LightningCallback

    callback = LightningCallback(every=1, qk_clip=2.0, strict=True)
    with pytest.raises(ConfigError, match="called on an activation") as err:
        _lightning(tmp_path, [callback]).fit(_lit(Stack(), split=True), _loader(inputs(2)))
    assert "\n" not in str(err.value) and "model" in str(err.value)


def test_a_second_clipping_guard_is_refused_naming_the_first(tmp_path):
    model = Stack()
    log = tmp_path / "first.jsonl"
    with attnscale.guard(model, qk_clip=1.0, log=log):
        with pytest.raises(ConfigError, match="already clipped by an active attnscale.guard") \
                as err:
            with attnscale.guard(model.blocks[1], qk_clip=0.5):
                pass
        assert "first.jsonl" in str(err.value) and "\n" not in str(err.value)
        with attnscale.guard(model, every=1):  # watching beside it is fine
            pass
    with attnscale.guard(model, qk_clip=0.5):  # the first one has left
        pass


def test_two_watching_guards_record_the_same_numbers():
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with attnscale.guard(model, optimizer=opt, every=1, qk_clip=2.0) as a, \
            attnscale.guard(model, every=1) as b:
        for step, x in enumerate(inputs(3)):
            model(x).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
            a.step(step)
            b.step(step)
    assert len(a.records) == len(b.records) == 3 * 2 * HEADS
    for ra, rb in zip(a.records, b.records):
        assert {k: v for k, v in ra.items() if k not in ("s_max", "clip_gamma")} == \
            {k: v for k, v in rb.items() if k not in ("s_max", "clip_gamma")}


# ---------------------------------------------------------------------------------------------
# Resuming: the log continues, the references are kept


def test_a_plain_loop_resumes_its_log_and_references(tmp_path):
    """A run checkpointed after step 3 and stopped after step 5 resumes from step 3: the log
    reads as the uninterrupted run (steps 4 and 5 written twice, the first ones superseded),
    with logit_std_ratio and the entropy baseline still referred to step 0."""
    xs = inputs(8)
    whole = loop(Stack(), xs, every=1)

    log = tmp_path / "g.jsonl"
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    saved = {}
    with attnscale.guard(model, optimizer=opt, every=1, alarm_logit=None, log=log) as g:
        for step, x in enumerate(xs[:6]):
            model(x).square().mean().neg().backward()
            opt.step()
            opt.zero_grad()
            g.step(step)
            if step == 3:
                saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                         "guard": json.loads(json.dumps(g.state_dict()))}
    # A new process: the model back at step 3, the loop continues at step 4.
    for use_state in (False, True):
        model.load_state_dict(saved["model"])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with attnscale.guard(model, optimizer=opt, every=1, alarm_logit=None, log=log,
                             resume=3) as g:
            if use_state:
                g.load_state_dict(saved["guard"])
            for step, x in enumerate(xs[4:], start=4):
                model(x).square().mean().neg().backward()
                opt.step()
                opt.zero_grad()
                g.step(step)
        same_records(read_log(log), whole.records)
    marks = [json.loads(line) for line in log.read_text().splitlines() if '"event"' in line]
    assert marks == [{"event": "resume", "after_step": 3, "superseded": 2 * 2 * HEADS},
                     {"event": "resume", "after_step": 3, "superseded": 4 * 2 * HEADS}]


def test_a_resume_without_log_or_state_says_its_references_restart():
    model = Stack()
    with pytest.warns(RuntimeWarning, match="without its references"):
        with attnscale.guard(model, every=1, alarm_logit=None, resume=3) as g:
            model(inputs(1)[0])
            g.step(4)
    assert g.records[0]["logit_std_ratio"] == 1.0


def test_hf_trainer_resume_keeps_the_log_and_the_references(tmp_path):
    """Checkpoints every 3 steps; the run goes on to step 6 and is resumed from checkpoint-3:
    the log reads as one run and equals the uninterrupted run's records."""
    options = dict(save_strategy="steps", save_steps=3, logging_steps=2)
    whole = TemperatureCallback(every=1, alarm_logit=None)
    _trainer(make_hf("llama"), tmp_path / "whole", [whole], **options).train()

    log = tmp_path / "guard.jsonl"
    first = TemperatureCallback(every=1, alarm_logit=None, log=log)
    _trainer(make_hf("llama"), tmp_path, [first], **options).train()
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["TemperatureCallback"]["attributes"]["guard_state"]
    for restore in (False, True):  # the Trainer rebuilding the callback, or not
        again = TemperatureCallback(every=1, alarm_logit=None, log=str(log))
        trainer = _trainer(make_hf("llama"), tmp_path, [again],
                           restore_callback_states_from_checkpoint=restore, **options)
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
        same_records(read_log(log), whole.guard.records)
    assert [r["step"] for r in read_log(log)][::8] == [1, 2, 3, 4, 5, 6]
    # without a log, the references come from the checkpoint alone
    bare = TemperatureCallback(every=1, alarm_logit=None)
    _trainer(make_hf("llama"), tmp_path, [bare], **options).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    same_records(bare.guard.records, whole.guard.records[3 * 8:])


def test_hf_rebuilt_callback_still_runs_ahead_of_the_reporters(tmp_path):
    """restore_callback_states_from_checkpoint=True: the Trainer swaps in a callback rebuilt from
    the checkpoint at the end of its list; added with add_to, it goes back in front."""
    options = dict(save_strategy="steps", save_steps=2, logging_steps=1)
    first = _trainer(make_hf("llama"), tmp_path, [], steps=2, **options)
    TemperatureCallback(every=1, alarm_logit=None).add_to(first)
    first.train()
    again = TemperatureCallback(every=1, alarm_logit=None)
    trainer = _trainer(make_hf("llama"), tmp_path, [], steps=4, report_to=["tensorboard"],
                       restore_callback_states_from_checkpoint=True, **options)
    again.add_to(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    rebuilt = trainer.callback_handler.callbacks[0]
    assert isinstance(rebuilt, TemperatureCallback) and rebuilt is not again
    assert rebuilt.guard_state and [r["step"] for r in rebuilt.guard.records][::8] == [3, 4]
    logged = [h for h in trainer.state.log_history if "loss" in h]  # 1, 2 from the checkpoint
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    assert all("attnscale/logit_max/layer0" in h for h in logged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "out").rglob("events.out.tfevents.*")  # the reporter's, run two
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/attnscale/logit_max/layer0")]
    assert steps == [3, 4]


def test_hf_restore_refuses_an_option_a_checkpoint_cannot_hold(tmp_path):
    options = dict(save_strategy="steps", save_steps=2)
    _trainer(make_hf("llama"), tmp_path, [TemperatureCallback(on_alarm=print)], steps=2,
             **options).train()
    again = TemperatureCallback(on_alarm=print)
    trainer = _trainer(make_hf("llama"), tmp_path, [again], steps=4,
                       restore_callback_states_from_checkpoint=True, **options)
    with pytest.raises(ConfigError, match="without its on_alarm option") as err:
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert "\n" not in str(err.value)


def test_lightning_resume_keeps_the_log_and_the_references(tmp_path, quiet):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from attnscale.lightning import TemperatureCallback as LightningCallback

    xs = inputs(3)  # 3 batches: an epoch ends at every checkpoint
    whole = LightningCallback(every=1, alarm_logit=None)
    _lightning(tmp_path / "whole", [whole]).fit(_lit(Stack()), _loader(xs))

    log = tmp_path / "guard.jsonl"
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = LightningCallback(every=1, alarm_logit=None, log=log)
    _lightning(tmp_path, [first, saves], enable_checkpointing=True).fit(_lit(Stack()),
                                                                         _loader(xs))
    (ckpt,) = [p for p in (tmp_path / "ckpt").iterdir() if "step=3" in p.name]
    again = LightningCallback(every=1, alarm_logit=None, log=log)
    trainer = _lightning(tmp_path, [again])
    trainer.fit(_lit(Stack(seed=1)), _loader(xs), ckpt_path=str(ckpt))
    assert isinstance(trainer, lightning.Trainer)
    same_records(read_log(log), whole.guard.records)
    bare = LightningCallback(every=1, alarm_logit=None)  # the checkpoint's references alone
    _lightning(tmp_path, [bare]).fit(_lit(Stack(seed=1)), _loader(xs), ckpt_path=str(ckpt))
    same_records(bare.guard.records, whole.guard.records[3 * 2 * HEADS:])


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_a_compiled_model_is_observed_and_clipped_as_run_eagerly(quiet):
    """Dynamo traces the compiled model (AOT autograd's graphs run eagerly: no code generation,
    whose worker pool would outlive the test in this process)."""
    xs = inputs(2)
    eager = Stack(layers=1)
    want = loop(eager, xs, every=1, qk_clip=1.0)
    model = Stack(layers=1)
    got = loop(torch.compile(model, backend="aot_eager"), xs, every=1, qk_clip=1.0)
    assert any(r["clip_gamma"] < 1 for r in got.records)
    same_records(got.records, want.records)
    assert got.records[0]["module"] == "blocks.0"
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    # the monitor sees the compiled model as the guard does
    compiled = torch.compile(eager, backend="aot_eager")
    with attnscale.monitor(compiled) as seen:
        compiled(xs[0])
    with attnscale.monitor(eager) as want:
        eager(xs[0])
    assert [r["module"] for r in seen.records] == ["blocks.0"] * HEADS
    assert_close(torch.tensor([r["entropy_mean"] for r in seen.records]),
                 torch.tensor([r["entropy_mean"] for r in want.records]))


# ---------------------------------------------------------------------------------------------
# The HF Trainer's own loss log


def test_hf_callback_leaves_the_trainers_loss_log_as_it_is(tmp_path):
    options = dict(logging_steps=4, steps=8)
    plain = _trainer(make_hf("llama"), tmp_path / "plain", [], **options)
    plain.train()
    callback = TemperatureCallback(every=1, alarm_logit=None)
    watched = _trainer(make_hf("llama"), tmp_path / "watched", [callback], **options)
    watched.train()

    def own(history):
        timing = ("runtime", "per_second", "flos")
        return [{k: v for k, v in h.items() if not k.startswith("attnscale/")
                 and not any(t in k for t in timing)} for h in history]

    assert own(watched.state.log_history) == own(plain.state.log_history)
    logged = [h for h in watched.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [4, 8]
    # each log event carries the worst of the steps recorded since the previous one
    for event, window in zip(logged, ((1, 4), (5, 8))):
        rows = [r for r in callback.guard.records
                if window[0] <= r["step"] <= window[1] and r["layer"] == 0]
        assert event["attnscale/logit_max/layer0"] == max(r["logit_max"] for r in rows)
        assert event["attnscale/entropy_mean_min/layer0"] == min(r["entropy_mean"] for r in rows)


def test_lightning_loggers_get_every_recorded_step_and_their_own_log_unchanged(tmp_path, quiet):
    """Lightning logs its own metrics every log_every_n_steps; the guard's scalars reach the
    loggers at each recorded step, and Lightning's own rows are those without the callback."""
    from lightning.pytorch.loggers import CSVLogger

    from attnscale.lightning import TemperatureCallback as LightningCallback

    def metrics(name: str, callbacks) -> list[dict]:
        logger = CSVLogger(tmp_path, name=name, version=0)
        _lightning(tmp_path, callbacks, logger=logger, log_every_n_steps=4).fit(
            _lit(Stack(), log_loss=True), _loader(inputs(6)))
        with open(tmp_path / name / "version_0" / "metrics.csv") as fh:
            return list(csv.DictReader(fh))

    plain = metrics("plain", [])
    watched = metrics("watched", [LightningCallback(every=2, alarm_logit=None)])
    tag = "attnscale/logit_max/layer0"
    assert [(r["step"], r["loss"]) for r in watched if r.get("loss")] == \
        [(r["step"], r["loss"]) for r in plain if r.get("loss")]
    # recorded steps 1, 2, 4, 6 (global_step after each batch) at Lightning's own step of their
    # batch: the 4th batch's loss row is at step 3
    assert sorted(int(r["step"]) for r in watched if r.get(tag)) == [0, 1, 3, 5]
    assert [int(r["step"]) for r in plain if r.get("loss")] == [3]
