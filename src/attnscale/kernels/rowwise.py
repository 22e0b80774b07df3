"""Attention whose weights are a function of each whole row of masked logits other than softmax
(softpick, stick-breaking), times v, without the (B, H, Nq, Nk) logits, forward and backward.

The blocks are the soft-cap kernel's (:class:`attnscale.kernels.tiles.Tiles`): a few heads of
one batch element by a run of queries, against every key those queries can see, so each block
holds whole rows and a row's normaliser (its maximum, its sum, a stick-breaking scan over its
keys) is exact within the block; nothing is rescaled online.  Extra memory is a few blocks,
O(Nk · rows), and the backward recomputes each block's weights from q and k instead of storing
them.  Head groups run side by side on the CPU.

A :class:`RowRule` supplies the two per-row steps: ``weights`` (masked logits -> weights) and
``grad`` (dL/dp -> dL/dz).  With ``z = scale · q kᵀ + offset``, the driver does the rest::

    forward:   p = rule.weights(z);             O = P V
    backward:  p = rule.weights(z) (again);     dV = Pᵀ dO;  dP = dO Vᵀ;
               dZ = rule.grad(z, p, dP, δ);     dQ = scale · dZ K;  dK = scale · dZᵀ Q

with δ = rowsum(dO ∘ O) for a rule that asks for it.  The offset is a constant (no gradient).
"""

from __future__ import annotations

import math
import threading
from typing import Protocol

import torch
from torch import Tensor

from attnscale.kernels import softpick, stick_breaking
from attnscale.kernels.softcap import CAPPED_BLOCK_ELEMENTS
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Tiles
from attnscale.precision import upcast
from attnscale.workers import workers_for


class RowRule(Protocol):
    """One normaliser's per-row steps on blocks of masked logits ``z`` (h, r, n): ``-inf`` marks a
    masked key, and with ``limit`` (int64 (r,), or None) row j sees only its first ``limit[j]``
    keys (causality as counts; the keys beyond are read as masked and get weight 0)."""

    needs_delta: bool  # grad reads δ = rowsum(dO ∘ O)

    def native(self, z: Tensor) -> bool:
        """Whether blocks like ``z`` run on the compiled kernels (which take ``limit``); else
        the driver writes causality into z as -inf and passes ``limit=None``."""
        ...

    def weights(self, z: Tensor, limit: Tensor | None, out: Tensor) -> tuple[Tensor, object]:
        """(p, aux): the weights (h, r, n), in ``out`` (z's shape, not z) where the rule can
        write them there, and whatever per-row values ``grad`` needs (recomputed identically in
        the backward); z may be overwritten only if ``grad`` does not read it."""
        ...

    def grad(self, z: Tensor, p: Tensor, aux: object, dp: Tensor, delta: Tensor | None,
             limit: Tensor | None) -> Tensor:
        """dL/dz (h, r, n) from dL/dp ``dp``, in dp's memory (p's may be overwritten too)."""
        ...


