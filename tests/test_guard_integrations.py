"""The guard in a real ``transformers.Trainer`` and in Lightning, on tiny random models."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

import attnscale
from attnscale import MultiHeadAttention
from attnscale.errors import ConfigError
from attnscale.guard import read_log
from attnscale.hf import TemperatureCallback
from test_guard import BAD_OPTIONS, VOCAB, SEQ, make_hf, true_max_logits


def _data(n: int = 24, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, VOCAB, (n, SEQ), generator=g)]


def _trainer(model, tmp_path, callbacks, steps: int = 6, report_to=(), **options):
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
        "learning_rate": 0.05, "max_steps": steps, "logging_steps": 1000,
        "report_to": list(report_to), "save_strategy": "no", "use_cpu": True,
        "disable_tqdm": True, "lr_scheduler_type": "constant", "warmup_steps": 0, "seed": 0,
        "dataloader_drop_last": True, **options})
    return transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                callbacks=callbacks)


def _last_batch(model):
    """A forward pre-hook keeping the last training batch the model saw."""
    kept = {}

    def keep(module, args, kwargs):
        if module.training:
            kept["batch"] = {k: v for k, v in kwargs.items()
                             if k in ("input_ids", "labels", "attention_mask")}
    model.register_forward_pre_hook(keep, with_kwargs=True)
    return kept


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_trainer_with_strict_clip_bounds_every_head(family, tmp_path):
    tau = 3.0
    unclipped = make_hf(family)
    kept = _last_batch(unclipped)
    _trainer(unclipped, tmp_path, []).train()
    assert float(true_max_logits(unclipped, kept["batch"]).max()) > tau

    model = make_hf(family)
    kept = _last_batch(model)
    callback = TemperatureCallback(qk_clip=tau, strict=True, every=2, alarm_logit=None)
    trainer = _trainer(model, tmp_path, [], report_to=["tensorboard"], logging_steps=2)
    callback.add_to(trainer)
    trainer.train()
    assert float(true_max_logits(model, kept["batch"]).max()) <= tau * (1 + 1e-5)
    # the per-layer scalars join the Trainer's own log events
    logged = [h for h in trainer.state.log_history if "attnscale/logit_max/layer0" in h]
    assert [h["step"] for h in logged if "loss" in h] == [2, 4, 6]
    assert all("attnscale/entropy_mean_min/layer1" in h for h in logged)
    assert sorted({r["step"] for r in callback.guard.records}) == [1, 2, 4, 6]
    assert any(r["clip_gamma"] < 1 for r in callback.guard.records)
    # ... and so in the TensorBoard reporter's event file
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert any("attnscale/logit_max/layer0" in tag for tag in acc.Tags()["scalars"])


def test_add_to_puts_the_callback_ahead_of_the_trainers_own(tmp_path):
    from transformers.integrations import TensorBoardCallback

    trainer = _trainer(make_hf("llama"), tmp_path, [], report_to=["tensorboard"])
    before = list(trainer.callback_handler.callbacks)
    assert any(isinstance(c, TensorBoardCallback) for c in before)
    callback = TemperatureCallback()
    assert callback.add_to(trainer) is callback
    assert trainer.callback_handler.callbacks == [callback, *before]
    callback.add_to(trainer)  # twice: still once, still first
    assert trainer.callback_handler.callbacks == [callback, *before]
    late = TemperatureCallback()
    trainer.add_callback(late)  # the Trainer's own add_callback appends: after the reporters
    assert trainer.callback_handler.callbacks[-1] is late


def test_a_callback_behind_the_reporters_is_refused_when_training_begins(tmp_path):
    """Passed in callbacks=[...] with reporters, the scalars could not reach them: refused in
    one line naming add_to; without reporters it runs where it is."""
    callback = TemperatureCallback(every=1, alarm_logit=None)
    trainer = _trainer(make_hf("llama"), tmp_path, [callback], steps=2,
                       report_to=["tensorboard"])
    with pytest.raises(ConfigError, match=r"add_to\(trainer\)") as err:
        trainer.train()
    assert "\n" not in str(err.value) and "report_to=['tensorboard']" in str(err.value)
    assert callback.guard is None
    plain = TemperatureCallback(every=1, alarm_logit=None)
    trainer = _trainer(make_hf("llama"), tmp_path, [plain], steps=2, logging_steps=1)
    trainer.train()
    assert trainer.callback_handler.callbacks[0] is not plain  # not moved
    assert all("attnscale/logit_max/layer0" in h for h in trainer.state.log_history
               if "loss" in h)


def test_trainer_k2_mode_runs_and_the_guard_alone_changes_nothing(tmp_path):
    plain = make_hf("llama")
    _trainer(plain, tmp_path, []).train()
    watched = make_hf("llama")
    callback = TemperatureCallback(every=1, alarm_logit=None)
    trainer = _trainer(watched, tmp_path, [callback])
    trainer.train()
    for (name, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters()):
        assert torch.equal(a, b), name
    assert len(callback.guard.records) == 6 * 2 * 4


def test_trainer_stops_on_alarm(tmp_path):
    callback = TemperatureCallback(every=1, alarm_logit=0.5, on_alarm="stop")
    trainer = _trainer(make_hf("llama"), tmp_path, [callback], steps=20)
    trainer.train()
    assert callback.guard.should_stop
    assert trainer.state.global_step < 20


@pytest.mark.parametrize("option", ["model", "optimizer", "resume"])
def test_callback_refuses_what_the_trainer_supplies(option):
    with pytest.raises(TypeError, match=f"finds the {option} itself"):
        TemperatureCallback(**{option: None})


def _callbacks():
    from attnscale.lightning import TemperatureCallback as LightningCallback

    return [TemperatureCallback, LightningCallback]


@pytest.mark.parametrize("options, match",
                         [case for case in BAD_OPTIONS if "resume" not in case[0]])
def test_callbacks_refuse_a_bad_option_when_built_as_the_guard_does(options, match):
    """Every option is checked when the callback is built, not when training starts, with the
    guard's own one-line error."""
    with pytest.raises(ConfigError, match=match) as want:
        attnscale.guard(MultiHeadAttention(16, 2), **options)
    for callback in _callbacks():
        with pytest.raises(ConfigError) as got:
            callback(**options)
        assert str(got.value) == str(want.value), callback


