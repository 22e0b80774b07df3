"""attnscale inspect against hostile inputs, odd families and shared output folders: the facts it
states (the owner per family, lengths where saturation cannot be judged, a what-if that changes
nothing), the records it reads back (``--from``), the folders it writes (stale figures, another
command's files, a second writer) and Ctrl-C while the command line starts.  Tiny models built
from configs; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.hf import survey
from attnscale.inspect import inspect_model, redraw, write
from attnscale.inspect.owner import owner_sentence, whatif_choices
from attnscale.inspect.records import shortest_judged, uniform_max_weight
from attnscale.inspect.report import DRIFT, RECORDS, REPORT, WHATIF, writing
from attnscale.io import MANIFEST, exclusive
from attnscale.mechanisms import MECHANISMS
from attnscale.mechanisms.yarn import yarn_m
from children import sigint_default

hf.register()

SRC = str(Path(__file__).resolve().parents[1] / "src")
VOCAB, N = 96, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)
WINDOW = 8


def build(config, cls=transformers.AutoModel) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls.from_config(config, attn_implementation="attnscale").float().eval()


def ids(n: int = N, batch: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids below the top four (special tokens of the configs)."""
    return torch.randint(0, vocab - 4, (batch, n), generator=torch.Generator().manual_seed(1))


