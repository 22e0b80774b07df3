"""The small LM's first-layer queries and keys at init, recomputed by hand for the tests that
check the LM's step-0 records: embed, LayerNorm, W_Q / W_K, then RoPE, on the batch the run draws
first."""

from __future__ import annotations

import torch

from attnscale.experiments.lm.data import load_corpus, sample_batch
from attnscale.experiments.lm.model import apply_rope, build_lm
from attnscale.rng import rng


def first_layer_qk(config, text_dir):
    """``(block, q, k)``: layer 0 of the LM ``config`` builds at its seed, and its RoPE'd
    queries and keys (B, H, N, d_head) on the run's first training batch, without gradients
    (without RoPE for a mechanism that encodes position itself, stick-breaking and FoX; FoX's log
    forget gates are ``block.attn.log_forget``, set here)."""
    model = build_lm(config.model_config(), seed=config.seed)
    x, _ = sample_batch(load_corpus(text_dir).train, config.batch_size, config.seq_len,
                        rng(config.seed, "lm-batches"))
    block = model.blocks[0]
    with torch.no_grad():
        h = block.ln_attn(model.embed(x))                                   # (B, N, d)
        b, n, d = h.shape
        heads = config.n_heads

        def split(t):
            return t.view(b, n, heads, d // heads).transpose(1, 2)          # (B, H, N, d_head)

        cos, sin = model.rope_cos[:n], model.rope_sin[:n]
        q, k = split(block.attn.w_q(h)), split(block.attn.w_k(h))
        if block.attn.uses_rope:  # not when the mechanism encodes position (stick-breaking, FoX)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        block.attn.log_forget = (block.attn.mechanism.forget_gates(h)
                                 if block.attn.mechanism.logit_bias == "forget" else None)
    return block, q, k
