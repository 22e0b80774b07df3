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

**The bfloat16 screen.**  A caller that needs the exact entropy only of some rows (adaptive-temp:
where β(H) may exceed 1) says which, from bounds on each row's entropy.  On a CPU whose bfloat16
matmuls are fast (AMX, AVX512_BF16: :func:`attnscale.kernels.peak.bf16_fast`, about 4x float32)
float32 input is then scored in bfloat16 first: every logit z̃ = s q̃·k̃ is within ε_i = s e_i of
the float32 one (e_i the proven bound of :func:`attnscale.kernels.peak.screen_error`), and along
the segment ζ_t = z̃ + t (z - z̃) the entropy changes at |dH/dt| = |Cov_{p_t}(ζ_t, z - z̃)| <=
σ_t ε_i, where the weights p_t are within a factor e^{2 ε_i} of z̃'s, so the standard deviation
σ_t of ζ_t under them is at most e^{ε_i} (σ̃ + ε_i), σ̃ that of z̃ under its own softmax: |H - H̃|
<= ε_i e^{ε_i} (σ̃ + ε_i) (plus a slack for the kernel's own float sums).  Only the rows the caller still
needs are scored again in float32 (gathered, or the whole block where most of its rows need
it); the others keep H̃ (within their bounds).  At B4 H8 N1024 d64 with random q and k no row
falls in adaptive-temp's window, and none needs the exact pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnscale.kernels import native, peak
from attnscale.kernels.rowsubset import RowSubset, block_hidden, hidden_rows, masked
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Scratch, Tiles
from attnscale.precision import all_finite
from attnscale.workers import workers_for

# Which rows need their exact entropy, from bounds (lo, hi) on each (see entropy_forward).
ExactWhere = Callable[[Tensor, Tensor], Tensor]


# Logits per block of the forward pass: one head of 1024 x 1024 (4 MiB in float32); measured
# 10% faster than half that at B4 H8 N1024 d64 (fewer calls), and no faster at twice.
ENTROPY_BLOCK_ELEMENTS = 1 << 20
# The bfloat16 screen (on CPUs where bfloat16 matmuls are fast): logits per block of its pass, and
# an absolute slack on each row's entropy bound for the float rounding of the kernel's own sums.
SCREEN_BLOCK_ELEMENTS = 1 << 20
SCREEN_SLACK = 1e-4
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
                    block_elements: int = ENTROPY_BLOCK_ELEMENTS, *,
                    exact_where: ExactWhere | None = None) -> tuple[Tensor, Tensor]:
    """(H, lse) of softmax(scale · q kᵀ) per query, each (B, H, Nq, 1) in q's dtype, without
    autograd; q and k contiguous (see :func:`row_entropy`).

    ``exact_where``: given, the rows may go through the bfloat16 screen (module doc) where it
    applies; it receives float64 bounds (lo, hi), (rows, Nq, 1), that the entropy of each row of
    some consecutive (batch, head) pairs lies within (with one worker thread, every row at once:
    (B·H, Nq, 1)) and returns the rows (bool, same shape) whose exact H and lse the caller needs:
    it must decide row by row.  The other rows get H within their bounds and a finite stand-in
    for lse.
    """
    if exact_where is not None and screen_applies(q, k, scale):
        screened = _screened(q, k, mask, causal, scale, exact_where)
        if screened is not None:
            return screened
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
            z = scratch.scores(0, q_blk, k_g[:, :tiles.n_keys(i)], scale)
            if native_entropy:  # the compiled entropy kernel: H and lse in two passes
                rows = native.row_entropy(tiles.hide_masked(z, b, heads, i),
                                          limit=tiles.causal_counts(i, z.shape[1]))
                ent_blk.copy_(rows[..., :1])
                lse_blk.copy_(rows[..., 1:])
            else:
                h_blk, l_blk = _entropy(tiles.hide(z, b, heads, i))
                ent_blk.copy_(h_blk)
                lse_blk.copy_(l_blk)

    with torch.no_grad():
        team_map(group, groups, workers_for(q.device, len(groups)))
    return ent, lse


def screen_applies(q: Tensor, k: Tensor, scale: float) -> bool:
    """Whether :func:`entropy_forward` may screen this call in bfloat16: float32 on a CPU whose
    bfloat16 matmuls are fast (:func:`attnscale.kernels.peak.bf16_fast`), with the compiled
    kernels, a positive float scale and at least :data:`attnscale.kernels.peak.SCREEN_MIN_ELEMENTS`
    logits."""
    return (q.dtype == torch.float32 and q.device.type == "cpu" and isinstance(scale, float)
            and scale > 0 and native.available() and peak.bf16_fast()
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2] >= peak.SCREEN_MIN_ELEMENTS)