def llama(**extra) -> torch.nn.Module:
    return build(transformers.LlamaConfig(num_key_value_heads=2, **{**COMMON, **extra}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Llama saved without a tokenizer (random token ids)."""
    root = tmp_path_factory.mktemp("hardening") / "tiny"
    llama().save_pretrained(root)
    return root


# ---------------------------------------------------------------------------------------------
# Lengths where the saturation rule cannot fail


@pytest.mark.parametrize("n", [1, 2])
def test_a_length_where_every_head_is_saturated_by_construction_is_refused(n):
    with pytest.raises(ConfigError, match=r"^seq_len.*every head would count as saturated"):
        inspect_model(llama(), ids(n), init=False)


def test_the_shortest_judged_length_is_where_uniform_causal_attention_passes_the_rule():
    model = llama(initializer_range=1e-4)   # nearly uniform attention
    n = shortest_judged(0.75)
    result = inspect_model(model, ids(n), init=False)
    # uniform causal attention over n keys: row i puts 1/(i + 1) on each key
    floor = sum(1 / (i + 1) for i in range(n)) / n
    torch.testing.assert_close(uniform_max_weight(n), floor)
    assert floor < 0.75 <= uniform_max_weight(n - 1)
    assert result["summary"]["saturated_heads"] == 0, result["summary"]["saturated"]
    # a stricter threshold moves the shortest length on
    with pytest.raises(ConfigError, match="every head would count as saturated"):
        inspect_model(model, ids(n), init=False, saturated_weight=floor)


def test_a_window_of_one_key_cannot_be_judged_at_any_length():
    model = build(transformers.MistralConfig(num_key_value_heads=2, sliding_window=1, **COMMON))
    with pytest.raises(ConfigError, match="attend at most 1 key"):
        inspect_model(model, ids(), init=False)


def test_cli_refuses_a_length_too_short_to_judge_in_one_line(cli, saved, tmp_path):
    code, out, err = cli("inspect", str(saved), "--seq-len", "2", "--out", str(tmp_path / "r"))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--seq-len" in err and "saturated" in err
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------
# Owner facts, family by family


WINDOWED = {
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW,
                                                  **COMMON),
    "mixtral": lambda: transformers.MixtralConfig(num_key_value_heads=2, sliding_window=WINDOW,
                                                  num_local_experts=2, num_experts_per_tok=1,
                                                  **COMMON),
    "starcoder2": lambda: transformers.Starcoder2Config(num_key_value_heads=2,
                                                        sliding_window=WINDOW, **COMMON),
    "phi3": lambda: transformers.Phi3Config(num_key_value_heads=2, sliding_window=WINDOW,
                                            pad_token_id=VOCAB - 1, **COMMON),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], **COMMON),
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_a_sliding_window_is_reported_where_it_is_applied_and_bounds_the_keys(family):
    result = inspect_model(build(WINDOWED[family]()), ids(), init=False)
    windows = {row["layer"]: row["sliding_window"] for row in result["layers"]}
    keys = {r["layer"]: r["n_keys"] for r in result["records"]}
    full = {1} if family == "gemma3" else set()      # Gemma 3's second layer is a full one
    for layer, window in windows.items():
        assert window == (None if layer in full else WINDOW), (family, windows)
        assert keys[layer] == (N if layer in full else WINDOW), (family, keys)


def test_a_gainless_qk_norm_learns_nothing_and_one_layer_is_a_layer():
    model, _, _ = survey.build("llama4_text")
    model.set_attn_implementation("attnscale")
    result = inspect_model(model, ids(12), init=False)
    assert "learned gains" not in result["owner"]
    assert "without a gain" in result["owner"], result["owner"]
    rows = [{"layer": 0, "owner": "a", "mechanisms": ["scaled"]},
            {"layer": 1, "owner": "b", "mechanisms": ["scaled"]},
            {"layer": 2, "owner": "a", "mechanisms": ["scaled"]}]
    sentence = owner_sentence(rows, "llama")
    assert "in layers 0, 2" in sentence and "in layer 1 " in sentence, sentence
    assert "in layers 1 " not in sentence


def test_t5_cross_attention_carries_no_position_bias():
    model, _, _ = survey.build("t5")
    model.set_attn_implementation("attnscale")
    result = inspect_model(model, ids(12), init=False)
    biases = {row["module"]: row["position_bias"] for row in result["layers"]}
    cross = [m for m in biases if "EncDecAttention" in m]
    assert cross and all(biases[m] is None for m in cross), biases
    assert all(biases[m] == "t5-relative" for m in biases if m not in cross), biases


def test_diffllama_is_one_layer_per_module_owned_by_differential_attention():
    config = transformers.DiffLlamaConfig(num_key_value_heads=2, **COMMON)
    result = inspect_model(build(config), ids(), init=False)
    s = result["summary"]
    assert s["layers"] == COMMON["num_hidden_layers"]
    assert s["heads"] == COMMON["num_hidden_layers"] * COMMON["num_attention_heads"]
    assert all(row["mechanisms"] == ["differential"] for row in result["layers"])
    assert "`scaled`" not in result["owner"]


def test_a_head_resting_on_its_sink_is_not_saturated_and_entropy_stays_under_ln_n():
    config = transformers.GptOssConfig(
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    model = build(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.fill_(12.0)               # far above every logit: the sink takes the weight
    result = inspect_model(model, ids(), init=False)
    rows = result["records"]
    assert min(r["sink_mass_mean"] for r in rows) > 0.75     # the sink is the largest weight
    assert min(r["max_weight_mean"] for r in rows) > 0.75
    assert result["summary"]["saturated_heads"] == 0, result["summary"]["saturated"]
    assert max(r["entropy_ratio"] for r in rows) <= 1.0


def test_a_tower_the_input_does_not_run_is_named_not_measured():
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=32, mlp_ratio=2,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
        image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)
    torch.manual_seed(0)
    model = transformers.Qwen2VLModel._from_config(config, attn_implementation="attnscale").eval()
    result = inspect_model(model, ids(), init=False)
    assert "in every layer" not in result["owner"]
    assert "in all 2 attention layers this input ran" in result["owner"], result["owner"]
    assert "visual.blocks.0.attn" in result["owner"] and "not measured" in result["owner"]


def test_deepseek_yarn_states_mscale_squared():
    config = survey.tiny_config("deepseek_v3")
    factor, all_dim = 40.0, 1.0
    config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "yarn",
                              "factor": factor, "mscale_all_dim": all_dim, "mscale": all_dim,
                              "original_max_position_embeddings": 16, "beta_fast": 32,
                              "beta_slow": 1}
    result = inspect_model(build(config), ids(12, vocab=min(VOCAB, config.vocab_size)),
                           init=False)
    row = result["layers"][0]
    m, d = yarn_m(factor, all_dim), row["d_head"]
    torch.testing.assert_close(row["mscale"], m)
    torch.testing.assert_close(row["scale"], m * m / math.sqrt(d), rtol=1e-6, atol=0)
    assert row["scaling"].startswith("mscale^2/sqrt(d_head)"), row["scaling"]
    assert row["mechanisms"] == [f"mscale(factor={factor}, mscale_all_dim={all_dim})"]


# ---------------------------------------------------------------------------------------------
# Output folders


def test_a_figure_the_new_report_does_not_draw_is_removed(tmp_path):
    model, out = llama(), tmp_path / "r"
    write(inspect_model(model, ids(), whatif="yarn(factor=4)"), out)
    assert (out / DRIFT).is_file() and (out / WHATIF).is_file()
    write(inspect_model(model, ids(), init=False), out)
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert DRIFT not in names and WHATIF not in names and REPORT in names
    listed = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(listed) == names


def test_inspect_does_not_replace_a_file_another_command_wrote(cli, saved, tmp_path):
    out = tmp_path / "shared"
    code, _, err = cli("monitor", str(saved), "--seq-len", "16", "--out", str(out))
    assert code == 0, err
    before = (out / RECORDS).read_bytes()
    code, out_text, err = cli("inspect", str(saved), "--seq-len", "16", "--out", str(out))
    assert code == 2 and out_text == "" and err.count("\n") == 1, err
    assert "attnscale monitor" in err and "--force" in err
    assert (out / RECORDS).read_bytes() == before
    code, _, err = cli("inspect", str(saved), "--seq-len", "16", "--out", str(out), "--force")
    assert code == 0, err
    with pytest.raises(ConfigError, match="was written by attnscale inspect"):
        from attnscale.io import check_output_path
        check_output_path("out", out, kind="dir", files=[RECORDS], writer="attnscale monitor")


def test_a_second_writer_is_refused_before_anything_runs(cli, saved, tmp_path, monkeypatch):
    out = tmp_path / "busy"
    with exclusive(out):           # another attnscale process writing the folder
        code, text, err = cli("inspect", str(saved), "--seq-len", "16", "--out", str(out))
        assert code == 2 and text == "" and err.count("\n") == 1, err
        assert f"pid {os.getpid()}" in err and "--out" in err
        with pytest.raises(ConfigError, match="being written by another attnscale process"):
            write(inspect_model(llama(), ids(), init=False), out)
    assert not (out / REPORT).exists()
    with writing(out) as held:     # the holder itself writes through its own lock
        write(inspect_model(llama(), ids(), init=False), held)
    assert (out / REPORT).is_file()


# ---------------------------------------------------------------------------------------------
# --from reads records.json field by field


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "r"
    write(inspect_model(llama(), ids(), init=False), out)
    return out


def _edited(payload: dict, case: str) -> dict:
    p = copy.deepcopy(payload)
    r = p["records"]
    edits = {
        "no-records": lambda: p.update(records=[]),
        "record-without-layer": lambda: r[3].pop("layer"),
        "meta-null": lambda: p.update(meta=None),
        "summary-empty": lambda: p.update(summary={}),
        "string-nan": lambda: r[2].update(logit_std="NaN"),
        "negative-head": lambda: r[1].update(head=-1),
        "huge-layer": lambda: r[0].update(layer=10 ** 9),
        "bool-layer": lambda: r[0].update(layer=True),
        "repeated-head": lambda: r[1].update(head=r[0]["head"], layer=r[0]["layer"]),
        "owner-rows-not-a-list": lambda: p.update(layers={"layer": 0}),
        "mechanisms-a-string": lambda: p["layers"][0].update(mechanisms="scaled"),
        "threshold-out-of-range": lambda: p["summary"]["thresholds"].update(max_weight=3),
        "records-a-dict": lambda: p.update(records={"0": r[0]}),
        "not-an-object": lambda: p.clear() or p.update(x=1),
        "seq-len-text": lambda: p["meta"].update(seq_len="24"),
        "unknown-whatif": lambda: p["meta"].update(whatif="yarn(fctor=2)"),
    }
    edits[case]()
    return p if case != "not-an-object" else [1, 2]


FROM_CASES = {
    "no-records": "records is empty",
    "record-without-layer": "records[3] lacks 'layer'",
    "meta-null": "meta must be a dict",
    "summary-empty": "summary.thresholds must be an object",
    "string-nan": 'records[2].logit_std must be a finite number or null, got "NaN"',
    "negative-head": "records[1].head must be an integer >= 0, got -1",
    "huge-layer": "records hold layer 1000000000 but skip layer 2",
    "bool-layer": "records[0].layer must be an integer >= 0, got true",
    "repeated-head": "records[1] repeats layer 0 head 0",
    "owner-rows-not-a-list": "layers must be a list",
    "mechanisms-a-string": "layers[0].mechanisms must be a list of strings",
    "threshold-out-of-range": "summary.thresholds.max_weight must be in (0, 1)",
    "records-a-dict": "records must be a list",
    "not-an-object": "the file holds list, not an object",
    "seq-len-text": 'meta.seq_len must be an integer >= 1, got "24"',
    "unknown-whatif": "meta.whatif: Unknown option 'fctor' for mechanism 'yarn'",
}


@pytest.mark.parametrize("case", sorted(FROM_CASES))
def test_from_names_the_first_bad_field_of_an_edited_store(report, tmp_path, case):
    out = tmp_path / "edited"
    out.mkdir()
    payload = json.loads((report / RECORDS).read_text())
    (out / RECORDS).write_text(json.dumps(_edited(payload, case)))
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        redraw(out, force=True)
    assert time.monotonic() - start < 10     # no figure sized by an index the records lack
    assert FROM_CASES[case] in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert str(out / RECORDS) in str(err.value)


def test_from_on_the_command_line_is_one_line_with_exit_2(cli, report, tmp_path):
    out = tmp_path / "edited"
    out.mkdir()
    payload = json.loads((report / RECORDS).read_text())
    payload["records"][0]["entropy_ratio"] = "high"
    (out / RECORDS).write_text(json.dumps(payload))
    code, text, err = cli("inspect", "--from", str(out), "--force")
    assert code == 2 and text == "" and err.count("\n") == 1, err
    assert "records[0].entropy_ratio" in err and "Traceback" not in err


def test_an_unedited_store_redraws_as_written(report):
    before = (report / REPORT).read_bytes()
    redraw(report)
    assert (report / REPORT).read_bytes() == before


# ---------------------------------------------------------------------------------------------
# The what-if


IDENTITY_AT_N = ["yarn", "mscale", "logn", "llama4-temp", "learned-temp"]


@pytest.mark.parametrize("spec", IDENTITY_AT_N)
def test_a_whatif_that_is_the_identity_at_this_length_says_so(spec):
    result = inspect_model(llama(), ids(), init=False, whatif=spec)
    rows = result["records"]
    gaps = [abs(r["whatif_logit_std"] / r["logit_std"] - 1) for r in rows]
    assert max(gaps) < 1e-5                  # the tables equal the checkpoint's
    from attnscale.inspect.report import render, verdict
    said = verdict(result)[-1]
    assert f"the what-if `{spec}`" in said and "plain scale 1/√d" in said, said
    assert "its numbers are the checkpoint's" in said
    assert said in render(result)


def test_a_whatif_that_acts_at_this_length_says_nothing_of_the_kind():
    result = inspect_model(llama(), ids(), init=False, whatif="logn(train_len=4)")
    from attnscale.inspect.report import render
    assert "plain scale 1/√d" not in render(result)
    assert max(abs(r["whatif_logit_std"] / r["logit_std"] - 1) for r in result["records"]) > 0.1


def test_cli_takes_a_whatif_with_options_as_the_report_spells_it(cli, saved, tmp_path):
    code, _, err = cli("inspect", str(saved), "--seq-len", "16", "--no-init", "--out",
                       str(tmp_path / "r"), "--mechanism", "qk-rmsnorm(over=head)")
    assert code == 0, err
    meta = json.loads((tmp_path / "r" / RECORDS).read_text())["meta"]
    assert meta["whatif"] == "qk-rmsnorm(over=head)"
    assert "--mechanism 'qk-rmsnorm(over=head)'" in (tmp_path / "r" / REPORT).read_text()


@pytest.mark.parametrize("spec, fragment", [
    ("gated", "gates the attention output"),
    ("differential", "learns λ vectors"),
    ("sigma-reparam", "acts on the W_Q and W_K weights"),
    ("qk-rmsnrm", "Unknown mechanism 'qk-rmsnrm'. Did you mean: qk-rmsnorm?"),
    ("yarn(fctor=2)", "Unknown option 'fctor'"),
    ("yarn(factor=-1)", "factor must be > 0"),
    ("yarn(factor=2", "must look like name(key=value, ...)"),
])
def test_cli_whatif_errors_are_one_line_before_any_load(cli, saved, tmp_path, spec, fragment):
    code, text, err = cli("inspect", str(saved), "--out", str(tmp_path / "r"), "--mechanism",
                          spec)
    assert code == 2 and text == "" and err.count("\n") == 1, err
    assert err.startswith("attnscale inspect: error: --mechanism") and fragment in err, err
    assert not (tmp_path / "r").exists()


def test_the_choices_are_what_a_whatif_can_run():
    choices = whatif_choices()
    refused = {"gated", "forgetting", "selective", "differential", "init-reparam",
               "sigma-reparam"} & set(MECHANISMS)
    assert refused and not refused & set(choices)
    with pytest.raises(ConfigError) as err:
        from attnscale.inspect.owner import parse_whatif
        parse_whatif("nothing-like-it", param="--mechanism")
    listed = str(err.value).split("Choices: ")[1].rstrip(".").split(", ")
    assert listed == list(choices)
    model = llama()
    for name in choices:                      # each runs on a model
        result = inspect_model(model, ids(8), init=False, whatif=name)
        assert all(r["whatif_logit_std"] is not None for r in result["records"]), name


def _state(model: torch.nn.Module) -> dict:
    return {"config": model.config.to_dict(),
            "attn": [(n, getattr(m.config, "_attn_implementation", None))
                     for n, m in model.named_modules() if hasattr(m, "config")],
            "hooks": [(n, len(m._forward_pre_hooks), len(m._forward_hooks))
                      for n, m in model.named_modules()],
            "modules": [(n, id(m)) for n, m in model.named_modules()],
            "params": [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()]}


def _assert_same(a: dict, b: dict) -> None:
    assert a["config"] == b["config"] and a["attn"] == b["attn"]
    assert a["hooks"] == b["hooks"] and a["modules"] == b["modules"]
    assert [(n, i) for n, i, _ in a["params"]] == [(n, i) for n, i, _ in b["params"]]
    for (_, _, x), (_, _, y) in zip(a["params"], b["params"]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("held", [None, "softcap(cap=5.0)"])
def test_a_whatif_leaves_the_callers_model_as_it_was(held):
    model = llama()
    if held is not None:                  # a model holding a mechanism of its own
        hf.set_mechanism(model, "softcap", cap=5.0)
    before = _state(model)
    inspect_model(model, ids(), init=False, whatif="qk-rmsnorm")
    _assert_same(before, _state(model))


# ---------------------------------------------------------------------------------------------
# Ctrl-C while the command line starts


INTERRUPTED_START = """
import importlib.abc, sys, time
from attnscale.cli import COMMAND_MODULES, main

class Pause(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == COMMAND_MODULES[0]:   # the parser imports its first command
            print("importing", flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, Pause())
sys.exit(main(["--help"]))
"""


def test_ctrl_c_while_the_parser_imports_the_commands_is_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_START], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=sigint_default, start_new_session=True)
    try:
        assert proc.stdout.readline() == "importing\n"
        os.killpg(proc.pid, signal.SIGINT)   # as a terminal's Ctrl-C: the whole group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err == "attnscale: interrupted\n" and out == ""
