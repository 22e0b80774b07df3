"""The extension study (``attnscale study extension``): a checkpoint past its trained context under
each temperature treatment.  A tiny Llama trained for a few hundred steps at context 16 stands in
for a pretrained checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from attnscale import sweep  # noqa: E402
from attnscale.errors import ConfigError  # noqa: E402
from attnscale.experiments import extend  # noqa: E402
from attnscale.mechanisms.yarn import yarn_m  # noqa: E402

# The tiny model's trained context L and its vocabulary of words.
TRAIN_LEN = 16
VOCAB = 24
STEPS = 200


def _words() -> list[str]:
    return ["[UNK]"] + [chr(97 + i) for i in range(VOCAB - 1)]


def _text(n_words: int, seed: int = 0) -> str:
    """Words in a pattern the model can learn: runs of an ascending cycle from random starts."""
    g = torch.Generator().manual_seed(seed)
    words, out = _words()[1:], []
    while len(out) < n_words:
        start = int(torch.randint(0, len(words), (1,), generator=g))
        out += [words[(start + i) % len(words)] for i in range(8)]
    return " ".join(out[:n_words])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama trained for STEPS steps at context TRAIN_LEN, saved with a word-level
    tokenizer, and a text file for it to read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    root = tmp_path_factory.mktemp("extend")
    words = _words()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TRAIN_LEN,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor(fast(_text(4000, seed=1))["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread, no team spin-waiting on a shared machine
    try:
        _train(model, opt, ids, g)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    (root / "text.txt").write_text(_text(2000, seed=2), encoding="utf-8")
    return root


def _train(model, opt, ids, g) -> None:
    for _ in range(STEPS):
        starts = torch.randint(0, len(ids) - TRAIN_LEN - 1, (16,), generator=g)
        batch = torch.stack([ids[s:s + TRAIN_LEN + 1] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _loaded(saved):
    model, tokenizer = extend.loaded(str(saved / "model"), "auto")
    return model, tokenizer


def _ids(saved, n: int, window: int = 0):
    _, tokenizer = _loaded(saved)
    return extend.window_ids(tokenizer, str(saved / "text.txt"), n, window, VOCAB)[0]


def _hf_losses(saved, ids, rope: dict | None):
    """Per-position losses of transformers' own eager Llama on the saved weights, with RoPE
    parameters ``rope`` (None: as saved)."""
    config = transformers.AutoConfig.from_pretrained(saved / "model")
    if rope is not None:
        config.rope_parameters = rope
        config.max_position_embeddings = ids.shape[1] - 1
    model = transformers.LlamaForCausalLM.from_pretrained(saved / "model", config=config,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits[0].float()
    return F.cross_entropy(logits, ids[0, 1:], reduction="none").double()


def test_the_tiny_model_learned_its_text(saved):
    model, _ = _loaded(saved)
    ids = _ids(saved, TRAIN_LEN)
    assert float(extend.position_losses(model, ids).mean()) < 0.5 * math.log(VOCAB)


@pytest.mark.parametrize("a", [None, 1.3])
def test_hf_yarn_enters_the_logits_as_transformers_yarn_does(saved, a):
    model, _ = _loaded(saved)
    ids = _ids(saved, 2 * TRAIN_LEN)
    text = extend.HF_YARN if a is None else f"{extend.HF_YARN}(attention_factor={a})"
    setting = extend.applied(model, extend.parse_treatment(text), 2.0, TRAIN_LEN)
    assert setting["attention_factor"] == pytest.approx(yarn_m(2.0) if a is None else a)
    rope = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0,
            "original_max_position_embeddings": TRAIN_LEN,
            **({} if a is None else {"attention_factor": a})}
    torch.testing.assert_close(extend.position_losses(model, ids),
                               _hf_losses(saved, ids, rope), rtol=1e-5, atol=1e-5)


def test_native_is_the_model_as_saved(saved):
    model, _ = _loaded(saved)
    ids = _ids(saved, 2 * TRAIN_LEN)
    assert extend.applied(model, extend.parse_treatment("native"), 2.0, TRAIN_LEN) == \
        {"rope_type": "default", "attention_factor": 1.0}
    torch.testing.assert_close(extend.position_losses(model, ids), _hf_losses(saved, ids, None),
                               rtol=1e-5, atol=1e-5)


def _rotary(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))


def test_each_treatment_changes_only_what_it_names(saved):
    ids = _ids(saved, 2 * TRAIN_LEN)
    runs = {}
    for text in ("hf-yarn", "hf-yarn(attention_factor=1.0)", "mscale", "logn", "llama4-temp",
                 "ssmax", "ssmax(s=0.43)"):
        model, _ = _loaded(saved)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        setting = extend.applied(model, extend.parse_treatment(text), 2.0, TRAIN_LEN)
        after = model.state_dict()
        for k, v in weights.items():  # the model's own weights never change
            torch.testing.assert_close(after[k], v, rtol=0, atol=0)
        runs[text] = (setting, _rotary(model), extend.position_losses(model, ids), model)
    yarn_default, yarn_1 = runs["hf-yarn"], runs["hf-yarn(attention_factor=1.0)"]
    for text, (setting, rotary, _, model) in runs.items():
        # one set of YaRN frequencies for every treatment; the attention factor is YaRN's alone
        torch.testing.assert_close(rotary.inv_freq, yarn_1[1].inv_freq, rtol=0, atol=0)
        assert rotary.attention_scaling == setting["attention_factor"]
        has = [hasattr(m, "attnscale_mechanism") for m in model.modules()
               if type(m).__name__.endswith("Attention")]
        assert all(has) if "mechanism" in setting else not any(has)
    assert runs["mscale"][0]["mechanism"]["options"] == {"factor": 2.0}
    # mscale(factor=s) at a = 1 is transformers' default YaRN factor, a² = (0.1 ln s + 1)²
    torch.testing.assert_close(runs["mscale"][2], yarn_default[2], rtol=1e-5, atol=1e-5)
    # logn (train_len = L) and llama4-temp (floor_scale = L) change nothing while a query sees
    # fewer than L keys (positions 0..L-2), and change the positions beyond
    for text in ("logn", "llama4-temp"):
        losses = runs[text][2]
        torch.testing.assert_close(losses[:TRAIN_LEN - 1], yarn_1[2][:TRAIN_LEN - 1],
                                   rtol=1e-6, atol=1e-6)
        assert not torch.allclose(losses[TRAIN_LEN:], yarn_1[2][TRAIN_LEN:])
    s_values = {float(m.s.detach().flatten()[0]) for m in runs["ssmax"][3].modules()
                if type(m).__name__ == "SSMax"}
    assert len(s_values) == 1 and s_values.pop() == pytest.approx(1 / math.log(TRAIN_LEN))
    assert runs["ssmax(s=0.43)"][0]["mechanism"]["s"] == 0.43


def _grid(saved):
    return {"treatment": ["native", "hf-yarn"]}, {
        "checkpoint": str(saved / "model"), "text": str(saved / "text.txt"), "factor": 2,
        "bucket": 8}


def test_the_sweep_resumes_after_an_interruption(saved, tmp_path):
    out = tmp_path / "s"
    grid, fixed = _grid(saved)
    first = sweep.run("extend", grid, out, fixed=fixed, workers=1, show_progress=False)
    assert first.complete and len(first.ok) == 2
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(lines[0] + lines[1][:40])   # died mid-record
    assert len(sweep.load(out).pending) == 1
    done = sweep.resume(out, workers=1, show_progress=False)
    assert done.complete and len(done.ok) == 2
    by = {r["config"]["treatment"]: r["result"] for r in done.ok}
    was = {r["config"]["treatment"]: r["result"] for r in first.ok}
    for t in by:  # the rerun trial measures what the interrupted one did
        assert by[t]["loss_by_bucket"] == was[t]["loss_by_bucket"]
        assert by[t]["tokens_blake2b"] == was[t]["tokens_blake2b"]
    assert by["native"]["train_len"] == TRAIN_LEN and by["native"]["length"] == 2 * TRAIN_LEN
    assert len(by["native"]["loss_by_bucket"]) == 2 * TRAIN_LEN // 8


def test_the_study_draws_its_page_from_the_store(cli, saved, tmp_path):
    out = tmp_path / "ext"
    code, _, err = cli("study", "extension", "--checkpoint", str(saved / "model"), "--text",
                       str(saved / "text.txt"), "--windows", "0,1", "--treatments",
                       "native,hf-yarn(attention_factor=1.0),hf-yarn,"
                       "hf-yarn(attention_factor=1.3),logn", "--out", str(out), "--workers", "1")
    assert code == 0, err
    summary = json.loads((out / "extension.json").read_text())
    assert summary["trials"] == 10
    (best,) = summary["best"]
    assert best["best"]["n"] == 2 and best["yarn"] == pytest.approx(yarn_m(2.0))
    fragment = (out / "fragment.md").read_text()
    assert "10 trials complete" in fragment and "YaRN's rule measured" in fragment
    # The cost line: the fastest forward with the load before it, and the median forward.
    records = [json.loads(line) for line in (out / "results.jsonl").open()]
    rows = [r["result"] for r in records]
    # The text named is the one the last window read (it spans every window's tokens).
    (source,) = {r["result"]["text_source"] for r in records if r["config"]["window"] == 1}
    assert f"({source})" in fragment
    fastest = min(rows, key=lambda r: r["forward_seconds"])
    median = sorted(r["forward_seconds"] for r in rows)[4:6]
    assert (f"took {fastest['forward_seconds']:.0f} s at best (load average "
            f"{fastest['loadavg_before'][0]:.1f} before it) and {sum(median) / 2:.0f} s in the "
            "median of 10") in fragment
    assert (out / "extension_loss.png").is_file() and (out / "extension_factor.png").is_file()
    code, _, err = cli("study", "extension", "--from", str(out))
    assert code == 0, err
    assert (out / "fragment.md").read_text() == fragment
    from attnscale.study.extend import page_section
    section = "\n".join(page_section(out))  # the results page's lines, from the store
    assert "[ext/fragment.md](ext/fragment.md)" in section and "10 of 10 trials complete" in section
    assert section.count("- **") == len(json.loads((out / "fragment.json").read_text())["claims"])


@pytest.mark.parametrize("args, message", [
    (["--factors", "1"], "factor must be > 1"),
    (["--factors", "2,2.0"], "more than once"),
    (["--windows", "-1"], "--windows must be >= 0"),
    (["--windows", "0,0"], "more than once"),
    (["--treatments", "hf-yarn(attention_factor=0)"], "attention_factor must be a positive"),
    (["--treatments", "hf-yarn(attention_factor=1.2),hf-yarn(attention_factor=12e-1)"],
     "more than once"),
    (["--treatments", "yarnn"], "unknown treatment 'yarnn'"),
    (["--treatments", "native(x=1)"], "native takes no options"),
    (["--train-len", "1"], "--train-len must be >= 2"),
])
def test_bad_input_is_one_line_and_exit_2(cli, saved, tmp_path, args, message):
    code, out, err = cli("study", "extension", "--checkpoint", str(saved / "model"), "--out",
                         str(tmp_path / "x"), *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_a_missing_checkpoint_is_refused(cli, tmp_path):
    code, _, err = cli("study", "extension", "--checkpoint", str(tmp_path / "none.gguf"),
                       "--out", str(tmp_path / "x"))
    assert code == 2 and "does not exist" in err


def test_bad_treatments_from_the_api():
    with pytest.raises(ConfigError, match="attention_factor.*more than once"):
        extend.parse_treatment("hf-yarn(attention_factor=1.1, attention_factor=1.2)")
    with pytest.raises(ConfigError, match="Unknown option 'cap'"):
        extend.parse_treatment("logn(cap=3)")
    assert extend.canonical_treatment("hf-yarn(attention_factor=12e-1)") == \
        "hf-yarn(attention_factor=1.2)"


@pytest.mark.parametrize("text", ["native", "hf-yarn", "logn", "ssmax"])
def test_the_long_forward_runs_on_the_causal_kernel_without_a_mask(saved, monkeypatch, text):
    """Every attention call reaches SDPA with is_causal and no mask (no (N, N) tensor beyond the
    one boolean causal view transformers asks for), with or without a mechanism."""
    import attnscale.pipeline as pipeline
    calls = []
    sdpa = pipeline.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    model, _ = _loaded(saved)
    extend.applied(model, extend.parse_treatment(text), 2.0, TRAIN_LEN)
    monkeypatch.setattr(pipeline.F, "scaled_dot_product_attention", spy)
    extend.position_losses(model, _ids(saved, 2 * TRAIN_LEN))
    assert len(calls) == model.config.num_hidden_layers
    assert all(mask is None and causal for mask, causal in calls)
