"""attnscale.hf and ``attnscale monitor``: tiny random Llama, Gemma 2 (soft-capped) and Qwen 2.

Everything is built in the test from configs; nothing is downloaded.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.kernels import native
from attnscale.errors import ConfigError
from attnscale.measure.monitor import monitor

hf.register()

SEQ = 20
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64,
              initializer_range=0.1)  # logits of a few units, so that the caps below bind


def make_config(family: str):
    if family == "llama":    # grouped-query attention, 2 query heads per key head
        return transformers.LlamaConfig(num_key_value_heads=2, **COMMON)
    if family == "gemma2":   # soft-cap, query_pre_attn_scalar != head_dim, a sliding layer
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=16,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
                                         final_logit_softcapping=None, sliding_window=8,
                                         **COMMON)
    if family == "qwen2":    # one key/value head for four query heads, q/k/v biases
        return transformers.Qwen2Config(num_key_value_heads=1, **COMMON)
    raise ValueError(family)


FAMILIES = ["llama", "gemma2", "qwen2"]


def make_model(family: str, attn: str = "attnscale", seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModel.from_config(make_config(family), attn_implementation=attn).eval()


def token_ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def head_means(attentions: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Entropy and max weight per (layer, head) from eager probabilities (L, B, H, N, N)."""
    p = torch.stack(attentions).double()
    entropy = -torch.special.xlogy(p, p).sum(-1)          # (L, B, H, N)
    return {"entropy_mean": entropy.mean((1, 3)), "max_weight_mean": p.amax(-1).mean((1, 3))}


# ---------------------------------------------------------------------------------------------
# Native temperature: the "attnscale" implementation equals eager

@pytest.mark.parametrize("family", FAMILIES)
def test_native_attnscale_matches_eager(family):
    ids = token_ids()
    padding = torch.ones_like(ids)
    padding[1, :6] = 0  # left padding in the second sequence: the boolean-mask path
    eager, ours = make_model(family, "eager"), make_model(family)
    with torch.no_grad():
        for mask in (None, padding):
            want = eager(ids, attention_mask=mask).last_hidden_state
            got = ours(ids, attention_mask=mask).last_hidden_state
            real = slice(None) if mask is None else mask.bool()  # padded queries are undefined
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_gemma2_softcap_is_the_models_own():
    layer = make_model("gemma2").layers[0].self_attn
    assert layer.config.attn_logit_softcapping == 1.0 and layer.scaling == 24 ** -0.5
    with torch.no_grad(), monitor(make_model("gemma2")) as mon:
        mon.model(token_ids())
    assert max(r["logit_absmax"] for r in mon.records) <= 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_monitor_entropies_match_eager_output_attentions(family):
    ids = token_ids()
    with torch.no_grad():
        want = head_means(make_model(family, "eager")(ids, output_attentions=True).attentions)
        model = make_model(family)
        with monitor(model, block=7) as mon:
            model(ids)
    n_layers, n_heads = want["entropy_mean"].shape
    assert len(mon.records) == n_layers * n_heads
    assert [r["module"] for r in mon.records[::n_heads]] == [
        f"layers.{i}.self_attn" for i in range(n_layers)]
    for key, table in want.items():
        got = torch.tensor([[r[key] for r in mon.records if r["layer"] == layer]
                            for layer in range(n_layers)], dtype=torch.float64)
        torch.testing.assert_close(got, table, atol=1e-5, rtol=1e-5, msg=key)


def test_monitor_leaves_hf_outputs_bit_identical_with_exact_outputs():
    model, ids = make_model("llama"), token_ids()
    with torch.no_grad():
        want = model(ids).last_hidden_state
        with monitor(model, exact_outputs=True):
            got = model(ids).last_hidden_state
        with monitor(model) as mon:  # the blockwise softmax kernel in SDPA's place
            fast = model(ids).last_hidden_state
    assert torch.equal(got, want)
    # float32 rounding of the attention, carried through two layers' residual stream
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
    assert mon.records


