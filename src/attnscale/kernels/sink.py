"""Softmax with a per-head attention sink on ``scaled_dot_product_attention``, without the
(B, H, Nq, Nk) logits.

The sink normaliser is p_i = e^{z_i} / (e^{b_h} + Σ_j e^{z_j}): one more logit per row, b_h, whose
key carries no value (gpt-oss; HF transformers ``modeling_gpt_oss.py`` concatenates the sinks to
the logits and drops their column after the softmax).  That is ordinary softmax attention over one
extra key whose value is zero and whose logit is b_h for every query.  SDPA adds an additive mask
after the scale, so a per-head bias on that column would need an (H, Nq, Nk + 1) float mask, as
large as the logits; instead the bias rides on one extra coordinate of q and k::

    q' = [scale · q, b_h - o, 0...]      k'_j = [k_j, 0, 0...]      k'_sink = [0, 1, 0...]

so q'·k'_j = scale · q·k_j and q'·k'_sink = b_h - o (o: a per-row logit offset, which the softmax
over the real keys alone would cancel but the sink does not).  The head size is padded to a
multiple of 8, which the fused CUDA kernels require; extra memory is O(N · d), and the gradient
reaches b_h through q'.  A row whose keys are all masked attends only the sink: zero output.

On the CPU (without an offset) a wider head would send SDPA to its materialising math backend, so
the sink key goes first and its bias b_h rides on an additive mask: (1, H, 1, Nk + 1) without a
user mask, which broadcasts over the queries; with one, head by head, each head's (B|1, 1, Nq,
Nk + 1) mask.  Causality stays the kernel's own, with one dummy query row in front so that query
i sees the sink and keys 0..i.  That path calls the CPU
flash-attention op directly (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
backward), which also returns each row's log-sum-exp: the gradient of b_h is
-Σ_rows p_sink (dO·o), p_sink = e^{b_h - lse}, since the sink's value is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.precision import work_dtype

# SDPA's fused CUDA kernels need the head size to be a multiple of 8.
HEAD_MULTIPLE = 8


# The CPU flash-attention op and its backward (None where this torch lacks them).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _flash_fits(q: Tensor, k: Tensor, v: Tensor, offset: float | Tensor) -> bool:
    """Whether the sink can run on the CPU flash op with a bias mask (see the module doc): no
    offset, one head size for q, k and v, at least one query and one key."""
    return (not isinstance(offset, Tensor) and offset == 0.0
            and q.shape[-1] == v.shape[-1] and q.shape[-2] > 0 and k.shape[-2] > 0
            and q.device.type == "cpu" and _CPU_FLASH is not None
            and _CPU_FLASH_BACKWARD is not None and type(q) is torch.Tensor
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def _base_mask(mask: Tensor | None, h: int, n_k: int, dtype: torch.dtype,
               device: torch.device) -> Tensor:
    """The additive mask with the sink column first: 0 on attended keys, -inf on masked ones, the
    sink column filled per call by :func:`_with_sink`.  (1, H, 1, Nk + 1) without a mask;
    (B|1, Hm, Nq|1, Nk + 1) with one, in the mask's own shape (Hm = 1 or H), never expanded."""
    if mask is None:
        return torch.zeros(1, h, 1, n_k + 1, dtype=dtype, device=device)
    keys = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
    return torch.cat([keys.new_zeros(*keys.shape[:-1], 1), keys], dim=-1)


def _with_sink(base: Tensor, sink: Tensor, heads: slice) -> Tensor:
    """``base`` for ``heads``, with their sink logits b_h in its first column (in place)."""
    bias = base[:, heads] if base.shape[1] > 1 else base
    bias[..., 0] = sink.detach().to(base.dtype)[heads].view(1, -1, 1)
    return bias


