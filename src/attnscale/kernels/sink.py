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
the sink is no key at all there: the CPU flash-attention op
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward) runs plain softmax
attention over the real keys and returns each row's log-sum-exp, from which the sink's share
follows exactly (:class:`_SinkFlashCPU`): no extra key, no bias column, the kernel's own
causality, and a boolean mask as the op's additive one in the mask's own shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnscale.kernels import chunked
from attnscale.precision import work_dtype

# SDPA's fused CUDA kernels need the head size to be a multiple of 8.
HEAD_MULTIPLE = 8



def _flash_fits(q: Tensor, k: Tensor, v: Tensor, offset: float | Tensor) -> bool:
    """Whether the sink can run on the CPU flash op with a bias mask (see the module doc): no
    offset, one head size for q, k and v, at least one query and one key."""
    return (not isinstance(offset, Tensor) and offset == 0.0
            and q.shape[-1] == v.shape[-1] and q.shape[-2] > 0 and k.shape[-2] > 0
            and q.device.type == "cpu" and chunked.flash_available()
            and type(q) is torch.Tensor
            and not torch.jit.is_tracing() and not torch.compiler.is_compiling())


def _additive(mask: Tensor | None, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """(the flash op's additive mask, the rows without a key) for a boolean ``mask`` in its own
    (broadcast) shape: 0 where a key is attended, -inf where not, and 0 across a row with no key
    at all (it attends everything; :class:`_SinkFlashCPU` gives it all mass on the sink)."""
    if mask is None:
        return None, None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    empty = ~mask.any(dim=-1, keepdim=True)                               # (B|1, H|1, Nq|1, 1)
    keep = mask | empty
    return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~keep, float("-inf")), (empty if bool(empty.any()) else None)


class _SinkFlashCPU(torch.autograd.Function):
    """The sink from the CPU flash op's log-sum-exp, with no extra key and no bias column.

    With o = softmax(z) v and lse = log Σ_j e^{z_j} from the op, the sink keeps the fraction
    w = e^{lse} / (e^{lse} + e^{b_h}) = σ(lse - b_h) of each row's mass on the real keys, so
    y = w o.  Backward: the op's own backward, given dY w as its output gradient and y as its
    output, is exactly the sink's: its dZ = p (dO·v_j - dO·O) becomes w p (g·v_j - g·y) = p'
    (g·v_j - g·y) with p' = w p the sink-normalised weights, and dV = p'ᵀ g.  And ∂L/∂b_h =
    -Σ_rows (1 - w) g·y, since the sink's value is zero."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink: Tensor, mask: Tensor | None,
                scale: float, causal: bool) -> Tensor:
        bias, empty = _additive(mask, q.dtype)
        o, lse = chunked.FLASH(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        work = work_dtype(o.dtype)                                           # float32 for halves
        w = torch.sigmoid(lse.to(work) - sink.detach().to(work).view(1, -1, 1)).unsqueeze(-1)
        if empty is not None:  # no key: all mass on the sink, whose value is zero
            w = w.masked_fill(empty, 0.0)
        y = (o.to(work) * w).to(o.dtype)
        ctx.save_for_backward(q, k, v, y, lse, w, bias)
        ctx.args = (scale, causal, sink.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, v, y, lse, w, bias = ctx.saved_tensors
        scale, causal, sink_dtype = ctx.args
        work = w.dtype
        g_w = (g.to(work) * w).to(g.dtype)
        dq, dk, dv = chunked.FLASH_BACKWARD(g_w, q, k, v, y, lse, 0.0, causal, attn_mask=bias,
                                         scale=scale)
        delta = torch.linalg.vecdot(g.to(work), y.to(work)).unsqueeze(-1)   # g·y, (B, H, Nq, 1)
        d_sink = -((1.0 - w) * delta).sum(dim=(0, 2, 3))                      # (H,)
        return dq, dk, dv, d_sink.to(sink_dtype), None, None, None


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