def test_callbacks_refuse_an_unknown_option_with_a_suggestion():
    for callback in _callbacks():
        with pytest.raises(TypeError, match=r"unexpected option 'evry'\. Did you mean: every\?"):
            callback(evry=10)
    assert TemperatureCallback(qk_clip=100, every=5).options == {"qk_clip": 100, "every": 5}


def test_lightning_module_records(tmp_path):
    import lightning

    from attnscale import MultiHeadAttention
    from attnscale.lightning import TemperatureCallback as LightningCallback

    class Tiny(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(16, 32)
            self.attn = MultiHeadAttention(32, 4)
            self.head = torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.head(self.attn(self.embed(x), causal=True))

        def training_step(self, batch, index):
            (x,) = batch
            logits = self(x)[:, :-1]
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), x[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    x = torch.randint(0, 16, (32, 12), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    callback = LightningCallback(every=2, qk_clip=5.0, log=tmp_path / "guard.jsonl")
    trainer = lightning.Trainer(max_steps=6, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accelerator="cpu",
                                default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), loader)
    steps = sorted({r["step"] for r in callback.guard.records})
    assert steps == [1, 2, 4, 6]
    assert len(callback.guard.records) == 4 * 4  # steps x heads, one layer
    assert all(r["s_max"] is not None for r in callback.guard.records)
    assert len((tmp_path / "guard.jsonl").read_text().splitlines()) == 16


# ---------------------------------------------------------------------------------------------
# attnscale guard plot


@pytest.fixture(scope="module")
def guard_log(tmp_path_factory):
    from test_guard import batches, train

    log = tmp_path_factory.mktemp("guard") / "run.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(make_hf("llama"), batches(6), lr=0.05, every=2, log=log, alarm_logit=1.0)
    return log


def test_cli_plot_writes_a_figure(cli, guard_log, tmp_path):
    out = tmp_path / "fig.png"
    code, stdout, _ = cli("guard", "plot", str(guard_log), "--out", str(out))
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, _ = cli("guard", "plot", str(guard_log), "--out", str(out))  # ours: replaced
    assert code == 0


@pytest.mark.parametrize("make, extra, match", [
    (lambda p: None, [], "is not a file"),
    (lambda p: p.write_text("{not json\n"), [], "line 1 is not JSON"),
    (lambda p: p.write_text('{"step": 0}\n'), [], "line 1 is not a guard record"),
    (lambda p: p.write_text(""), [], "holds no guard records"),
])
def test_cli_plot_bad_logs_exit_2(cli, tmp_path, make, extra, match):
    log = tmp_path / "bad.jsonl"
    make(log)
    code, _, err = cli("guard", "plot", str(log), "--out", str(tmp_path / "f.png"), *extra)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "f.png").exists()