def _screened(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float,
              exact_where: ExactWhere) -> tuple[Tensor, Tensor] | None:
    """:func:`entropy_forward` through the bfloat16 screen, or None where it cannot bound a row
    (a NaN or inf in q or k, a logit overflowing bfloat16).  The head groups are cut into one
    run of consecutive groups per worker, and each worker does its run's whole work (bfloat16
    copies, norms, screen, bounds and exact rows): with several threads, a torch op outside the
    workers is an OpenMP team that stalls whenever a core is taken, and the bounds' elementwise
    ops run once per run rather than once per block."""
    b, h, n_q, d = q.shape
    ent = q.new_empty(b, h, n_q, 1)
    lse = q.new_empty(b, h, n_q, 1)
    est = torch.empty(b, h, n_q, 3, dtype=torch.float32)   # (H̃, max z̃, σ̃) per row
    q_norm = torch.empty(b, h, n_q, 1, dtype=torch.float64)
    k_norm = torch.empty(b, h, 1, 1, dtype=torch.float64)
    tiles = Tiles(q, k, mask, causal, SCREEN_BLOCK_ELEMENTS)
    scratch = Scratch(tiles.block_elements(), torch.bfloat16, 1)
    exact = Scratch(tiles.block_elements(), q.dtype, 1)
    groups = list(tiles.groups())
    workers = workers_for(q.device, len(groups))
    runs = [groups[w * len(groups) // workers:(w + 1) * len(groups) // workers]
            for w in range(workers)]
    failed = []

    def run(where: list[tuple[int, slice]]) -> None:
        for bi, heads in where:
            k_g = k[bi, heads]
            k_norm[bi, heads] = torch.linalg.vector_norm(k_g, dim=-1).amax(dim=-1).view(-1, 1, 1)
            q_norm[bi, heads] = torch.linalg.vector_norm(q[bi, heads], dim=-1, keepdim=True)
            k16 = k_g.bfloat16()
            for i, (q_blk, est_blk) in enumerate(zip(*tiles.split(bi, heads, q, est))):
                z = tiles.hide_masked(scratch.scores(0, q_blk.bfloat16(),
                                                     k16[:, :tiles.n_keys(i)]), bi, heads, i)
                est_blk.copy_(native.bf16_row_entropy(z, scale,
                                                      limit=tiles.causal_counts(i, z.shape[1])))
        # the run's rows: consecutive (batch, head) pairs, (heads, Nq, ·)
        first, last = where[0], where[-1]
        lo_row, hi_row = first[0] * h + first[1].start, last[0] * h + last[1].stop
        rows = slice(lo_row, hi_row)
        approx, top, sd = est.flatten(0, 1)[rows].double().split(1, dim=-1)
        # |z̃ - fl(z)| <= eps on every key of a row (attnscale.kernels.peak.screen_error), so
        # |H - H̃| <= eps e^eps (σ̃ + eps) (module doc); a keyless row is 0 either way
        eps = scale * peak.screen_error(q_norm.flatten(0, 1)[rows], k_norm.flatten(0, 1)[rows], d)
        bound = eps * torch.exp(eps) * (sd + eps) + SCREEN_SLACK * (1 + approx.abs())
        if not bool(torch.isfinite(bound).all()):
            failed.append(True)              # a NaN or inf in q or k, or a bfloat16 overflow
            return
        keyless = torch.isneginf(top)
        bound = torch.where(keyless, 0.0, bound)
        ent.flatten(0, 1)[rows] = approx.to(q.dtype)
        lse.flatten(0, 1)[rows] = torch.where(keyless, 0.0, top).to(q.dtype)  # a stand-in
        need = exact_where(approx - bound, approx + bound).squeeze(-1)   # (heads, Nq)
        if not bool(need.any()):
            return
        need = need.view(-1, n_q)
        for bi, heads in where:
            k_g = k[bi, heads]
            row0 = bi * h + heads.start - lo_row
            need_g = need[row0:row0 + heads.stop - heads.start]
            for i, (q_blk, ent_blk, lse_blk, need_blk) in enumerate(zip(
                    *tiles.split(bi, heads, q, ent, lse), need_g.split(tiles.rows, dim=1))):
                if bool(need_blk.any()):
                    _exact_rows(q_blk, k_g[:, :tiles.n_keys(i)], tiles, bi, heads, i, scale,
                                need_blk, tiles.causal_counts(i, q_blk.shape[1]), ent_blk,
                                lse_blk, exact)

    team_map(run, [r for r in runs if r], workers)
    return None if failed else (ent, lse)


def _exact_rows(q_blk: Tensor, k_g: Tensor, tiles: Tiles, bi: int, heads: slice, i: int,
                scale: float, need: Tensor, limit: Tensor | None, ent_blk: Tensor,
                lse_blk: Tensor, scratch: Scratch) -> None:
    """(H, lse) in float32, as the unscreened path forms them, of the rows of block i that
    ``need`` (h, r) selects, into ``ent_blk`` and ``lse_blk`` (h, r, 1): gathered, or the whole
    block where most of its rows need it.  q_blk (h, r, d), k_g (h, n_k, d)."""
    if int(need.sum()) * 2 > need.numel():
        z = scratch.scores(0, q_blk, k_g, scale)
        rows = native.row_entropy(tiles.hide_masked(z, bi, heads, i), limit=limit)
        ent_blk.copy_(rows[..., :1])
        lse_blk.copy_(rows[..., 1:])
        return
    for hh in range(q_blk.shape[0]):
        idx = need[hh].nonzero().squeeze(-1)
        if idx.numel() == 0:
            continue
        z = _scores(q_blk[hh, idx].unsqueeze(0), k_g[hh:hh + 1].transpose(1, 2), scale)  # (1, c, n)
        if tiles.hidden is not None:
            i0, head = i * tiles.rows, heads.start + hh
            hid = block_hidden(tiles.hidden, bi, slice(head, head + 1), i0, i0 + q_blk.shape[1],
                               k_g.shape[1])
            z.masked_fill_(hid[:, idx] if hid.shape[1] > 1 else hid, float("-inf"))
        rows = native.row_entropy(z, limit=None if limit is None else limit[idx])
        ent_blk[hh, idx] = rows[0, :, :1].to(ent_blk.dtype)
        lse_blk[hh, idx] = rows[0, :, 1:].to(lse_blk.dtype)


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
    team_map(group, groups, workers_for(q.device, len(groups)))
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
