"""attnscale.hf: clip-qkv clamps the q, k, v projection outputs (before q/k norms and RoPE, as
OLMo and DBRX do), and DiffLlama's two attention calls per layer.  Tiny random models built from
configs; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.families import facts
from attnscale.measure.monitor import monitor

hf.register()

VOCAB, SEQ, CLIP = 64, 10, 0.5
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=128, initializer_range=0.3)  # projections pass CLIP


def qwen3(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL)).eval()
    model.set_attn_implementation("attnscale")
    return model


def ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def projection_outputs(model) -> dict[str, torch.Tensor]:
    """The q, k, v projection outputs of layer 0 in one forward (hooks run in order, so these
    are after clip-qkv's clamp)."""
    attn, seen = model.model.layers[0].self_attn, {}
    handles = [getattr(attn, p).register_forward_hook(
        lambda m, i, out, p=p: seen.__setitem__(p, out)) for p in ("q_proj", "k_proj", "v_proj")]
    try:
        with torch.no_grad():
            model(ids())
    finally:
        for h in handles:
            h.remove()
    return seen


def test_clip_qkv_clamps_the_projection_outputs():
    model = qwen3()
    native = projection_outputs(model)
    assert all(float(out.abs().max()) > CLIP for out in native.values())  # the clamp binds
    hf.set_mechanism(model, "clip-qkv", clip=CLIP)
    for name, out in projection_outputs(model).items():
        torch.testing.assert_close(out, native[name].clamp(-CLIP, CLIP), msg=name)


@pytest.mark.parametrize("name,options,invariant", [
    ("clip-qkv", {"clip": CLIP}, True),
    ("qk-layernorm", {}, False),  # LayerNorm's mean over rotated coordinates: a negative control
])
def test_clip_qkv_logits_depend_on_relative_positions_only(name, options, invariant):
    model = qwen3()
    hf.set_mechanism(model, name, **options)
    x = ids()
    pos = torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        at0 = model(x, position_ids=pos).logits
        at3 = model(x, position_ids=pos + 3).logits
    if invariant:
        torch.testing.assert_close(at3, at0, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(at3, at0, atol=1e-3, rtol=0)


def test_clip_qkv_left_padded_generate_with_cache_equals_a_full_forward():
    model = qwen3()
    hf.set_mechanism(model, "clip-qkv", clip=CLIP)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding
    new = 5
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             use_cache=True, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones(2, new, dtype=mask.dtype)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        full = model(out.sequences, attention_mask=full_mask, position_ids=positions).logits
    stepped = torch.stack(out.logits, dim=1)              # (B, new, V): the cached steps
    torch.testing.assert_close(stepped, full[:, SEQ - 1:SEQ - 1 + new], atol=1e-4, rtol=1e-4)


def test_clip_qkv_hooks_go_with_the_mechanism_and_survive_a_reload(tmp_path):
    model = qwen3()
    attn = model.model.layers[0].self_attn
    hf.set_mechanism(model, "clip-qkv", clip=CLIP)
    assert attn.q_proj._forward_hooks
    hf.set_mechanism(model, "qknorm")
    assert not attn.q_proj._forward_hooks
    hf.set_mechanism(model, "clip-qkv", clip=CLIP)
    model.save_pretrained(tmp_path)
    again = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    assert again.model.layers[0].self_attn.q_proj._forward_hooks
    with torch.no_grad():
        torch.testing.assert_close(again(ids()).logits, model(ids()).logits, atol=0, rtol=0)


def test_a_copied_clip_qkv_model_clamps_once_and_unswaps_whole():
    # The clamp hooks travel with copy.deepcopy (an EMA copy, a pickled model): the copy clamps
    # the projections once, not again after RoPE, and removing the mechanism removes its hooks.
    import copy

    model = qwen3()
    hf.set_mechanism(model, "clip-qkv", clip=CLIP)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids()).logits, model(ids()).logits, atol=0, rtol=0)
    hf.set_mechanism(twin, None)
    assert not twin.model.layers[0].self_attn.q_proj._forward_hooks
    assert model.model.layers[0].self_attn.q_proj._forward_hooks  # the original keeps its own
    with torch.no_grad():
        torch.testing.assert_close(twin(ids()).logits, qwen3()(ids()).logits)


def test_clip_qkv_is_refused_on_latent_attention_with_the_reason():
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="attnscale")
    with pytest.raises(ConfigError, match="latent attention.*kv_b_proj") as err:
        hf.set_mechanism(model, "clip-qkv")
    assert "\n" not in str(err.value)
    assert not hasattr(model.layers[0].self_attn, hf.MECHANISM_ATTR)


# ---------------------------------------------------------------------------------------------
# DiffLlama: differential attention, two attention calls per layer sharing q and k


def diffllama(attn: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.DiffLlamaConfig(**SMALL)
    return transformers.AutoModel.from_config(cfg, attn_implementation=attn).eval()


def routes_through_the_interface() -> bool:
    """Whether the installed transformers' DiffLlama calls the AttentionInterface (early
    transformers 5 releases kept a class per implementation); if not, attnscale refuses it."""
    model = diffllama("eager")
    if hf.attention_layers(model):
        return True
    with pytest.raises(ConfigError, match="does not route attention through"):
        hf.set_mechanism(model, "scaled")
    return False


def test_diffllama_runs_exactly_and_each_of_its_two_calls_is_monitored():
    if not routes_through_the_interface():
        return
    x = ids()
    with torch.no_grad():
        want = diffllama("eager")(x).last_hidden_state
        model = diffllama("attnscale")
        with monitor(model) as mon:
            got = model(x).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert facts(model.layers[0].self_attn).calls == 2
    modules = list(dict.fromkeys(r["module"] for r in mon.records))
    assert modules == ["layers.0.self_attn", "layers.0.self_attn#1",
                       "layers.1.self_attn", "layers.1.self_attn#1"]
    first = [r for r in mon.records if r["module"] == "layers.0.self_attn"]
    second = [r for r in mon.records if r["module"] == "layers.0.self_attn#1"]
    for a, b in zip(first, second):  # the same q and k: the same softmax, twice
        assert a["entropy_mean"] == pytest.approx(b["entropy_mean"], rel=1e-9)


def test_diffllama_swap_changes_both_softmax_maps_of_every_layer():
    if not routes_through_the_interface():
        return
    model, x = diffllama("attnscale"), ids()
    with torch.no_grad():
        native = model(x).last_hidden_state
        assert hf.set_mechanism(model, "scaled") == ["layers.0.self_attn", "layers.1.self_attn"]
        torch.testing.assert_close(model(x).last_hidden_state, native, atol=1e-6, rtol=1e-6)
        hf.set_mechanism(model, "softcap", cap=0.5)
        with monitor(model) as mon:
            model(x)
    assert len({r["module"] for r in mon.records}) == 4
    assert all(r["logit_absmax"] <= 0.5 for r in mon.records)
