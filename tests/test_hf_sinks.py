"""attnscale.hf on gpt-oss (learned attention sinks, sliding-window layers) and under a KV cache.

Tiny random models built from configs; nothing is downloaded.  Llama runs in float64; gpt-oss in
float32 (its experts' grouped matmul has no float64 kernel), where 1e-5 is still far above the
rounding of these small logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from attnscale import hf
from attnscale.errors import ConfigError
from attnscale.measure.monitor import monitor
from attnscale.mechanisms import MECHANISMS

hf.register()

VOCAB, SEQ, WINDOW = 64, 12, 4
TOL = {"rtol": 1e-5, "atol": 1e-5}


def gpt_oss(attn: str, seed: int = 0) -> transformers.PreTrainedModel:
    """Two layers, a sliding (window 4 < SEQ) and a full one, with random (nonzero) sinks."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, sliding_window=WINDOW, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    model.set_attn_implementation(attn)
    return model


def batch(left_pad: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of two sequences; the second left-padded by ``left_pad``."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :left_pad] = 0
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip the left padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("left_pad", [0, 3], ids=["unpadded", "left-padded"])
def test_gpt_oss_on_attnscale_equals_eager_with_its_sinks(left_pad):
    eager, ours = gpt_oss("eager"), gpt_oss("attnscale")
    ids, mask = batch(left_pad)
    kw = {"attention_mask": mask, "position_ids": positions(mask)}
    with torch.no_grad():
        want, got = eager(ids, **kw).logits, ours(ids, **kw).logits
    keep = mask.bool()  # padded positions' outputs are not defined alike
    torch.testing.assert_close(got[keep], want[keep], **TOL)
    # The sinks are the model's parameters, not a copy: they train through the sink normaliser.
    ours.train()
    ours(ids, **kw).logits.square().mean().backward()
    assert all(bool(layer.self_attn.sinks.grad.abs().sum() > 0) for layer in ours.model.layers)


def test_gpt_oss_generation_with_a_kv_cache_equals_eager():
    eager, ours = gpt_oss("eager"), gpt_oss("attnscale")
    ids, mask = batch(left_pad=2)
    out = {}
    for name, model in (("eager", eager), ("attnscale", ours)):
        with torch.no_grad():
            out[name] = model.generate(ids, attention_mask=mask, max_new_tokens=6,
                                       do_sample=False, output_scores=True,
                                       return_dict_in_generate=True)
    assert torch.equal(out["attnscale"].sequences, out["eager"].sequences)
    assert out["eager"].sequences.shape[1] == SEQ + 6  # longer than the window, cache in use
    for got, want in zip(out["attnscale"].scores, out["eager"].scores):
        torch.testing.assert_close(got, want, **TOL)


def test_gpt_oss_sinks_under_a_swapped_softmax_mechanism_and_refusals():
    ours = gpt_oss("attnscale")
    eager = gpt_oss("eager")
    hf.set_mechanism(ours, "scaled")   # scaled is gpt-oss's own temperature: nothing changes
    ids, mask = batch()
    with torch.no_grad(), monitor(ours) as mon:
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, eager(ids, attention_mask=mask).logits, **TOL)
    # The monitor sees the sinks: every head leaves some weight on its sink.
    assert all(0.0 < r["sink_mass_mean"] < 1.0 for r in mon.records)
    for name in MECHANISMS:  # a mechanism with its own normaliser cannot take over the sinks
        if MECHANISMS[name].normaliser != "softmax" and MECHANISMS[name].defined_at_init:
            hf.set_mechanism(ours, name)
            with pytest.raises(ConfigError, match="normaliser"):
                ours(ids)
    with pytest.raises(ConfigError, match="layer's input"):
        hf.set_mechanism(ours, "gated")


def llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


# attnscale.hf refuses a mechanism that reads the layer input (gate, forget gates) or that needs
# every earlier query's selection (a KV cache does not keep it).
SWAPPABLE = [name for name, cls in MECHANISMS.items()
             if cls.defined_at_init and not cls.gate and cls.logit_bias is None]
# Options that make the length-dependent rules act at these lengths (their defaults start at
# thousands of keys).
BITING = {"logn": {"train_len": 4}, "llama4-temp": {"floor_scale": 4.0}}


@pytest.mark.parametrize("name", SWAPPABLE)
def test_decoding_with_a_cache_equals_the_full_forward(name):
    """The last token's logits: prefill then one cached step, against one forward without a cache,
    in a left-padded batch.  Length-dependent rules count the keys each query attends (padding
    excluded) in both, so they agree."""
    model = llama()
    hf.set_mechanism(model, name, **BITING.get(name, {}))
    ids, mask = batch(left_pad=3)
    pos = positions(mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1],
                      use_cache=True).past_key_values
        step = model(ids[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                     past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, **TOL)
    # Padding is not counted: the padded row equals the same tokens without the padding.
    with torch.no_grad():
        alone = model(ids[1:, 3:]).logits[:, -1]
    torch.testing.assert_close(full[1:], alone, **TOL)


@pytest.mark.parametrize("name,options", [("sink", {}), ("sigmoid", {"bias": -1.5}),
                                          ("logn", {"train_len": 4})])
def test_swapped_new_mechanisms_save_and_reload(tmp_path, name, options):
    model = llama()
    hf.set_mechanism(model, name, **options)
    with torch.no_grad():  # trained state that must come back (the sinks' b_h)
        for key, param in model.named_parameters():
            if hf.MECHANISM_ATTR in key:
                param.add_(0.5 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    ids, mask = batch(left_pad=2)
    again = hf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path,
                               dtype=torch.float64).eval()
    assert hf.saved_mechanism(tmp_path) == {"name": name, "options": options}
    with torch.no_grad():
        torch.testing.assert_close(again(ids, attention_mask=mask).logits,
                                   model(ids, attention_mask=mask).logits, rtol=0, atol=0)