def row_attention(rule: RowRule, q: Tensor, k: Tensor, v: Tensor, scale: float,
                  offset: float | Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """``rule``'s weights of ``scale · q kᵀ + offset`` (masked), times v: (B, H, Nq, d_v) in the
    dtype of v.

    q, k (B, H, N·, d) float32 or float64 (half v is computed in float32); ``offset`` a float or a
    tensor broadcastable to (B, H, Nq, 1), a constant; ``mask`` boolean (True = attend),
    broadcastable to (B, H, Nq, Nk), or None; ``causal`` top-left (key j <= query i).
    """
    b, h, n_q, _ = q.shape
    if n_q == 0 or k.shape[-2] == 0:
        # No query, or no key: an empty output or zeros (a row without keys weighs nothing),
        # with gradients, from an empty product; the blocks need a block to cut.
        return (q @ k.transpose(-2, -1) @ upcast(v).to(q.dtype)).to(v.dtype)
    if isinstance(offset, Tensor):
        offset = offset.detach().to(q.dtype).expand(b, h, n_q, 1).contiguous()
    else:
        offset = q.new_full((b, h, n_q, 1), float(offset))
    out = _RowAttention.apply(q.contiguous(), k.contiguous(), upcast(v).to(q.dtype).contiguous(),
                              offset, mask, rule, float(scale), causal, CAPPED_BLOCK_ELEMENTS)
    return out.to(v.dtype)


class _Scratch:
    """Block buffers of one kernel call, one set per worker thread, reused block after block
    and group after group (a causal block is a prefix of the largest): ``get(slot, shape)`` is a
    contiguous view of that thread's memory for ``slot``.  A new tensor per block leaves freed
    blocks in the allocator's per-thread arenas (measured: 12 MiB more peak RSS over the 32 head
    groups of B4 H8 N1024, depending on the order of frees)."""

    def __init__(self, like: Tensor):
        self.like, self.local = like, threading.local()

    def get(self, slot: str, shape: tuple[int, ...]) -> Tensor:
        slots = self.local.__dict__.setdefault("slots", {})
        n = math.prod(shape)
        buf = slots.get(slot)
        if buf is None or buf.numel() < n:
            buf = slots[slot] = self.like.new_empty(n)
        return buf[:n].view(shape)


def _block_logits(rule: RowRule, tiles: Tiles, q_blk: Tensor, k_g: Tensor, off_blk: Tensor,
                  scale: float, b: int, heads: slice, i: int,
                  scratch: _Scratch) -> tuple[Tensor, Tensor | None]:
    """Block i's masked logits scale · q kᵀ + offset (h, r, n_k) and its causal key counts (for
    the compiled kernels; None when causality is written into the logits or absent)."""
    n_k = tiles.n_keys(i)
    z = scratch.get("z", (q_blk.shape[0], q_blk.shape[1], n_k))
    torch.baddbmm(off_blk, q_blk, k_g[:, :n_k].transpose(1, 2), alpha=scale, out=z)
    if rule.native(z):
        return tiles.hide_masked(z, b, heads, i), tiles.causal_counts(i, z.shape[1])
    return tiles.hide(z, b, heads, i), None


class _RowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, offset: Tensor, mask: Tensor | None,
                rule: RowRule, scale: float, causal: bool, block_elements: int) -> Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])                  # (B, H, Nq, d_v)
        tiles = Tiles(q, k, mask, causal, block_elements)
        scratch = _Scratch(q)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, v_g = k[b, heads], v[b, heads]                        # (h, Nk, d), (h, Nk, d_v)
            blocks = zip(*tiles.split(b, heads, q, offset, out))
            for i, (q_blk, off_blk, out_blk) in enumerate(blocks):
                z, limit = _block_logits(rule, tiles, q_blk, k_g, off_blk, scale, b, heads, i,
                                         scratch)
                p, _ = rule.weights(z, limit, scratch.get("p", z.shape))  # (h, r, n_k)
                torch.bmm(p, v_g[:, :p.shape[-1]], out=out_blk)

        groups = list(tiles.groups())
        team_map(group, groups, workers_for(q.device, len(groups)))
        ctx.save_for_backward(q, k, v, offset, mask, out if rule.needs_delta else None)
        ctx.args = (rule, scale, causal, block_elements)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, offset, mask, out = ctx.saved_tensors
        rule, scale, causal, block_elements = ctx.args
        d_out = d_out.contiguous()
        # δ = rowsum(dO ∘ O) = Σ_j p_j dP_j, (B, H, Nq, 1), for a rule that needs it.
        delta = (d_out * out).sum(-1, keepdim=True) if rule.needs_delta else offset
        dq = torch.empty_like(q)
        # dK and dV are accumulated transposed (dKᵀ += Qᵀ dZ reads dZ untransposed: the faster
        # gemm on the CPU, as in the soft-cap kernel).
        dk_t = k.new_zeros(*k.shape[:2], k.shape[-1], k.shape[-2])     # (B, H, d, Nk)
        dv_t = v.new_zeros(*v.shape[:2], v.shape[-1], v.shape[-2])     # (B, H, d_v, Nk)
        tiles = Tiles(q, k, mask, causal, block_elements)
        scratch = _Scratch(q)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, v_g, dk_g, dv_g = k[b, heads], v[b, heads], dk_t[b, heads], dv_t[b, heads]
            blocks = zip(*tiles.split(b, heads, q, offset, d_out, delta, dq))
            for i, (q_blk, off_blk, do_blk, delta_blk, dq_blk) in enumerate(blocks):
                z, limit = _block_logits(rule, tiles, q_blk, k_g, off_blk, scale, b, heads, i,
                                         scratch)
                p, aux = rule.weights(z, limit, scratch.get("p", z.shape))  # recomputed
                n_k = p.shape[-1]
                dv_g[..., :n_k].baddbmm_(do_blk.transpose(1, 2), p)    # dVᵀ += dOᵀ P
                dp = scratch.get("dp", p.shape)
                torch.bmm(do_blk, v_g[:, :n_k].transpose(1, 2), out=dp)  # dP = dO Vᵀ
                dz = rule.grad(z, p, aux, dp, delta_blk if rule.needs_delta else None, limit)
                torch.bmm(dz, k_g[:, :n_k], out=dq_blk)                # dQ = dZ K
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz)    # dKᵀ += Qᵀ dZ

        groups = list(tiles.groups())
        team_map(group, groups, workers_for(q.device, len(groups)))
        dq.mul_(scale)
        dk_t.mul_(scale)
        return (dq, dk_t.transpose(-2, -1), dv_t.transpose(-2, -1),
                None, None, None, None, None, None)


def softpick_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, offset: float | Tensor,
                       cap: float | None, mask: Tensor | None, causal: bool) -> Tensor:
    """Softpick weights (:mod:`attnscale.kernels.softpick`) of ``scale · q kᵀ + offset`` (masked),
    times v: (B, H, Nq, d_v) in the dtype of v (the arguments of :func:`row_attention`)."""
    if cap is not None:
        raise ValueError("softpick attention takes no soft-cap")
    return row_attention(softpick.RULE, q, k, v, scale, offset, mask, causal)


def stick_breaking_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                             offset: float | Tensor, cap: float | None, mask: Tensor | None,
                             causal: bool) -> Tensor:
    """Stick-breaking weights (:mod:`attnscale.kernels.stick_breaking`) of ``scale · q kᵀ +
    offset`` (masked), times v: (B, H, Nq, d_v) in the dtype of v (the arguments of
    :func:`row_attention`).  Without causality every key is taken to precede every query."""
    if cap is not None:
        raise ValueError("stick-breaking attention takes no soft-cap")
    return row_attention(stick_breaking.RULE, q, k, v, scale, offset, mask, causal)