class _SinkFlashCPU(torch.autograd.Function):
    """softmax([b_h, scale q kᵀ]) [0, v] on the CPU flash op: the sink key first, its bias on an
    additive mask, one dummy query in front under causality.  Without a mask all heads run in
    one call on a (1, H, 1, Nk + 1) bias; with one, head by head on that head's (B|1, 1, Nq, Nk+1)
    bias, so no (B, H, Nq, Nk) mask is formed either."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink: Tensor, mask: Tensor | None,
                scale: float, causal: bool) -> Tensor:
        b, h, _, d = q.shape
        k2 = torch.cat([k.new_zeros(b, h, 1, d), k], dim=-2)                # (B, H, Nk + 1, d)
        v2 = torch.cat([v.new_zeros(b, h, 1, v.shape[-1]), v], dim=-2)      # sink value 0
        q2 = torch.cat([q.new_zeros(b, h, 1, d), q], dim=-2) if causal else q
        if mask is not None:
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        base = _base_mask(mask, h, k.shape[-2], q.dtype, q.device)
        out, lse = _SinkFlashCPU._run(q2, k2, v2, sink, base, mask is None, scale, causal)
        ctx.save_for_backward(q2, k2, v2, out, lse, sink, base)
        ctx.all_heads = mask is None
        ctx.args = (scale, causal)
        return out[:, :, 1:] if causal else out

    @staticmethod
    def _heads(h: int, all_heads: bool) -> list[slice]:
        """All heads in one call on the broadcast bias; else one by one."""
        return [slice(0, h)] if all_heads else [slice(i, i + 1) for i in range(h)]

    @staticmethod
    def _run(q2, k2, v2, sink, base, all_heads, scale, causal):
        outs, lses = [], []
        for heads in _SinkFlashCPU._heads(q2.shape[1], all_heads):
            o, lse = _CPU_FLASH(q2[:, heads], k2[:, heads], v2[:, heads], 0.0, causal,
                                attn_mask=_with_sink(base, sink, heads), scale=scale)
            outs.append(o)
            lses.append(lse)
        return (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 1), torch.cat(lses, 1))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q2, k2, v2, out, lse, sink, base = ctx.saved_tensors
        base = base.clone()  # its sink column is rewritten per head; the saved one stays as is
        scale, causal = ctx.args
        g = g.contiguous()
        if causal:
            g = torch.cat([g.new_zeros(*g.shape[:2], 1, g.shape[-1]), g], dim=-2)
        grads = []
        for heads in _SinkFlashCPU._heads(q2.shape[1], ctx.all_heads):
            grads.append(_CPU_FLASH_BACKWARD(
                g[:, heads], q2[:, heads], k2[:, heads], v2[:, heads], out[:, heads],
                lse[:, heads], 0.0, causal, attn_mask=_with_sink(base, sink, heads),
                scale=scale))
        dq, dk, dv = (torch.cat(parts, 1) for parts in zip(*grads))
        work = work_dtype(out.dtype)                                         # float32 for halves
        delta = (g.to(work) * out.to(work)).sum(-1)                          # dO·o, (B, H, Nq')
        p_sink = torch.exp(sink.detach().to(work).view(1, -1, 1) - lse.to(work))
        d_sink = -(p_sink * delta).sum(dim=(0, 2)).to(sink.dtype)            # (H,)
        if causal:
            dq = dq[:, :, 1:]
        return dq, dk[:, :, 1:], dv[:, :, 1:], d_sink, None, None, None


def sink_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, sink: Tensor,
                   offset: float | Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """softmax([scale · q kᵀ + o, b_h]) without its last column, times v: (B, H, Nq, d_v).

    q, k (B, H, N·, d) float32 or float64 (v of a half type runs SDPA in that type, which
    accumulates in float32); ``sink`` (H,) the per-head sink logits b_h; ``offset`` a float or
    a tensor broadcastable to (B, H, Nq, 1); ``mask`` boolean (True = attend) broadcastable to
    (B, H, Nq, Nk), or None; ``causal`` top-left.
    """
    if _flash_fits(q, k, v, offset):
        dtype = v.dtype
        return _SinkFlashCPU.apply(q.to(dtype).contiguous(), k.to(dtype).contiguous(),
                                   v.contiguous(), sink, mask, float(scale), causal)
    b, h, n_q, d = q.shape
    n_k = k.shape[-2]
    pad = -(d + 1) % HEAD_MULTIPLE
    bias = sink.to(q.dtype).view(1, h, 1, 1) - offset                    # (1|B, H, 1|Nq, 1)
    extra = q.new_zeros(b, h, n_q, 1 + pad)
    extra[..., :1] = bias
    q2 = torch.cat([q * scale, extra], dim=-1)                            # (B, H, Nq, d')
    k_sink = k.new_zeros(b, h, 1, d + 1 + pad)
    k_sink[..., d] = 1.0
    k2 = torch.cat([torch.cat([k, k.new_zeros(b, h, n_k, 1 + pad)], dim=-1), k_sink], dim=-2)
    v2 = torch.cat([v, v.new_zeros(b, h, 1, v.shape[-1])], dim=-2)       # (B, H, Nk + 1, d_v)
    if causal:  # the sink key sits after the real ones, so causality becomes a mask
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    if mask is not None:  # every query attends the sink
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    dtype = v.dtype
    return F.scaled_dot_product_attention(q2.to(dtype), k2.to(dtype), v2, attn_mask=mask,
                                          scale=1.0)