def test_cli_plot_leaves_a_torn_last_line_out_and_says_so_once(cli, guard_log, tmp_path):
    """What a killed run leaves: every record it wrote, then half a line."""
    torn = tmp_path / "torn.jsonl"
    text = guard_log.read_text()
    torn.write_text(text + text.splitlines()[0][:40])
    out = tmp_path / "fig.png"
    code, _, err = cli("guard", "plot", str(torn), "--out", str(out))
    assert code == 0 and out.read_bytes()[:4] == b"\x89PNG"
    assert len(err.strip().splitlines()) == 1 and "torn line" in err and "left out" in err
    with pytest.warns(RuntimeWarning, match="torn line"):
        assert len(read_log(torn)) == len(text.splitlines())
    whole = tmp_path / "whole.jsonl"  # a complete record lacking only its newline is a record
    whole.write_text(text.rstrip("\n"))
    assert len(read_log(whole)) == len(text.splitlines())


@pytest.mark.parametrize("field, value, match", [
    ("step", "x", "step must be an integer >= 0, got 'x'"),
    ("layer", None, "layer must be an integer >= 0, got None"),
    ("head", -1, "head must be an integer >= 0"),
    ("queries", True, "queries must be an integer"),
    ("logit_max", "big", "logit_max must be a number or null"),
    ("module", 3, "module must be a module name"),
    ("alarm", "fire", "alarm must be a comma-separated list"),
])
def test_cli_plot_refuses_a_malformed_value_naming_file_line_and_field(cli, guard_log, tmp_path,
                                                                        field, value, match):
    lines = guard_log.read_text().splitlines()
    row = json.loads(lines[2])
    row[field] = value
    lines[2] = json.dumps(row)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    code, _, err = cli("guard", "plot", str(bad), "--out", str(tmp_path / "f.png"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "bad.jsonl' line 3: " in err and match in err
    assert not (tmp_path / "f.png").exists()


def test_cli_plot_output_rules(cli, guard_log, tmp_path):
    code, _, err = cli("guard", "plot", str(guard_log), "--out", str(tmp_path / "f.txt"))
    assert code == 2 and "must end in one of" in err
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(b"user data")
    code, _, err = cli("guard", "plot", str(guard_log), "--out", str(theirs))
    assert code == 2 and "attnscale did not write it" in err
    assert theirs.read_bytes() == b"user data"
    code, _, err = cli("guard", "plot", str(guard_log), "--out", "")
    assert code == 2 and "must be a path" in err
    code, _, err = cli("guard", "plot", "", "--out", str(tmp_path / "g.png"))
    assert code == 2 and "log must be a path" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("guard", "plot", str(guard_log), str(guard_log), "--out",
                       str(tmp_path / "g.png"))
    assert code == 2 and "two logs are named" in err


def test_trainer_raise_on_alarm_detaches_the_guard(tmp_path):
    import torch.nn.functional as F

    from attnscale.guard import GuardAlarm

    sdpa = F.scaled_dot_product_attention
    callback = TemperatureCallback(every=1, alarm_logit=0.5, on_alarm="raise")
    with pytest.raises(GuardAlarm, match="max_logit"):
        _trainer(make_hf("llama"), tmp_path, [callback], steps=20).train()
    assert not callback.guard.active
    assert F.scaled_dot_product_attention is sdpa  # the SDPA tap is gone with it


def test_close_detaches_the_guard_after_a_training_run_that_raised(tmp_path):
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    callback = TemperatureCallback(every=1)
    trainer = _trainer(make_hf("llama"), tmp_path, [callback], steps=20)

    def broken(*args, **kwargs):
        raise RuntimeError("a data loader fails mid-run")

    seen = []
    original = callback.on_step_end

    def step_end(*args, **kwargs):  # the guard is attached by then; fail the next step
        seen.append(callback.guard.active)
        trainer.training_step = broken
        return original(*args, **kwargs)

    callback.on_step_end = step_end
    with pytest.raises(RuntimeError, match="data loader"):
        trainer.train()
    assert seen == [True] and callback.guard.active   # the Trainer said nothing
    callback.close()
    assert not callback.guard.active
    assert F.scaled_dot_product_attention is sdpa
    callback.close()  # idempotent