def test_from_pretrained_with_attnscale(tmp_path):
    make_model("qwen2", "eager").save_pretrained(tmp_path)
    model = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="attnscale")
    assert model.config._attn_implementation == "attnscale"
    with torch.no_grad():
        torch.testing.assert_close(model(token_ids()).last_hidden_state,
                                   make_model("qwen2", "eager")(token_ids()).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Swapping the temperature owner

def test_swapped_softcap_bounds_every_logit():
    model, ids, cap = make_model("llama"), token_ids(), 0.5
    with torch.no_grad():
        with monitor(model) as native:
            model(ids)
        assert max(r["logit_absmax"] for r in native.records) > cap  # the cap will bind
        changed = hf.set_mechanism(model, "softcap", cap=cap)
        with monitor(model) as capped:
            model(ids)
    assert changed == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(r["logit_absmax"] <= cap for r in capped.records)


def test_scaled_equals_llama_native_and_none_restores_it():
    model, ids = make_model("llama"), token_ids()
    with torch.no_grad():
        native = model(ids).last_hidden_state
        hf.set_mechanism(model, "scaled")  # Llama's own temperature is 1/sqrt(head_dim)
        torch.testing.assert_close(model(ids).last_hidden_state, native, atol=1e-6, rtol=1e-6)
        hf.set_mechanism(model, "unscaled")
        with pytest.raises(AssertionError):  # removing the 1/sqrt(d) changes the outputs
            torch.testing.assert_close(model(ids).last_hidden_state, native, atol=1e-3, rtol=0)
        hf.set_mechanism(model, None)
        assert not hasattr(model.layers[0].self_attn, hf.MECHANISM_ATTR)
        assert torch.equal(model(ids).last_hidden_state, native)


@pytest.mark.parametrize("name,param", [("qknorm", "g"), ("cosine", "tau"),
                                        ("qk-rmsnorm", "q_gain"), ("ssmax", "s")])
def test_swapped_parameters_train_and_save_with_the_model(name, param):
    model = make_model("gemma2")
    hf.set_mechanism(model, name)
    key = f"layers.1.self_attn.{hf.MECHANISM_ATTR}.{param}"
    assert key in model.state_dict()
    model.train()
    model(token_ids()).last_hidden_state.square().mean().backward()
    grad = model.get_parameter(key).grad
    assert grad is not None and bool(grad.abs().sum() > 0)
    with torch.no_grad():  # reload: build, set_mechanism, load_state_dict
        model.get_parameter(key).add_(0.25)
        twin = make_model("gemma2", seed=1)
        hf.set_mechanism(twin, name)
        twin.load_state_dict(model.state_dict())
        model.eval(), twin.eval()
        torch.testing.assert_close(twin(token_ids()).last_hidden_state,
                                   model(token_ids()).last_hidden_state)


def test_set_mechanism_switches_an_eager_model_to_attnscale():
    model = make_model("llama", "eager")
    hf.set_mechanism(model, "qk-layernorm")
    assert model.config._attn_implementation == "attnscale"
    with torch.no_grad(), monitor(model) as mon:
        model(token_ids())
    assert len(mon.records) == 2 * 4


@pytest.mark.parametrize("name,options,match", [
    ("qk_nrom", {}, "Did you mean: qknorm"),
    ("softcap", {"capp": 3.0}, "Unknown option 'capp'"),
    ("init-reparam", {}, "W_Q and W_K"),
    ("sigma-reparam", {}, "W_Q and W_K"),
])
def test_set_mechanism_rejects_with_a_clear_error(name, options, match):
    model = make_model("llama")
    with pytest.raises(ConfigError, match=match):
        hf.set_mechanism(model, name, **options)
    assert not hasattr(model.layers[0].self_attn, hf.MECHANISM_ATTR)


def test_check_swappable_builds_no_mechanism(monkeypatch):
    from attnscale.mechanisms import MECHANISMS

    built = []

    def spy(init):
        @functools.wraps(init)  # keeps the signature the option check reads
        def wrapped(self, *args, **kwargs):
            built.append(type(self).__name__)
            init(self, *args, **kwargs)
        return wrapped

    for cls in MECHANISMS.values():
        monkeypatch.setattr(cls, "__init__", spy(cls.__init__))
    hf.check_swappable("softcap", cap=5.0)
    hf.check_swappable("qknorm")
    assert built == []
    with pytest.raises(ConfigError, match=r"^name: Unknown option 'capp' for mechanism 'softcap'"):
        hf.check_swappable("softcap", capp=5.0)


def test_set_mechanism_with_a_bad_option_value_leaves_the_model_as_it_was():
    model = make_model("llama")
    hf.set_mechanism(model, "qknorm")
    before = model.layers[0].self_attn.attnscale_mechanism
    with pytest.raises(ConfigError, match="cap"):
        hf.set_mechanism(model, "softcap", cap=-1.0)
    assert model.layers[0].self_attn.attnscale_mechanism is before
    assert getattr(model.config, hf.MECHANISM_ATTR) == {"name": "qknorm", "options": {}}


def bloom():
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=2)
    return transformers.AutoModel.from_config(cfg)


