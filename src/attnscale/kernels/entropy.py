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
from attnscale.kernels.rowsubset import RowSubset, hidden_rows, masked
from attnscale.kernels.tiles import Scratch, Tiles
from attnscale.precision import all_finite
from attnscale.workers import parallel_map, workers_for


# Logits per block of the forward pass: one head of 1024 x 1024 (4 MiB in float32); measured
# 10% faster than half that at B4 H8 N1024 d64 (fewer calls), and no faster at twice.
ENTROPY_BLOCK_ELEMENTS = 1 << 20
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
    return _RowEntropy.apply(q.contiguous(), k.contiguous(), mask, causal,
                             ENTROPY_BLOCK_ELEMENTS, float(scale))


def _scores(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """scale · a @ b for batched matrices (3-D), the scale applied inside the matmul."""
    if scale == 1.0:
        return torch.bmm(a, b)
    return torch.baddbmm(a.new_empty(()).expand(a.shape[0], a.shape[1], b.shape[-1]), a, b,
                         beta=0.0, alpha=scale)


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


def entropy_forward(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float,
                    block_elements: int = ENTROPY_BLOCK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """(H, lse) of softmax(scale · q kᵀ) per query, each (B, H, Nq, 1) in q's dtype, without
    autograd; q and k contiguous (see :func:`row_entropy`)."""
    ent = q.new_empty(*q.shape[:-1], 1)                                   # (B, H, Nq, 1)
    lse = q.new_empty(*q.shape[:-1], 1)                                   # kept for backward
    tiles = Tiles(q, k, mask, causal, block_elements)
    groups = list(tiles.groups())
    native_entropy = q.dtype == torch.float32 and q.device.type == "cpu" and native.available()
    scratch = Scratch(tiles.block_elements(), q.dtype, 1, q.device)

    def group(where: tuple[int, slice]) -> None:
        b, heads = where
        k_g = k[b, heads]
        for i, (q_blk, ent_blk, lse_blk) in enumerate(zip(*tiles.split(b, heads, q, ent, lse))):
            z = tiles.hide(scratch.scores(0, q_blk, k_g[:, :tiles.n_keys(i)], scale), b, heads, i)
            if native_entropy:  # the compiled entropy kernel: H and lse in two passes
                rows = native.row_entropy(z)
                ent_blk.copy_(rows[..., :1])
                lse_blk.copy_(rows[..., 1:])
            else:
                h_blk, l_blk = _entropy(z)
                ent_blk.copy_(h_blk)
                lse_blk.copy_(l_blk)

    with torch.no_grad():
        parallel_map(group, groups, workers_for(q.device, len(groups)))
    return ent, lse


def entropy_backward(q: Tensor, k: Tensor, ent: Tensor, lse: Tensor, g: Tensor,
                     mask: Tensor | None, causal: bool, scale: float,
                     block_elements: int = ENTROPY_BLOCK_ELEMENTS, *, finite: bool | None = None,
                     into: Tensor | None = None,
                     into_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dQ, dK) for the incoming gradient ``g`` (B, H, Nq, 1) of the entropies ``ent`` (with
    their ``lse``) that :func:`entropy_forward` gave.

    Rows with g = 0 contribute nothing (where q and k are finite: a NaN or inf would make
    0 · ∂H/∂z NaN, as autograd through H gives it).  When at most 1/:data:`SPARSE_ROWS_FRACTION`
    of the rows get a gradient they are gathered and scored alone, else every block holding one
    is recomputed.  ``finite``: whether q and k are known to be finite (None: checked here);
    ``into``: a (B, H, Nq, d) tensor dQ is added into and returned as; ``into_k`` the same for
    dK, (B, H, Nk, d).
    """
    # the skips test g on the host, where that costs no device sync
    finite = q.device.type == "cpu" and (all_finite(k) and all_finite(q) if finite is None
                                         else finite)
    if finite and not bool(g.any()):
        return (_zero(q) if into is None else into), (_zero(k) if into_k is None else into_k)
    g = g.contiguous()
    live = g.squeeze(-1) != 0                                             # (B, H, Nq)
    if finite and int(live.sum()) * SPARSE_ROWS_FRACTION <= live.numel():
        return _sparse_backward(q, k, ent, lse, g, mask, causal, scale, live, into, into_k)
    dq = torch.empty_like(q) if into is None else into
    keep = 0.0 if into is None else 1.0                                   # dQ = s dZ K (+ into)
    # dKᵀ (B, H, d, Nk) when dK is returned on its own: the layout baddbmm writes fastest
    dk_t = k.new_zeros(*k.shape[:2], k.shape[-1], k.shape[-2]) if into_k is None else None
    tiles = Tiles(q, k, mask, causal, block_elements)
    scratch = Scratch(tiles.block_elements(), q.dtype, 1, q.device)

    def group(where: tuple[int, slice]) -> None:
        b, heads = where
        k_g = k[b, heads]
        dk_g = dk_t[b, heads] if into_k is None else into_k[b, heads]
        for i, (q_blk, ent_blk, lse_blk, g_blk, dq_blk) in enumerate(
                zip(*tiles.split(b, heads, q, ent, lse, g, dq))):
            # No gradient reaches these rows (adaptive-temp's β clamped at 1 is flat in H):
            # dZ = 0, so skip the block (on the CPU, where the test costs no device sync),
            # unless a NaN or inf in q or k would make 0 · ∂H/∂z NaN, as autograd gives it.
            if finite and not bool(g_blk.any()):
                if into is None:
                    dq_blk.zero_()
                continue
            n_k = tiles.n_keys(i)
            z = tiles.hide(scratch.scores(0, q_blk, k_g[:, :n_k], scale), b, heads, i)
            z.sub_(lse_blk)                                               # ln p, -inf if masked
            hidden = torch.isneginf(z)                                    # masked keys
            p = torch.exp(z)                                              # 0 at masked keys
            # g ∘ ∂H/∂z = -g p (ln p + H); masked keys (p = 0, ln p = -inf) give 0, and a
            # row holding NaN stays NaN (its dQ too, as autograd through H gives it)
            dz = torch.where(hidden, 0.0, z.add_(ent_blk).mul_(p)).mul_(-g_blk)
            torch.baddbmm(dq_blk, dz, k_g[:, :n_k], beta=keep, alpha=scale, out=dq_blk)
            if into_k is None:
                dk_g[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz, alpha=scale)  # dKᵀ += s Qᵀ dZ
            else:
                dk_g[:, :n_k].baddbmm_(dz.transpose(1, 2), q_blk, alpha=scale)    # dK += s dZᵀ Q

    groups = list(tiles.groups())
    parallel_map(group, groups, workers_for(q.device, len(groups)))
    return dq, (dk_t.transpose(-2, -1) if into_k is None else into_k)


class _RowEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                block_elements: int, scale: float) -> Tensor:
        ent, lse = entropy_forward(q, k, mask, causal, scale, block_elements)
        ctx.save_for_backward(q, k, ent, lse, mask)
        ctx.args = (causal, block_elements, scale)
        return ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, ent, lse, mask = ctx.saved_tensors
        causal, block_elements, scale = ctx.args
        dq, dk = entropy_backward(q, k, ent, lse, g, mask, causal, scale, block_elements)
        return dq, dk, None, None, None, None


def _zero(t: Tensor) -> Tensor:
    """A zero gradient shaped like ``t`` that writes nothing: one element, expanded (as the
    backward of a sum returns)."""
    return t.new_zeros(()).expand_as(t)


def _sparse_backward(q: Tensor, k: Tensor, ent: Tensor, lse: Tensor, g: Tensor,
                     mask: Tensor | None, causal: bool, scale: float, live: Tensor,
                     into: Tensor | None = None,
                     into_k: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The backward over the rows ``live`` (B, H, Nq) selects, gathered; every other row has
    g_H = 0 and finite inputs, so contributes nothing.  Only the (batch, head) pairs holding a
    live row are scored; dQ and dK are added into ``into`` and ``into_k`` when given."""
    n_k = k.shape[-2]
    pairs = live.any(dim=-1).nonzero()                                    # (P, 2): (b, h)
    if pairs.shape[0] == 0:
        return (_zero(q) if into is None else into), (_zero(k) if into_k is None else into_k)
    pb, ph = pairs[:, 0], pairs[:, 1]
    rows = RowSubset(live[pb, ph].unsqueeze(0))                           # (1, P, c)
    idx = rows.idx[0]                                                     # (P, c)
    at = (pb.unsqueeze(-1), ph.unsqueeze(-1), idx)
    q_r, k_p = q[at], k[pb, ph]                                           # (P, c, d), (P, Nk, d)
    hidden = hidden_rows(None if mask is None else ~mask, at, n_k, causal)  # (P, c, Nk)
    z = masked(_scores(q_r, k_p.transpose(1, 2), scale), hidden)
    z = z.sub_(lse[at])                                                   # ln p, -inf if hidden
    p = torch.exp(z)
    real = rows.real[0]                                                   # (P, c)
    g_r = torch.where(real.unsqueeze(-1), g[at], 0.0)                     # padding: no gradient
    dz = torch.where(torch.isneginf(z), 0.0, z.add_(ent[at]).mul_(p)).mul_(-g_r * scale)
    dq_r = torch.bmm(dz, k_p)                                             # dQ = s dZ K
    dk_p = torch.bmm(dz.transpose(1, 2), q_r)                             # dK = s dZᵀ Q
    where = (pb.unsqueeze(-1).expand_as(idx)[real], ph.unsqueeze(-1).expand_as(idx)[real],
             idx[real])
    dq = torch.zeros_like(q) if into is None else into
    dq.index_put_(where, dq_r[real], accumulate=True)
    dk = torch.zeros_like(k) if into_k is None else into_k
    for b, h, d in zip(pb.tolist(), ph.tolist(), dk_p):  # a few (batch, head) pairs: measured
        dk[b, h].add_(d)                                  # 7x faster than index_put_ there
    return dq, dk
