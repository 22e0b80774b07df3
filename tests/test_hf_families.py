"""The family sweep (attnscale.hf.survey) over every model type of the installed transformers:
outputs on ``"attnscale"`` equal eager's padded and unpadded, the monitor records every attention
call, swaps are whole or refused, strict QK-Clip is bounded or refused; the generated
docs/families.md is current; a deliberately wrong scale is caught; and every family this
integration once got wrong or refused, one by one.  Tiny random models built from configs;
nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.families import OWN_ATTENTION, facts
from attnscale.hf.survey import check_family, model_types, render

hf.register()

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
TYPES = model_types()


def documented() -> tuple[str, dict[str, list[str]]]:
    """(transformers version, {model type: cells}) of the committed docs/families.md."""
    text = DOC.read_text(encoding="utf-8")
    version = re.search(r"on transformers (\S+?);", text).group(1)
    rows = {}
    body = text.split("## Families that run", 1)[1]
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith("| model type"):
            continue
        cells = [c.strip().replace("\\|", "|")
                 for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 2 and not cells[0].isdigit():
            rows[cells[0]] = cells[1:]
    return version, rows


VERSION, ROWS = documented()
# The table's transformers: on another (an older admitted 5.x), a family the table runs may be
# missing, or not yet route its attention through the interface; there is then nothing for
# attnscale to serve, which these tests assert instead of the table's outcome.
REFERENCE = VERSION == transformers.__version__


def absent_here(result) -> bool:
    """Whether ``result`` is a family this (older) transformers lacks or keeps off the
    interface; never so on the table's own transformers."""
    if result.status != "not built":
        return False
    assert not REFERENCE, f"{result.model_type} was not built: {result.reason}"
    return True


def doc_cells(result) -> list[str]:
    """The cells docs/families.md gives ``result`` (as :func:`render` writes them)."""
    if result.status in ("exact", "wrong", "refused", "error"):
        return [c.replace("\n", " ") for c in result.row()[1:]]
    return [f"{result.status}: {result.reason}"]


@pytest.mark.parametrize("model_type", TYPES)
def test_family(model_type):
    r = check_family(model_type)
    assert r.status not in ("wrong", "error"), f"{model_type}: {r.reason}"
    if r.status == "exact":
        assert r.monitor == "all", r.monitor
        assert r.swap == "whole" or r.swap.startswith("refused: "), r.swap
        assert r.clip in ("bounded", "no positive logit") or r.clip.startswith("refused: "), \
            r.clip
        for reason in (r.swap, r.clip):
            assert "\n" not in reason
        # attention that forms its softmax itself is in the table, so swaps are never partial
        unknown = [c for c in r.extra["bypassing"] if c not in OWN_ATTENTION]
        assert not unknown, f"{model_type}: attention outside the interface: {unknown}"
    if REFERENCE:
        assert ROWS.get(model_type) == doc_cells(r), (
            f"docs/families.md is not current for {model_type}: regenerate it with "
            "python -m attnscale.hf.survey --out docs/families.md --force")


def test_docs_were_generated_with_the_installed_transformers():
    assert VERSION == transformers.__version__, (
        f"docs/families.md was generated on transformers {VERSION}, "
        f"{transformers.__version__} is installed: regenerate it")
    assert sorted(ROWS) == TYPES  # every model type has its row, no stale one


def test_render_lists_every_result_and_the_counts():
    results = [check_family(t, checks=()) for t in ("llama", "bloom", "not-a-model-type")]
    text = render(results)
    assert "| llama | exact |" in text
    assert "| bloom | not built: no attention layer goes through the AttentionInterface |" in text
    assert "| not-a-model-type | not built: config: KeyError" in text
    assert "| built and run on token ids | 1 |" in text


# ---------------------------------------------------------------------------------------------
# The negative control: the sweep flags a deliberately wrong temperature.

def _wrong_scale(module, query, key, value, attention_mask, scaling=None, **kwargs):
    scaling = (query.shape[-1] ** -0.5 if scaling is None else scaling) * 1.1  # 10% too hot
    return hf.attnscale_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, **kwargs)


@pytest.mark.parametrize("model_type", ["llama", "bert", "t5"])
def test_the_sweep_flags_a_wrong_scale(model_type):
    AttentionInterface.register("attnscale-wrong-scale", _wrong_scale)
    AttentionMaskInterface.register("attnscale-wrong-scale", hf.attnscale_mask)
    r = check_family(model_type, implementation="attnscale-wrong-scale", checks=())
    assert r.status == "wrong" and r.diff > 1e-3
    assert check_family(model_type, checks=()).status == "exact"


