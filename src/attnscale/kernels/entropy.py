"""Row entropies of softmax(q kᵀ) over the keys each query attends, blockwise and differentiable,
without the (B, H, Nq, Nk) logits: the statistics pass of adaptive temperature.

Forward: each block of float32 CPU logits goes through attnscale's compiled entropy kernel
(:func:`attnscale.kernels.native.row_entropy`: H and the log-sum-exp, which the backward keeps);
other dtypes and devices reduce each block around its row maximum m, H = ln Σ e^{z - m} -
Σ p_i (z_i - m), in the dtype of q (float32 for half inputs).  Backward, recomputing each block:
with p = softmax(z) and H = -Σ p_i ln p_i, ∂H/∂z_i = -p_i (ln p_i + H) = -p_i (z_i - lse + H), so
dZ = g_H ∘ ∂H/∂z, dQ = dZ K and dK = dZᵀ Q.  Blocks are cut as in the soft-cap kernel, and a
block whose rows get no gradient (g_H = 0: adaptive-temp's β is clamped at 1 there, as for every
high-entropy row) is skipped, so the backward costs only where the entropy steers the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels import native
from attnscale.kernels.rowsubset import RowSubset, masked
from attnscale.kernels.softcap import CAPPED_BLOCK_ELEMENTS, _Tiles
from attnscale.precision import all_finite
from attnscale.workers import parallel_map, workers_for


# The backward scores only the rows that receive a gradient, gathered, when they are at most
# this fraction of all rows (adaptive-temp at init: 8 of 32768 at B4 H8 N1024 d64); otherwise it
# goes block by block, skipping blocks without one.
SPARSE_ROWS_FRACTION = 8


def row_entropy(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                scale: float | Tensor = 1.0) -> Tensor:
    """H(softmax(scale · q kᵀ)) per query, nats: (B, H, Nq, 1) in q's dtype.

    q (B, H, Nq, d); k (B, H, Nk, d); ``mask`` boolean (True = attend) broadcastable to
    (B, H, Nq, Nk); ``causal`` top-left; a float ``scale`` rides on the matmuls (no scaled copy of
    q), a tensor one (per head or row) multiplies q.  A query with no key gets 0; a row holding
    NaN gets NaN.
    """
    if isinstance(scale, Tensor):
        q, scale = q * scale, 1.0
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # no query, or no key: every entropy is 0
        return q.new_zeros(*q.shape[:-1], 1) + 0.0 * (q.sum() + k.sum())
    return _RowEntropy.apply(q.contiguous(), k.contiguous(), mask, causal, CAPPED_BLOCK_ELEMENTS,
                             float(scale))


def _scores(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """scale · a @ b for batched matrices, the scale applied inside the matmul."""
    if scale == 1.0:
        return torch.bmm(a, b) if a.dim() == 3 else a @ b
    if a.dim() == 3:
        return torch.baddbmm(a.new_empty(()).expand(a.shape[0], a.shape[1], b.shape[-1]), a, b,
                             beta=0.0, alpha=scale)
    return (a @ b).mul_(scale)


def _entropy(z: Tensor) -> tuple[Tensor, Tensor]:
    """(H, lse) of softmax over the last dimension of masked logits z (h, r, n), each (h, r, 1):
    0 and 0 for a row without keys, NaN for a row holding NaN."""
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)                     # rows without keys
    d = z - m
    e = d.exp()
    s = e.sum(dim=-1, keepdim=True)
    log_s = torch.log(torch.where(s > 0, s, 1.0))
    terms = torch.where(e > 0, e * d, 0.0)                         # 0 at masked keys
    ent = log_s - terms.sum(dim=-1, keepdim=True) / torch.where(s > 0, s, 1.0)
    return ent, log_s + m


class _RowEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                block_elements: int, scale: float) -> Tensor:
        ent = q.new_empty(*q.shape[:-1], 1)                               # (B, H, Nq, 1)
        lse = q.new_empty(*q.shape[:-1], 1)                               # kept for backward
        tiles = _Tiles(q, k, mask, causal, block_elements)
        groups = list(tiles.groups())
        workers = workers_for(q.device, len(groups))
        native_entropy = q.dtype == torch.float32 and q.device.type == "cpu" and native.available()

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g = k[b, heads]
            for i, (q_blk, ent_blk, lse_blk) in enumerate(zip(*tiles.split(b, heads, q, ent,
                                                                           lse))):
                z = tiles.hide(_scores(q_blk, k_g[:, :tiles.n_keys(i)].transpose(1, 2), scale),
                               b, heads, i)
                if native_entropy:  # the compiled entropy kernel: H and lse in two passes
                    rows = native.row_entropy(z)
                    ent_blk.copy_(rows[..., :1])
                    lse_blk.copy_(rows[..., 1:])
                else:
                    h_blk, l_blk = _entropy(z)
                    ent_blk.copy_(h_blk)
                    lse_blk.copy_(l_blk)

        with torch.no_grad():
            parallel_map(group, groups, workers)
        ctx.save_for_backward(q, k, ent, lse, mask)
        ctx.args = (causal, block_elements, scale)
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, ent, lse, mask = ctx.saved_tensors
        causal, block_elements, scale = ctx.args
        cpu = q.device.type == "cpu"
        finite = cpu and all_finite(k) and all_finite(q)
        if finite and not bool(g.any()):
            # no row gets a gradient, and no NaN or inf would turn 0 · ∂H/∂z into NaN
            return _zero(q), _zero(k), None, None, None, None
        g = g.contiguous()
        live = g.squeeze(-1) != 0                                         # (B, H, Nq)
        if finite and int(live.sum()) * SPARSE_ROWS_FRACTION <= live.numel():
            return _sparse_backward(q, k, ent, lse, g, mask, causal, scale, RowSubset(live))
        dq = torch.empty_like(q)
        dk_t = k.new_zeros(*k.shape[:2], k.shape[-1], k.shape[-2])        # (B, H, d, Nk)
        tiles = _Tiles(q, k, mask, causal, block_elements)

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g, dk_g = k[b, heads], dk_t[b, heads]
            for i, (q_blk, ent_blk, lse_blk, g_blk, dq_blk) in enumerate(
                    zip(*tiles.split(b, heads, q, ent, lse, g, dq))):
                # No gradient reaches these rows (adaptive-temp's β clamped at 1 is flat in H):
                # dZ = 0, so skip the block (on the CPU, where the test costs no device sync),
                # unless a NaN or inf in q or k would make 0 · ∂H/∂z NaN, as autograd gives it.
                if finite and not bool(g_blk.any()):
                    dq_blk.zero_()
                    continue
                n_k = tiles.n_keys(i)
                z = tiles.hide(_scores(q_blk, k_g[:, :n_k].transpose(1, 2), scale), b, heads, i)
                z.sub_(lse_blk)                                           # ln p, -inf if masked
                hidden = torch.isneginf(z)                                # masked keys
                p = torch.exp(z)                                          # 0 at masked keys
                # g ∘ ∂H/∂z = -g p (ln p + H); masked keys (p = 0, ln p = -inf) give 0, and a
                # row holding NaN stays NaN (its dQ too, as autograd through H gives it)
                dz = torch.where(hidden, 0.0, z.add_(ent_blk).mul_(p)).mul_(-g_blk)
                torch.baddbmm(dq_blk, dz, k_g[:, :n_k], beta=0.0, alpha=scale,
                              out=dq_blk)                                 # dQ = s dZ K
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz, alpha=scale)  # dKᵀ += s Qᵀ dZ

        groups = list(tiles.groups())
        parallel_map(group, groups, workers_for(q.device, len(groups)))
        return dq, dk_t.transpose(-2, -1), None, None, None, None


def _zero(t: Tensor) -> Tensor:
    """A zero gradient shaped like ``t`` that writes nothing: one element, expanded (as the
    backward of a sum returns)."""
    return t.new_zeros(()).expand_as(t)


def _sparse_backward(q: Tensor, k: Tensor, ent: Tensor, lse: Tensor, g: Tensor,
                     mask: Tensor | None, causal: bool, scale: float, rows: RowSubset):
    """The backward over the rows ``rows`` selects (every other row has g_H = 0 and finite
    inputs, so contributes nothing), as the autograd.Function's gradients."""
    if rows.most == 0:
        return _zero(q), _zero(k), None, None, None, None
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    q_r = rows.gather(q)                                                  # (B, H, c, d)
    hidden = rows.hidden(None if mask is None else ~mask, k.shape[-2], causal)
    z = masked(q_r @ k.transpose(-2, -1), hidden)
    z = z.mul_(scale).sub_(rows.gather(lse))                              # ln p, -inf if hidden
    p = torch.exp(z)
    g_r = torch.where(rows.real.unsqueeze(-1), rows.gather(g), 0.0)       # padding: no gradient
    dz = torch.where(torch.isneginf(z), 0.0, z.add_(rows.gather(ent)).mul_(p)).mul_(-g_r * scale)
    rows.scatter_add(dq, dz @ k)                                          # dQ = s dZ K
    dk += dz.transpose(-2, -1) @ q_r                                      # dK = s dZᵀ Q
    return dq, dk, None, None, None, None