def test_family_outside_the_attention_interface_is_refused():
    with pytest.raises(ConfigError, match="model family 'bloom'"):
        hf.set_mechanism(bloom(), "qknorm")


def test_attention_dropout_in_training_is_refused():
    cfg = make_config("llama")
    cfg.attention_dropout = 0.1
    model = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale").train()
    with pytest.raises(ConfigError, match="dropout"):
        model(token_ids())


# ---------------------------------------------------------------------------------------------
# attnscale monitor

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved tiny Llama without a tokenizer, one with a word-level tokenizer, and a Bloom."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    cfg = make_config("llama")
    for name in ("bare", "tokenized"):
        transformers.LlamaForCausalLM(cfg).save_pretrained(root / name)
    words = ["[UNK]", "attention", "without", "the", "scaling", "can", "work"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        root / "tokenized")
    bloom().save_pretrained(root / "bloom")
    return root


def test_cli_without_tokenizer_uses_random_ids(cli, model_dirs, tmp_path):
    out = tmp_path / "out"
    code, stdout, stderr = cli("monitor", str(model_dirs / "bare"), "--seq-len", "24",
                               "--out", str(out))
    assert code == 0, stderr
    assert "no tokenizer" in stderr and "random token ids" in stderr
    assert "layers.1.self_attn" in stdout and "entropy_mean" in stdout
    result = json.loads((out / "records.json").read_text())
    assert result["meta"]["input"] == "random" and result["meta"]["seq_len"] == 24
    assert result["meta"]["mechanism"] == "native"
    assert result["meta"]["statistics_kernel"] == (native.isa() or "pytorch")
    assert ("kernel is not installed" in stderr) != native.available()
    assert len(result["records"]) == 2 * 4
    assert all(r["queries"] == 24 for r in result["records"])
    assert (out / "entropy_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == [".attnscale-manifest.json",
                                                    "entropy_heatmap.png", "records.json"]