# ---------------------------------------------------------------------------------------------
# Families this integration once got wrong or refused, each by name.

# Encoders that were made causal when no mask was passed, and decoders whose causality lives in
# the mask their eager path builds (their layers say is_causal=False).
ONCE_WRONG = ["splinter", "align_text_model", "clap_text_model", "pegasus_x", "nllb-moe",
              "videoprism_text_model", "deepseek_v4", "bigbird_pegasus", "aimv2_text_model",
              "git"]
# Refused by the name of their head-size attribute: the BERT family (attention_head_size),
# multi-head latent attention (qk_head_dim), T5 (key_value_proj_dim), GPT-NeoX (head_size).
ONCE_REFUSED = ["bert", "roberta", "distilbert", "albert", "electra", "camembert",
                "xlm-roberta", "esm", "mobilebert", "layoutlm", "deepseek_v2", "deepseek_v3",
                "minicpm3", "kimi_linear", "glm4_moe_lite", "mistral4", "t5", "mt5", "umt5",
                "switch_transformers", "gpt_neox", "laguna"]


@pytest.mark.parametrize("model_type", ONCE_WRONG + ONCE_REFUSED)
def test_once_wrong_or_refused_families(model_type):
    r = check_family(model_type)
    if absent_here(r):
        return
    assert r.status == "exact", r.reason
    assert r.monitor == "all"
    if model_type in ONCE_REFUSED:
        assert r.swap == "whole"
        assert r.clip == "bounded"


@pytest.mark.parametrize("model_type,swap,clip", [
    ("bigbird_pegasus", "(BigBirdPegasusSelfAttention, and 1 more like it) forms its softmax",
     "(BigBirdPegasusSelfAttention) forms its softmax itself"),
    # LongT5 was refused by the name of its head size; its decoder is served now, and its
    # encoder's local attention, which forms its softmax itself, refuses swaps and clips.
    ("longt5", "(LongT5LocalAttention, and 1 more like it) forms its softmax",
     "(LongT5LocalAttention) forms its softmax itself"),
    ("git", "(GitSelfAttention, and 1 more like it) forms its softmax itself",
     "(GitSelfAttention) forms its softmax itself"),
    ("deepseek_v4", None, "reads its key as its value"),
])
def test_partial_swaps_and_clips_are_refused_with_the_reason(model_type, swap, clip):
    r = check_family(model_type)
    if absent_here(r) or (not REFERENCE and not r.extra.get("bypassing")):
        return  # an older transformers serves this family through the interface alone
    assert r.status == "exact", r.reason
    if swap is None:
        assert r.swap == "whole"
    else:
        assert r.swap.startswith("refused: ") and swap in r.swap
    assert r.clip.startswith("refused: ") and clip in r.clip


def test_inkling2_per_query_sinks_are_refused_not_ignored():
    r = check_family("inkling2_text")
    if absent_here(r):
        return
    assert r.status == "refused" and "per-query sink logits (sinks=" in r.reason


def test_laguna_layers_get_their_own_head_counts():
    """Laguna's layers have their own head counts (num_attention_heads_per_layer); the
    mechanism is built for the layer's, not config.num_attention_heads."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "laguna" not in CONFIG_MAPPING_NAMES:
        assert not REFERENCE
        return
    cfg = transformers.AutoConfig.for_model(
        "laguna", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_attention_heads_per_layer=[12, 4], layer_types=["full_attention"] * 2,
        mlp_layer_types=["dense", "dense"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale").eval()
    assert [f.n_heads for f in facts(model).values()] == [12, 4]
    hf.set_mechanism(model, "qknorm")
    assert [l.self_attn.attnscale_mechanism.n_heads for l in model.layers] == [12, 4]
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 10)))


def test_a_family_missing_from_the_table_is_refused_naming_the_layers():
    r = check_family("llama", checks=())
    assert r.status == "exact"
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale")
    model.config.model_type = "my-llama"  # one config object, shared by the layers
    with pytest.raises(ConfigError, match=r"cannot change 2 of 2 attention layers, so it changes "
                                          r"none: layers\.0\.self_attn: .*'my-llama'") as err:
        hf.set_mechanism(model, "qknorm")
    assert "\n" not in str(err.value)
    assert not hasattr(model.layers[0].self_attn, hf.MECHANISM_ATTR)
    with torch.no_grad():  # it still runs, exactly, and is monitored
        model(torch.randint(0, 64, (2, 10)))
