"""The small LM (attnscale.experiments.lm): model, data, one training run, the study's analysis,
and the ``attnscale lm`` command's bad-input errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import attnscale
from attnscale.cli import main
from attnscale.errors import ConfigError
from attnscale.experiments.lm import data as lm_data
from attnscale.experiments.lm import study
from attnscale.study import launcher
from attnscale.study import lm as lm_study
from attnscale.study.fragment import fragment_files, write_fragment
from attnscale.experiments.lm.model import LMConfig, build_lm, rope_frequencies
from attnscale.experiments.lm.train import LMRunConfig, lr_factor, train_lm
from attnscale.mechanisms import MECHANISMS, register
from attnscale.mechanisms.base import Mechanism
from attnscale.pipeline import observe

SRC = Path(attnscale.__file__).parent


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test caches its token arrays under its own tmp folder."""
    monkeypatch.setenv("ATTNSCALE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny(text_dir: Path, **overrides) -> LMRunConfig:
    base = dict(d_model=16, n_layers=2, n_heads=2, seq_len=16, batch_size=4, steps=4,
                eval_windows=4, monitor_every=2, data=str(text_dir))
    return LMRunConfig(**{**base, **overrides})


# --- model ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_shapes_and_causality(mechanism):
    model = build_lm(LMConfig(d_model=16, n_heads=2, n_layers=2, max_seq_len=12,
                              mechanism=mechanism), seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 12), generator=gen)
    changed = x.clone()
    changed[:, 7:] = torch.randint(0, 256, (2, 5), generator=gen)
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert a.shape == (2, 12, 256)
    assert_close(a[:, :7], b[:, :7])                       # the past does not see the future
    with pytest.raises(AssertionError):                    # ... and the future is used
        assert_close(a[:, 7:], b[:, 7:], rtol=1e-5, atol=1e-8)


