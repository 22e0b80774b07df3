"""Row entropies of softmax(q kᵀ) over the keys each query attends, blockwise and differentiable,
without the (B, H, Nq, Nk) logits: the statistics pass of adaptive temperature.

Forward: each block of float32 CPU logits goes through attnscale's compiled row kernel
(:mod:`attnscale.kernels.rowstats`) for H, and the log-sum-exp is kept for the backward; other
dtypes and devices reduce each block around its row maximum m, H = ln Σ e^{z - m} -
Σ p_i (z_i - m), in the dtype of q (float32 for half inputs).  Backward, recomputing each block:
with p = softmax(z) and
H = -Σ p_i ln p_i, ∂H/∂z_i = -p_i (ln p_i + H) = -p_i (z_i - lse + H), so
dZ = g_H ∘ ∂H/∂z, dQ = dZ K and dK = dZᵀ Q.  Blocks are cut as in the soft-cap kernel, and a
block whose rows get no gradient (g_H = 0: adaptive-temp's β is clamped at 1 there, as for every
high-entropy row) is skipped, so the backward costs only where the entropy steers the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnscale.kernels import native, rowstats
from attnscale.kernels.native import ROW_STATS_COLUMNS
from attnscale.kernels.softcap import CAPPED_BLOCK_ELEMENTS, _Tiles
from attnscale.workers import parallel_map, workers_for


# The row kernel's columns this pass reads.
ENTROPY = ROW_STATS_COLUMNS.index("entropy")
LOGIT_MAX = ROW_STATS_COLUMNS.index("logit_max")
MAX_WEIGHT = ROW_STATS_COLUMNS.index("max_weight")
COUNT = ROW_STATS_COLUMNS.index("count")


def row_entropy(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """H(softmax(q kᵀ)) per query, nats: (B, H, Nq, 1) in q's dtype.

    q (B, H, Nq, d) already carries the scale; k (B, H, Nk, d); ``mask`` boolean (True = attend)
    broadcastable to (B, H, Nq, Nk); ``causal`` top-left.  A query with no key gets 0; a row
    holding NaN gets NaN.
    """
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # no query, or no key: every entropy is 0
        return q.new_zeros(*q.shape[:-1], 1) + 0.0 * (q.sum() + k.sum())
    return _RowEntropy.apply(q.contiguous(), k.contiguous(), mask, causal, CAPPED_BLOCK_ELEMENTS)


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
                block_elements: int) -> Tensor:
        ent = q.new_empty(*q.shape[:-1], 1)                               # (B, H, Nq, 1)
        lse = q.new_empty(*q.shape[:-1], 1)                               # kept for backward
        tiles = _Tiles(q, k, mask, causal, block_elements)
        groups = list(tiles.groups())
        workers = workers_for(q.device, len(groups))
        native_rows = q.dtype == torch.float32 and q.device.type == "cpu" and native.available()

        def group(where: tuple[int, slice]) -> None:
            b, heads = where
            k_g = k[b, heads]
            for i, (q_blk, ent_blk, lse_blk) in enumerate(zip(*tiles.split(b, heads, q, ent,
                                                                           lse))):
                z = tiles.hide(torch.bmm(q_blk, k_g[:, :tiles.n_keys(i)].transpose(1, 2)),
                               b, heads, i)
                if native_rows:  # the compiled row kernel gives H and, from p_max, the lse
                    rows = rowstats.row_stats(z, threads=1 if workers > 1 else None)
                    ent_blk.copy_(rows[..., ENTROPY:ENTROPY + 1])
                    # p_max = e^{z_max - lse}, so lse = z_max - ln p_max (float64 in the kernel);
                    # a row without keys has count 0 and gets lse 0, as _entropy gives it.
                    top, p_max = rows[..., LOGIT_MAX:LOGIT_MAX + 1], rows[..., MAX_WEIGHT:
                                                                            MAX_WEIGHT + 1]
                    row_lse = top - torch.log(p_max)
                    lse_blk.copy_(torch.where(rows[..., COUNT:COUNT + 1] > 0, row_lse, 0.0))
                else:
                    h_blk, l_blk = _entropy(z)
                    ent_blk.copy_(h_blk)
                    lse_blk.copy_(l_blk)

        with torch.no_grad():
            parallel_map(group, groups, workers)
        ctx.save_for_backward(q, k, ent, lse, mask)
        ctx.args = (causal, block_elements)
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, ent, lse, mask = ctx.saved_tensors
        causal, block_elements = ctx.args
        cpu = q.device.type == "cpu"
        finite = cpu and bool(torch.isfinite(k).all())
        if finite and not bool(g.any()) and bool(torch.isfinite(q).all()):
            # no row gets a gradient, and no NaN or inf would turn 0 · ∂H/∂z into NaN
            return torch.zeros_like(q), torch.zeros_like(k), None, None, None
        g = g.contiguous()
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
                if finite and not bool(g_blk.any()) and bool(torch.isfinite(q_blk).all()):
                    dq_blk.zero_()
                    continue
                n_k = tiles.n_keys(i)
                z = tiles.hide(torch.bmm(q_blk, k_g[:, :n_k].transpose(1, 2)), b, heads, i)
                z.sub_(lse_blk)                                           # ln p, -inf if masked
                hidden = torch.isneginf(z)                                # masked keys
                p = torch.exp(z)                                          # 0 at masked keys
                # g ∘ ∂H/∂z = -g p (ln p + H); masked keys (p = 0, ln p = -inf) give 0, and a
                # row holding NaN stays NaN (its dQ too, as autograd through H gives it)
                dz = torch.where(hidden, 0.0, z.add_(ent_blk).mul_(p)).mul_(-g_blk)
                torch.bmm(dz, k_g[:, :n_k], out=dq_blk)                   # dQ = dZ K
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz)       # dKᵀ += Qᵀ dZ

        groups = list(tiles.groups())
        parallel_map(group, groups, workers_for(q.device, len(groups)))
        return dq, dk_t.transpose(-2, -1), None, None, None
