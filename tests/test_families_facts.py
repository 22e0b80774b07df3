"""attnscale.families: the family table's facts, read off tiny models built from configs."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from attnscale import hf

from attnscale.errors import ConfigError
from attnscale.families import FAMILIES, LayerFacts, QKNorm, facts, family_of, is_attention_layer

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64)


def first(model) -> LayerFacts:
    return next(iter(facts(model).values()))


def build(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config)


@pytest.mark.parametrize("config,over,gain", [
    (transformers.Qwen3Config(**SMALL), "head", "w"),
    (transformers.Olmo2Config(**SMALL), "model", "w"),
    (transformers.Gemma3TextConfig(**SMALL), "head", "1+w"),
    (transformers.LlamaConfig(**SMALL), "none", None),
])
def test_qk_norm_kind_and_its_registry_mechanism(config, over, gain):
    f = first(build(config))
    assert f.qk_norm_over == over
    if over == "none":
        assert f.qk_norm is None
        return
    assert f.qk_norm.gain == gain
    assert f.qk_norm.mechanism == ("qk-rmsnorm", {"over": over})


def test_heads_come_from_the_projections_not_the_config():
    cfg = transformers.LlamaConfig(**SMALL)
    model = build(cfg)
    cfg.num_attention_heads = 99  # a config that disagrees with the weights changes nothing
    f = first(model)
    assert (f.n_heads, f.n_kv_heads, f.d_head, f.d_value) == (4, 2, 8, 8)
    assert f.scaling == 8 ** -0.5 and f.scaling_rule == "d^-1/2"


def test_t5_relative_bias_and_unit_scale():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_heads=4)
    model = build(cfg)
    table = facts(model)
    if not table:  # early transformers 5 releases: T5 formed its softmax itself
        with pytest.raises(ConfigError, match="does not route attention through"):
            hf.set_mechanism(model, "qknorm")
        return
    assert len(table) == 3  # encoder self, decoder self and cross attention
    for f in table.values():
        assert f.layout == "separate" and (f.n_heads, f.d_head) == (4, 8)
        assert f.scaling == 1.0 and f.position_bias == "t5-relative"


def test_latent_attention_heads_and_mscale():
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64)
    f = first(build(cfg))
    assert (f.layout, f.n_heads, f.n_kv_heads, f.d_head, f.d_value) == ("latent", 4, 4, 12, 6)
    assert f.mscale == pytest.approx(1.0)  # no YaRN: the plain 1/sqrt(d)
    assert f.scaling == pytest.approx(1 / math.sqrt(12))


def test_sinks_window_and_softcap():
    oss = first(build(transformers.GptOssConfig(
        **{**SMALL, "num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 4,
           "layer_types": ["sliding_attention", "full_attention"]})))
    assert oss.sinks and oss.sliding_window == 4
    gemma2 = first(build(transformers.Gemma2Config(**SMALL, attn_logit_softcapping=30.0,
                                                   query_pre_attn_scalar=24)))
    assert gemma2.softcap == 30.0 and gemma2.scaling == 24 ** -0.5
    assert gemma2.scaling_rule == "query_pre_attn_scalar^-1/2"


def test_a_family_not_in_the_table_is_refused_naming_it():
    model = build(transformers.LlamaConfig(**SMALL))
    layer = model.layers[0].self_attn
    assert is_attention_layer(layer) and not is_attention_layer(model)
    layer.config = transformers.PretrainedConfig()
    layer.config.model_type = "not-a-family"
    with pytest.raises(ConfigError, match=r"'not-a-family', which is not in attnscale's family"):
        family_of(layer)


def test_table_values_are_from_their_vocabularies():
    from attnscale.families import MASK_KINDS, POSITION_BIASES, QK_NORM_KINDS, QK_NORM_OVER

    for name, row in FAMILIES.items():
        for r in (row, *row.by_class.values()):
            assert r.position_bias in (None, *POSITION_BIASES), name
            assert r.mask in MASK_KINDS, name
            if isinstance(r.qk_norm, QKNorm):
                assert r.qk_norm.over in QK_NORM_OVER and r.qk_norm.kind in QK_NORM_KINDS, name
                assert r.qk_norm.gain in (None, "w", "1+w"), name
