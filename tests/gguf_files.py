"""Tiny GGUF files for the tests, written with the ``gguf`` package from a Hugging Face Llama's
weights, laid out as llama.cpp's converter lays them (``convert_hf_to_gguf.py``: tensor names
``blk.N.attn_q`` ..., q and k rows permuted for its rotary layout, float32 data).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Hugging Face Llama parameter names -> GGUF tensor names (llama.cpp's gguf-py tensor map).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary permutation of q's or k's rows (pairs (i, i + d/2) made adjacent)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(model, path: Path) -> Path:
    """Write the weights of a transformers ``LlamaModel`` or ``LlamaForCausalLM`` as a GGUF of
    architecture ``llama`` (no tokenizer in the file)."""
    import gguf

    config = model.config
    state = {k.removeprefix("model."): v.detach().to(torch.float32).numpy()
             for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    writer.add_tensor("token_embd.weight", state["embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        for hf_name, gguf_name in LAYER_NAMES.items():
            w = state[f"layers.{i}.{hf_name}"]
            if hf_name == "self_attn.q_proj.weight":
                w = _permute(w, heads)
            elif hf_name == "self_attn.k_proj.weight":
                w = _permute(w, kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["norm.weight"])
    if "lm_head.weight" in state:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