def test_cli_says_when_the_statistics_kernel_is_missing(cli, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    native.library.cache_clear()
    try:
        code, _, stderr = cli("monitor", str(model_dirs / "bare"), "--seq-len", "8",
                              "--out", str(tmp_path / "out"))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert code == 0, stderr
    assert "kernel is not installed" in stderr and "PyTorch" in stderr
    meta = json.loads((tmp_path / "out" / "records.json").read_text())["meta"]
    assert meta["statistics_kernel"] == "pytorch"


def test_cli_with_tokenizer_and_text(cli, model_dirs, tmp_path):
    text = tmp_path / "essay.txt"
    text.write_text("can attention work without the scaling " * 3, encoding="utf-8")
    out = tmp_path / "out"
    code, stdout, stderr = cli("monitor", str(model_dirs / "tokenized"), "--text", str(text),
                               "--seq-len", "16", "--mechanism", "qk-rmsnorm", "--out", str(out))
    assert code == 0, stderr
    assert "random" not in stderr
    meta = json.loads((out / "records.json").read_text())["meta"]
    assert meta == {**meta, "input": "text", "seq_len": 16, "mechanism": "qk-rmsnorm"}


def test_cli_writes_nothing_when_the_figure_fails(cli, model_dirs, tmp_path, monkeypatch):
    import attnscale.cli.monitor as command

    def broken(records, ax, **how):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(command, "plot_entropy", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="figure failed"):
        cli("monitor", str(model_dirs / "bare"), "--seq-len", "8", "--out", str(out))
    assert not out.exists()  # records.json was written, but only into the staging folder


@pytest.mark.parametrize("args,match", [
    (["{tmp}/missing"], "is not a directory"),
    (["{tmp}"], "has no config.json"),
    (["{bare}", "--mechanism", "qk_nrom"], "Did you mean: qknorm?"),
    (["{bare}", "--mechanism", "init-reparam"], "W_Q and W_K"),
    (["{bare}", "--text", "{tmp}/missing.txt"], "--text"),
    (["{bare}", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["{bloom}"], "model family 'bloom'"),
])
def test_cli_errors_are_one_line_and_exit_2(cli, model_dirs, tmp_path, args, match):
    argv = [a.format(tmp=tmp_path, bare=model_dirs / "bare", bloom=model_dirs / "bloom")
            for a in args]
    code, stdout, stderr = cli("monitor", *argv, "--out", str(tmp_path / "out"))
    assert code == 2
    assert match in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "records.json").exists()


def test_help_works_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from attnscale.cli import main\n"
            "try:\n    main(['monitor', '--help'])\nexcept SystemExit as e:\n"
            "    sys.exit(e.code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "MODEL_DIR" in done.stdout and "examples:" in done.stdout


# ---------------------------------------------------------------------------------------------
# Saving and reloading a swapped model

def _swapped_causal_lm(name: str = "qk-rmsnorm", **options):
    """A tiny Llama LM with ``name`` swapped in and its parameters moved off their init."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(make_config("llama")).eval()
    hf.set_mechanism(model, name, **options)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if hf.MECHANISM_ATTR in key:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("shards", ["one file", "sharded"])
def test_save_and_reload_a_swapped_model(tmp_path, shards):
    model = _swapped_causal_lm()
    kwargs = {"max_shard_size": "20KB"} if shards == "sharded" else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards == "sharded")
    assert hf.saved_mechanism(tmp_path) == {"name": "qk-rmsnorm", "options": {}}
    ids = token_ids()
    with torch.no_grad():
        want = model(ids).logits
        again = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
        # The base model loads from the LM's checkpoint (keys carry the "model." prefix there).
        base = hf.from_pretrained(transformers.AutoModel, tmp_path).eval()
        torch.testing.assert_close(base(ids).last_hidden_state, model.model(ids).last_hidden_state,
                                   rtol=0, atol=0)


def test_reload_keeps_mechanism_options_and_native_models_stay_native(tmp_path):
    model = _swapped_causal_lm("softcap", cap=0.5)
    model.save_pretrained(tmp_path / "capped")
    again = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "capped")
    assert again.model.layers[1].self_attn.attnscale_mechanism.cap == 0.5
    hf.set_mechanism(model, None)                    # removed: the config forgets it too
    model.save_pretrained(tmp_path / "native")
    assert hf.saved_mechanism(tmp_path / "native") is None
    native = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "native")
    assert not hasattr(native.model.layers[0].self_attn, hf.MECHANISM_ATTR)
    assert native.config._attn_implementation == hf.ATTN_IMPLEMENTATION


def test_reload_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="path"):
        hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "nowhere")
    # A config that records a mechanism whose tensors the weights do not hold.
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(make_config("llama")).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[hf.MECHANISM_ATTR] = {"name": "qk-rmsnorm", "options": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lack .* tensor"):
        hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    config[hf.MECHANISM_ATTR] = {"name": "qk-rmsnrom"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^attnscale_mechanism in .*config\.json': Unknown "
                                          r"mechanism 'qk-rmsnrom'\. Did you mean: qk-rmsnorm"):
        hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    with pytest.raises(ConfigError, match="attn_implementation"):
        hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, attn_implementation="sdpa")


def test_cli_monitors_a_saved_swapped_model_with_its_mechanism(cli, tmp_path):
    _swapped_causal_lm().save_pretrained(tmp_path / "model")
    code, _, stderr = cli("monitor", str(tmp_path / "model"), "--seq-len", "12",
                          "--out", str(tmp_path / "out"))
    assert code == 0, stderr
    assert json.loads((tmp_path / "out" / "records.json").read_text())["meta"]["mechanism"] \
        == "qk-rmsnorm"


def test_monitoring_an_eager_model_warns_with_a_hint():
    model = make_model("llama", "eager")
    with pytest.warns(RuntimeWarning, match="attn_implementation='eager'.*set_attn_implementation"):
        with torch.no_grad(), monitor(model) as mon:
            model(token_ids())
    assert mon.records == []
    model.set_attn_implementation("sdpa")  # the hint works: the SDPA tap sees every layer
    with torch.no_grad(), monitor(model) as mon:
        model(token_ids())
    assert len(mon.records) == 2 * 4
