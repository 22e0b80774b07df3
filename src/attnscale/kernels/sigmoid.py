"""Sigmoid attention, σ(scale · q kᵀ + b) masked, times v, without the (B, H, Nq, Nk) logits,
forward and backward: a blockwise kernel on PyTorch ops (Ramapuram et al. 2024, arXiv 2409.04431,
whose FlashSigmoid kernel in ``apple/ml-sigmoid-attention`` does the same on GPUs).

Each weight is its own sigmoid: there is no row normaliser, so blocks of rows need no running
maximum or sum, and the backward recomputes each block's weights from q and k instead of
storing them: with p = σ(z), dz = dp ∘ p (1 - p) and dp = dO Vᵀ.  Blocks are cut as in the
soft-cap kernel (:class:`attnscale.kernels.tiles.Tiles`: a few heads of one batch element by a
run of queries, against the keys they can see), and head groups run side by side on the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels.softcap import CAPPED_BLOCK_ELEMENTS
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Tiles
from attnscale.precision import upcast
from attnscale.workers import workers_for


def sigmoid_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: float | Tensor,
                      cap: float | None, mask: Tensor | None, causal: bool) -> Tensor:
    """σ(scale · q kᵀ + offset) masked, times v: (B, H, Nq, d_v) in the dtype of v.

    q, k (B, H, N·, d) float32 or float64 (half v is computed in float32); ``offset`` a float
    or a tensor broadcastable to (B, H, Nq, 1), treated as a constant (no gradient); ``mask``
    boolean (True = attend), broadcastable to (B, H, Nq, Nk); masked keys get weight exactly 0.
    """
    if cap is not None:
        raise ValueError("sigmoid attention takes no soft-cap")
    b, h, n_q, _ = q.shape
    if isinstance(offset, Tensor):
        offset = offset.detach().to(q.dtype).expand(b, h, n_q, 1).contiguous()
    else:
        offset = q.new_full((b, h, n_q, 1), float(offset))
    out = _SigmoidAttention.apply(q.contiguous(), k.contiguous(), upcast(v).to(q.dtype).contiguous(),
                                  offset, mask, float(scale), causal, CAPPED_BLOCK_ELEMENTS)
    return out.to(v.dtype)


def _weights(tiles: Tiles, q_blk: Tensor, k_g: Tensor, off_blk: Tensor, scale: float, b: int,
             heads: slice, i: int) -> Tensor:
    """Block i's weights σ(scale q kᵀ + offset), masked keys 0: (h, r, n_k)."""
    n_k = tiles.n_keys(i)
    z = torch.baddbmm(off_blk, q_blk, k_g[:, :n_k].transpose(1, 2), alpha=scale)
    return tiles.hide(z, b, heads, i).sigmoid_()


class _SigmoidAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, offset: Tensor, mask: Tensor | None,
                scale: float, causal: bool, block_elements: int) -> Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])                  # (B, H, Nq, d_v)
        tiles = Tiles(q, k, mask, causal, block_elements)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, v_g = k[b, heads], v[b, heads]
            for i, (q_blk, off_blk, out_blk) in enumerate(zip(*tiles.split(b, heads, q, offset,
                                                                           out))):
                p = _weights(tiles, q_blk, k_g, off_blk, scale, b, heads, i)
                torch.bmm(p, v_g[:, :p.shape[-1]], out=out_blk)

        groups = list(tiles.groups())
        team_map(group, groups, workers_for(q.device, len(groups)))
        ctx.save_for_backward(q, k, v, offset, mask)
        ctx.args = (scale, causal, block_elements)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, offset, mask = ctx.saved_tensors
        scale, causal, block_elements = ctx.args
        d_out = d_out.contiguous()
        dq = torch.empty_like(q)
        dk_t = k.new_zeros(*k.shape[:2], k.shape[-1], k.shape[-2])     # (B, H, d, Nk)
        dv_t = v.new_zeros(*v.shape[:2], v.shape[-1], v.shape[-2])     # (B, H, d_v, Nk)
        tiles = Tiles(q, k, mask, causal, block_elements)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, v_g, dk_g, dv_g = k[b, heads], v[b, heads], dk_t[b, heads], dv_t[b, heads]
            blocks = zip(*tiles.split(b, heads, q, offset, d_out, dq))
            for i, (q_blk, off_blk, do_blk, dq_blk) in enumerate(blocks):
                p = _weights(tiles, q_blk, k_g, off_blk, scale, b, heads, i)  # recomputed
                n_k = p.shape[-1]
                dv_g[..., :n_k].baddbmm_(do_blk.transpose(1, 2), p)           # dVᵀ += dOᵀ P
                dp = torch.bmm(do_blk, v_g[:, :n_k].transpose(1, 2))          # dP = dO Vᵀ
                dz = torch.ops.aten.sigmoid_backward(dp, p)                   # dP ∘ p (1 - p)
                torch.bmm(dz, k_g[:, :n_k], out=dq_blk)                       # dQ = dZ K
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz)           # dKᵀ += Qᵀ dZ

        groups = list(tiles.groups())
        team_map(group, groups, workers_for(q.device, len(groups)))
        dq.mul_(scale)
        dk_t.mul_(scale)
        return dq, dk_t.transpose(-2, -1), dv_t.transpose(-2, -1), None, None, None, None, None