def test_longer_input_than_built_is_an_error():
    model = build_lm(LMConfig(d_model=16, n_heads=2, max_seq_len=8))
    with pytest.raises(ConfigError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_rope_scores_depend_on_relative_position_only():
    from attnscale.experiments.lm.model import apply_rope, rope_tables
    cos, sin = rope_tables(rope_frequencies(8), 32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, generator=gen, dtype=torch.float64)

    def at(x, pos):
        return apply_rope(x.view(1, 1, 1, 8), cos[pos:pos + 1].double(), sin[pos:pos + 1].double())

    score = [(at(q, i) * at(k, i - 2)).sum() for i in (2, 9, 31)]
    # The tables are float32 (as the model uses them): equal up to float32 rounding.
    assert_close(score[0], score[1], rtol=1e-5, atol=1e-6)
    assert_close(score[0], score[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # another offset gives another score
        assert_close((at(q, 4) * at(k, 0)).sum(), score[0], rtol=1e-5, atol=1e-8)


def test_rope_hook_extends_context():
    """set_rope swaps the frequencies and the context length (the length study's hook)."""
    model = build_lm(LMConfig(d_model=16, n_heads=2, max_seq_len=8)).eval()
    x = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(x)
        model.set_rope(rope_frequencies(8), 32)
        longer = model(torch.cat([x, x], dim=1))
        model.set_rope(rope_frequencies(8) / 4, 32)  # interpolated positions change the output
        interp = model(x)
    assert longer.shape == (1, 16, 256)
    assert_close(longer[:, :8], before)
    with pytest.raises(AssertionError):
        assert_close(interp, before, rtol=1e-5, atol=1e-8)


def test_loss_by_position_at_a_longer_context(text_dir):
    """The length study's use: extend RoPE past the built context, then loss at each position."""
    from attnscale.experiments.lm.train import evaluate, loss_by_position
    config = tiny(text_dir)
    model = build_lm(config.model_config())
    val = lm_data.load_corpus(text_dir).val
    short = lm_data.eval_windows(val, 4, 16)
    by_pos = loss_by_position(model, short, batch_size=4)
    assert by_pos.shape == (16,)
    assert by_pos.mean().item() == pytest.approx(evaluate(model, short, config))
    model.set_rope(rope_frequencies(8), 64)
    assert loss_by_position(model, lm_data.eval_windows(val, 4, 64), batch_size=2).shape == (64,)


def test_init_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a = build_lm(LMConfig(mechanism="sigma-reparam"), seed=3)
    b = build_lm(LMConfig(mechanism="sigma-reparam"), seed=3)
    c = build_lm(LMConfig(mechanism="sigma-reparam"), seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.embed.weight, c.embed.weight)


# --- data -----------------------------------------------------------------------------------------

def test_split_by_file_and_cache(text_dir, cache, monkeypatch):
    corpus = lm_data.load_corpus(text_dir)
    files = sorted(p for p in text_dir.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    assert corpus.bytes == total
    assert corpus.train.numel() + corpus.val.numel() == total + len(files)  # + one NUL per file
    assert corpus.val.numel() > 0 and corpus.train.numel() > 0
    val = bytes(corpus.val.tolist())
    held = [p for p in files if lm_data.is_validation(p.relative_to(text_dir).as_posix())]
    for p in held or files[-1:]:
        assert p.read_bytes() in val
    assert list(cache.glob("lm/*/meta.json")), "the token arrays are cached"
    monkeypatch.setattr(lm_data, "_build", lambda *a: pytest.fail("rebuilt despite the cache"))
    again = lm_data.load_corpus(text_dir)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)


def test_single_file_splits_by_bytes(text_dir):
    f = text_dir / "scaled.py"
    corpus = lm_data.load_corpus(f)
    text = f.read_bytes()
    assert bytes(corpus.train.tolist())[:-1] + bytes(corpus.val.tolist())[:-1] == text
    assert 0 < corpus.val.numel() < corpus.train.numel()


def test_stdlib_corpus_rule():
    """The default corpus: sorted .py files of the stdlib, no test folders, no site-packages."""
    root, files = lm_data.stdlib_files()
    rel = [p.relative_to(root) for p in files]
    assert rel == sorted(rel, key=lambda p: p.as_posix())
    assert all(p.suffix == ".py" for p in rel)
    assert all(lm_data.EXCLUDED_DIRS.isdisjoint(p.parts[:-1]) for p in rel)
    assert Path("argparse.py") in rel
    assert sum(p.stat().st_size for p in files) > 1_000_000


@pytest.mark.parametrize("kind", ["missing", "empty", "binary", "empty-folder", "binary-folder"])
def test_bad_data_paths(tmp_path, kind):
    path = tmp_path / "data"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "binary":
        path.write_bytes(b"\x89PNG\x00\x01\x02")
    elif kind == "empty-folder":
        path.mkdir()
    elif kind == "binary-folder":
        path.mkdir()
        (path / "a.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ConfigError, match="data"):
        lm_data.load_corpus(path)
    assert main(["lm", "--data", str(path), "--steps", "1"]) == 2


# --- training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mechanism", list(MECHANISMS))
def test_every_mechanism_trains(text_dir, mechanism):
    r = train_lm(tiny(text_dir, mechanism=mechanism))
    assert len(r["train_loss"]) == 4 and all(math.isfinite(x) for x in r["train_loss"])
    assert math.isfinite(r["final_val_loss"]) and math.isfinite(r["loss_init"])
    assert r["final_val_bpb"] == pytest.approx(r["final_val_loss"] / math.log(2))
    assert [row["step"] for row in r["trace"]] == [0, 2]
    assert all(len(row["attn_logit_max"]) == 2 for row in r["trace"])  # one entry per layer
    assert all(0 <= row["entropy_min"][i] <= row["entropy_mean"][i]
               for row in r["trace"] for i in range(2))
    assert r["config"]["mechanism"] == mechanism


def test_qk_clip_clips_after_each_step(text_dir):
    """qk-clip's hook runs in train_lm: with τ = 0.5 every head's max logit is pulled to about τ
    after the first step (the monitor reads each step's forward, before its update)."""
    r = train_lm(tiny(text_dir, mechanism="qk-clip", options={"tau": 0.5}, lr=1e-3, steps=4,
                      monitor_every=1))
    peaks = [max(row["attn_logit_max"]) for row in r["trace"]]
    assert peaks[0] > 1.0
    assert all(p < 1.0 for p in peaks[1:]), peaks


def test_deterministic_per_seed(text_dir):
    a, b = train_lm(tiny(text_dir, seed=1)), train_lm(tiny(text_dir, seed=1))
    c = train_lm(tiny(text_dir, seed=2))
    assert {k: v for k, v in a.items() if k != "timing"} == \
        {k: v for k, v in b.items() if k != "timing"}
    assert a["timing"]["tokens_per_second"] > 0
    assert a["train_loss"] != c["train_loss"]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_bf16_autocast(text_dir, mechanism):
    r = train_lm(tiny(text_dir, bf16=True, mechanism=mechanism, steps=2))
    assert all(math.isfinite(x) for x in r["train_loss"]) and math.isfinite(r["final_val_loss"])


def test_divergence_is_a_result(text_dir):
    r = train_lm(tiny(text_dir, lr=1e4, steps=6, monitor_every=1))
    assert r["diverged"] is True
    json.dumps(r, allow_nan=False)  # strict JSON: non-finite numbers became null


def test_schedule():
    """Linear warm-up over 5% of the steps, then cosine down to LR_MIN at the last step."""
    from attnscale.experiments.lm.train import LR_MIN
    steps = 100
    factors = [lr_factor(t, steps, 1e-2) for t in range(steps)]
    assert factors[0] == pytest.approx(1 / 5) and factors[4] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(LR_MIN / 1e-2)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


def test_rope_is_left_out_for_the_mechanisms_that_encode_position():
    # stick-breaking's weights favour the nearest keys and FoX's forget gates decay with
    # distance: each paper trains without a positional encoding, and so does the LM
    assert {name for name, cls in MECHANISMS.items() if cls.encodes_position} == {
        "stick-breaking", "forgetting"}
    for name in ("scaled", "stick-breaking", "forgetting", "softpick"):
        model = build_lm(LMConfig(d_model=16, n_heads=2, n_layers=2, max_seq_len=8,
                                  mechanism=name))
        assert [b.attn.uses_rope for b in model.blocks] == [
            not MECHANISMS[name].encodes_position] * 2
    # without RoPE a stick-breaking model's first layer sees the same q, k at every position
    model = build_lm(LMConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=8,
                              mechanism="stick-breaking")).eval()
    seen = []
    with observe(seen.append), torch.no_grad():
        model(torch.full((1, 4), 65))
    assert_close(seen[0].q[..., 0, :], seen[0].q[..., 3, :])


@pytest.mark.parametrize("mechanism", ["unscaled", "softcap", "qk-layernorm", "stick-breaking"])
def test_trace_logit_max_is_what_enters_the_softmax(text_dir, mechanism):
    """Step 0's max |attention logit| in layer 0, recomputed by hand from the same init and batch:
    embed, LayerNorm, W_Q / W_K, RoPE (none for stick-breaking, which encodes position itself),
    then the mechanism's logits over the causal keys."""
    from lm_reference import first_layer_qk
    config = tiny(text_dir, steps=1, monitor_every=1, mechanism=mechanism)
    r = train_lm(config)
    block, q, k = first_layer_qk(config, text_dir)
    n = q.shape[-2]
    with torch.no_grad():
        z = block.attn.mechanism.logits(q, k, torch.arange(1, n + 1).unsqueeze(-1))
        z = z.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), 0.0)
    assert r["trace"][0]["attn_logit_max"][0] == pytest.approx(float(z.abs().max()), rel=1e-5)


# --- study analysis -------------------------------------------------------------------------------

def test_lr_sensitivity_by_hand():
    # ℓ0 = 5; ℓ = 3, 2, NaN (diverged -> ℓ0), 6 (above init -> ℓ0); ℓ* = 2
    # E[min(ℓ, ℓ0) − ℓ*] = ((3-2) + (2-2) + (5-2) + (5-2)) / 4 = 1.75
    assert study.lr_sensitivity([3.0, 2.0, None, 6.0], 5.0) == pytest.approx(1.75)
    assert study.lr_sensitivity([3.0, 2.0, math.nan, 6.0], 5.0) == pytest.approx(1.75)
    assert study.lr_sensitivity([2.5, 2.5], 5.0) == 0.0
    assert study.lr_sensitivity([None, 7.0], 5.0) is None  # nothing learned: ℓ* undefined


def _record(mechanism, lr, seed, loss, peak, options=None, width=16):
    diverged = loss is None or loss > 5.0
    trace = [{"step": s, "output_logit_max": 1.0, "attn_logit_max": [peak * (s + 1) / 3, 1.0],
              "entropy_min": [1.0, 2.0], "entropy_mean": [2.0, 2.5]} for s in range(3)]
    return {"config": {"mechanism": mechanism, "options": options or {}, "lr": lr,
                       "d_model": width, "seed": seed, "n_layers": 2, "n_heads": 2,
                       "seq_len": 16, "steps": 3, "batch_size": 4},
            "loss_init": 5.0, "final_val_loss": loss, "diverged": diverged, "trace": trace}


def _synthetic() -> list[dict]:
    lrs = (1e-3, 1e-2, 1e-1)
    out = []
    for seed in (0, 1):
        d = 0.01 * seed
        out += [_record("scaled", lr, seed, loss, peak) for lr, loss, peak in
                zip(lrs, (2.5 + d, 2.0 + d, None), (5.0, 50.0, 500.0))]
        out += [_record("unscaled", lr, seed, loss, peak) for lr, loss, peak in
                zip(lrs, (2.4 + d, 4.9 + d, None), (20.0, 200.0, 900.0))]
        for opts in ({}, {"divisor": False}):
            out += [_record("qk-layernorm", lr, seed, loss, 5.0, opts) for lr, loss in
                    zip(lrs, (2.4 + d, 2.1 + d, 2.2 + d))]
    return out


def test_claims_on_a_constructed_study():
    records = _synthetic()
    rows = {r["mechanism"]: r for r in lm_study.sensitivity_rows(records)}
    # scaled, seed 0: ℓ* = 2.0, terms 0.5, 0, 3.0 -> 3.5 / 3
    assert rows["scaled"]["per_seed"][0] == pytest.approx(3.5 / 3)
    assert rows["scaled"]["min"] <= rows["scaled"]["mean"] <= rows["scaled"]["max"]
    verdicts = {c["claim"].split(" ")[0]: c for c in lm_study.claims(records)}
    assert verdicts["qk-layernorm"]["verdict"] == "agrees"
    assert verdicts["unscaled"]["verdict"] == "agrees"
    assert verdicts["softcap"]["verdict"] == "not run"
    by_text = {c["claim"]: c for c in lm_study.claims(records)}
    divisor = next(c for t, c in by_text.items() if "1/√d" in t)
    assert divisor["verdict"] == "agrees"  # identical losses: within noise
    grow = next(c for t, c in by_text.items() if "grows with LR" in t)
    lead = next(c for t, c in by_text.items() if "preceded" in t)
    assert grow["verdict"] == "agrees" and lead["verdict"] == "agrees"


def test_normalises_qk_is_measured():
    assert study.normalises_qk("qk-layernorm") and study.normalises_qk("cosine")
    assert not study.normalises_qk("scaled") and not study.normalises_qk("softcap")


def test_write_fragment(tmp_path):
    records = [{"config": {}, "result": r} for r in _synthetic()]
    files = write_fragment(tmp_path / "report", lm_study.STUDY,
                           lm_study.analyse({"lm": records}))
    assert set(files) == set(fragment_files(lm_study.STUDY))
    for path in files.values():
        assert Path(path).stat().st_size > 0
    md = Path(files["fragment.md"]).read_text()
    assert "qk-layernorm(divisor=False)" in md and "| claim |" in md
    fragment = json.loads(Path(files["fragment.json"]).read_text())
    assert set(fragment) == {"title", "claims"} and fragment["claims"]
    assert all(isinstance(c["agrees"], bool) and c["quantity"] for c in fragment["claims"])
    assert not list((tmp_path / "report").glob(".attnscale-staging-*"))


# --- bad input and the command line ---------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--seq-len", "64", "--max-seq-len", "32"], "max_seq_len"),
    (["--lr", "0"], "lr"),
    (["--lr=-1e-3"], "lr"),
    (["--width", "30", "--heads", "4"], "divisible"),
    (["--mechanism", "softcapp"], "Did you mean"),
    (["--width", "1000000", "--heads", "1000"], "GiB"),
    (["--mechanism", "softcap", "--option", "cpa=3"], "Unknown option"),
])
def test_cli_bad_input(text_dir, capsys, argv, match):
    assert main(["lm", "--data", str(text_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err


def test_an_lm_run_too_large_is_refused_by_the_one_memory_check(text_dir, monkeypatch):
    import attnscale.memory as memory
    config = LMRunConfig(data=str(text_dir), steps=1)
    assert config.validated() is config
    monkeypatch.setattr(memory, "physical_memory", lambda: 2 ** 20)   # a 1 MiB machine
    with pytest.raises(ConfigError, match=r"^this run \(width .* GiB of memory at once, more "
                                          r"than 50% of this machine's .*reduce the width"):
        config.validated()


def test_mechanism_missing_a_required_option(text_dir, capsys):
    @register("needs-option-test")
    class NeedsOption(Mechanism):
        def __init__(self, d_head: int, n_heads: int, *, tau: float):
            super().__init__(d_head, n_heads)
            self.tau = tau

        def prepare(self, q, k, n_keys):
            return q, k, self.tau

    try:
        assert main(["lm", "--data", str(text_dir), "--mechanism", "needs-option-test"]) == 2
        assert "tau" in capsys.readouterr().err
    finally:
        del MECHANISMS["needs-option-test"]


def test_cli_json_and_output(text_dir, tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["lm", "--data", str(text_dir), "--width", "16", "--heads", "2", "--seq-len", "16",
            "--batch-size", "4", "--steps", "2", "--eval-windows", "4", "--mechanism",
            "qk-layernorm", "--option", "divisor=false", "--json", "--output", str(out)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    run = printed["runs"][0]
    assert run["config"]["options"] == {"divisor": False} and run["config"]["steps"] == 2
    assert main(["lm", "--data", str(text_dir), "--output", str(tmp_path)]) == 2  # a folder


def test_variants_and_the_mechanisms_option():
    option = next(o for o in lm_study.STUDY.options if o.flag == "--mechanisms")
    given = "scaled,qk-layernorm(divisor=False),softcap(cap=30)"
    values = launcher.parse_option(lm_study.STUDY, option, given)
    # each in its canonical spelling: the one its records' options give (variant())
    assert values == ["scaled", "qk-layernorm(divisor=False)", "softcap(cap=30.0)"]
    assert study.variant({"config": {"mechanism": "softcap", "options": {"cap": 30.0}}}) \
        == values[2]
    assert study.variant({"config": {"mechanism": "qk-layernorm",
                                     "options": {"divisor": False}}}) == values[1]
    assert study.parse_variant("softcap(cap=30)") == ("softcap", {"cap": 30})
    for bad in ("scaled,scaled", "qk-layernorm(divisr=False)", "softcap(cap)"):
        with pytest.raises(ConfigError):
            launcher.parse_option(lm_study.STUDY, option, bad)


# --- the study on the sweep engine ----------------------------------------------------------------

def test_lm_trial_is_the_run_record(text_dir, tmp_path):
    """A sweep trial's result is train_lm's record without its timing, on any executor."""
    from attnscale import sweep
    from attnscale.experiments.lm.trial import run_config
    fixed = {"data": str(text_dir), "d_model": 16, "seq_len": 16, "batch_size": 4, "steps": 2,
             "eval_windows": 4}
    grid = {"variant": ["scaled", "qk-layernorm(divisor=False)"], "lr": [1e-3]}
    results = sweep.run("lm", grid, tmp_path / "s", fixed=fixed, workers=1, show_progress=False)
    assert len(results.ok) == 2
    for rec in results.ok:
        direct = train_lm(run_config(rec["config"]))
        direct.pop("timing")
        assert rec["result"] == direct
    assert results.ok[1]["result"]["config"]["options"] == {"divisor": False}


def test_study_lm_command(text_dir, tmp_path, capsys):
    out = tmp_path / "study"
    argv = ["study", "lm", "--out", str(out), "--data", str(text_dir), "--mechanisms",
            "scaled,qk-layernorm(divisor=False)", "--lrs", "1e-3,1e-2", "--widths", "16",
            "--seeds", "0", "--steps", "2", "--workers", "1", "--json"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {r["mechanism"] for r in printed["sensitivity"]} == {"scaled",
                                                                "qk-layernorm(divisor=False)"}
    for name in fragment_files(lm_study.STUDY):
        assert (out / name).is_file()
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4
    assert main(argv) == 0                      # the same grid again: continued, nothing re-run
    assert main(["study", "lm", "--resume", str(out)]) == 0
    assert (out / "results.jsonl").read_text().splitlines() == lines
    before = (out / "fragment.md").read_text()
    (out / "fragment.md").unlink()
    assert main(["study", "lm", "--from", str(out)]) == 0   # redrawn from the store
    assert (out / "fragment.md").read_text() == before


@pytest.mark.parametrize("argv, match", [
    (["--mechanisms", "scaled,scaled"], "more than once"),
    (["--mechanisms", "qk-layernorm(divisor=False),qk-layernorm(divisor=false)"],
     "--mechanisms lists 'qk-layernorm(divisor=False)' more than once"),
    (["--mechanisms", "softcap(cap=30),softcap(cap=3e1)"], "--mechanisms lists"),
    (["--mechanisms", "qk-layernorm(divisr=False)"], "Unknown option"),
    (["--lrs", "1e-3,0"], "lrs"),
    (["--widths", "16,16"], "more than once"),
    (["--from", "x"], "one of --out"),
])
def test_study_lm_bad_input(tmp_path, capsys, argv, match):
    assert main(["study", "lm", "--out", str(tmp_path / "s"), *argv]) == 2
    assert match in capsys.readouterr().err
