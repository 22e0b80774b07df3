"""Softmax attention with a data-dependent logit bias, softmax(scale · q kᵀ + bias) v, without the
(B, H, Nq, Nk) logits, forward and backward: a blockwise kernel on PyTorch ops (CPU and CUDA).

Two biases, each a small strategy object the kernel calls per block of rows:

* :class:`ForgetBias`, Forgetting Attention's c_i − c_j with c the cumulative sum of the log
  forget gates (Lin et al. 2025, arXiv 2503.02130), one per head;
* :class:`SelectBias`, selective attention's −F_ij, F_ij = Σ_{j<k<i} max(0, z⁰_kj) over the
  first head's logits z⁰ (Leviathan et al. 2024, arXiv 2410.02703), shared by the heads.

A block is every head of one batch element by a run of queries, against the keys they can see
(all, or the causal prefix up to the block's last query), so selective attention's first head
is in every block, and the blocks of one batch element run in order: the forward carries the
column sums of the selection S from one block to the next (F of a block's first row), and the
backward carries the sums of F's gradient the other way.  Batch elements run side by side on
the CPU.  The backward recomputes each block's logits and weights from q and k (nothing of size
Nq x Nk is saved): with dZ = P ∘ (dP − δ), the bias receives dZ, summed over the rows and
columns of each head (FoX: ∂L/∂c_m = Σ_j dZ_mj − Σ_i dZ_im) or over the heads and along the
query axis (selective: ∂L/∂S_kj = Σ_{i>k} ∂L/∂(−F_ij) ... through max(0, ·) into z⁰, hence into
the first head's q and k).  Extra memory is a few (H, rows, Nk) blocks.

:func:`dense_bias` writes either bias out, (B, H|1, Nq, Nk), for the materialised pipeline
(``trace=True``) and the tests.  :func:`bias_row_stats` reduces the biased logits to row
statistics block by block, for the pipeline's observers (the monitor, the guard).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnscale.kernels.rowsubset import block_hidden
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Scratch
from attnscale.precision import all_finite, upcast
from attnscale.workers import workers_for

# Logits in one block: 2^19 (2 MiB of float32), every head of a batch element by as many
# queries as fit (64 at H = 8, Nk = 1024), as the soft-cap kernel's blocks.
BIASED_BLOCK_ELEMENTS = 2**19


@dataclass
class ForgetBias:
    """FoX's bias c_i − c_j, c (B, H, N) the cumulative log forget gates at positions 0..N-1
    (N >= Nq and N >= Nk, top-left aligned), float64 for float64 inputs and float32 else."""

    c: Tensor

    def dense(self, n_q: int, n_k: int) -> Tensor:
        """c_i − c_j as (B, H, Nq, Nk)."""
        return self.c[..., :n_q, None] - self.c[..., None, :n_k]


@dataclass
class SelectBias:
    """Selective attention's −F from the first head's scaled logits: ``mask`` the keys each
    query attends (bool, broadcastable to (B, H, Nq, Nk), None for all; the first head's mask
    is read); causality only limits the attention, since S reads pairs j < k anyway.
    ``budget``: context pruning, each query keeps at most this many keys (:func:`pruned`)."""

    mask: Tensor | None
    budget: int | None = None

    def dense(self, q: Tensor, k: Tensor, scale: float) -> Tensor:
        """−F as (B, 1, Nq, Nk) from prepared q (B, H, Nq, d), k (B, H, Nk, d)."""
        z0 = (q[:, 0] * scale) @ k[:, 0].transpose(-2, -1)                  # (B, Nq, Nk)
        s = selection(z0, self.valid_dense(z0.shape[-2], z0.shape[-1], z0.device))
        return -(s.cumsum(-2) - s).unsqueeze(1)                            # exclusive prefix sum

    def valid_dense(self, n_q: int, n_k: int, device) -> Tensor:
        """Where S may be nonzero, (B|1, Nq, Nk): 1 <= j < k and query k attends key j."""
        valid = self._valid(0, n_q, n_k, device)
        if self.mask is not None:
            m = self.mask.reshape((1,) * (4 - self.mask.dim()) + tuple(self.mask.shape))
            valid = valid & m[:, 0]
        return valid

    @staticmethod
    def _valid(i0: int, rows: int, n_k: int, device) -> Tensor:
        """1 <= j < k for queries k = i0 .. i0 + rows - 1: bool (rows, n_k)."""
        j = torch.arange(n_k, device=device)
        k = torch.arange(i0, i0 + rows, device=device).unsqueeze(-1)
        return (j < k) & (j >= 1)


def pruned(f: Tensor, hidden: Tensor, budget: int) -> Tensor:
    """Context pruning (Leviathan et al. 2024, Section 4): the keys a query drops, bool like
    ``f``.  Each row of F (..., n) keeps the ``budget`` keys it attends (``hidden`` False) that
    were selected least, ties going to the most recent key; the others are pruned."""
    n = f.shape[-1]
    if n <= budget:
        return torch.zeros_like(hidden, dtype=torch.bool).expand(f.shape)
    order = torch.sort(f.masked_fill(hidden, math.inf).flip(-1), dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=f.device)
                                            .expand_as(order))
    return rank.flip(-1) >= budget                                       # rank of each key


def selection(z0: Tensor, valid: Tensor) -> Tensor:
    """S = max(0, z⁰) where ``valid``, else 0 (a NaN logit where it is not valid stays out)."""
    return torch.where(valid, z0.clamp(min=0.0), 0.0)


Bias = ForgetBias | SelectBias


def nan_query_rows(out: Tensor, q: Tensor, finite: bool | None = None) -> Tensor:
    """``out`` (B, H, Nq, d_v) with NaN on every row whose query (B, H, Nq, ·) is not finite: a
    NaN there enters every logit of the row, as in the materialised formula, where SDPA's fused
    CPU kernel would return a finite row.  One min/max pass over q when everything is finite,
    none when the caller knows (``finite``: whether every entry of q is finite)."""
    if all_finite(q) if finite is None else finite:
        return out
    return out.masked_fill(~torch.isfinite(q).all(dim=-1, keepdim=True), math.nan)


def dense_bias(bias: Bias, q: Tensor, k: Tensor, scale: float) -> Tensor:
    """The bias of prepared q, k as a dense tensor broadcastable to (B, H, Nq, Nk)."""
    if isinstance(bias, ForgetBias):
        return bias.dense(q.shape[-2], k.shape[-2]).to(q.dtype)
    return bias.dense(q, k, scale)


def biased_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Bias,
                     mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(scale · q kᵀ + bias, masked) v, blockwise: (B, H, Nq, d_v) in v's dtype.

    q, k (B, H, N·, d) float32 or float64 (half v is computed in float32); ``mask`` bool
    (True = attend) broadcastable to (B, H, Nq, Nk), leaving every query a key; ``causal``
    top-left.  FoX's c receives its gradient through the kernel; selective attention's reaches
    the first head's q and k.
    """
    c = bias.c if isinstance(bias, ForgetBias) else None
    out = _BiasedAttention.apply(q.contiguous(), k.contiguous(),
                                 upcast(v).to(q.dtype).contiguous(), mask, float(scale), causal,
                                 BIASED_BLOCK_ELEMENTS, bias, c)
    return out.to(v.dtype)


class _Blocks:
    """How the kernel cuts one batch element's (H, Nq) rows: ``rows`` queries per block."""

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                 block_elements: int):
        self.n_b, self.n_h, self.n_q, _ = q.shape
        self.n_k, self.causal = k.shape[-2], causal
        self.rows = max(1, min(self.n_q, block_elements // max(self.n_h * self.n_k, 1)))
        self.hidden = None
        if mask is not None:
            self.hidden = ~mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        # Under causality, which keys of a block's diagonal square are future (u >= t for row t
        # and key i0 + 1 + u): one mask for every block, from a comparison (a small op on one
        # thread; triu_ on 2 threads took 6 ms at load 3, waking its OpenMP team)
        self.future = None
        if causal:
            at = torch.arange(self.rows, device=q.device)
            self.future = at >= at.unsqueeze(-1)                            # (rows, rows)

    def starts(self) -> range:
        return range(0, self.n_q, self.rows)

    def elements(self) -> int:
        """Logits in the largest block: H · rows · Nk."""
        return self.n_h * self.rows * self.n_k

    def n_keys(self, i0: int, i1: int) -> int:
        """Keys rows i0..i1-1 can see: all, or the causal prefix min(Nk, i1)."""
        return min(self.n_k, i1) if self.causal else self.n_k

    def hide(self, z: Tensor, b: int, i0: int) -> Tensor:
        """Masked and (causally) future keys of the block at -inf, in place; z (H, r, n_k)."""
        r, n_k = z.shape[-2], z.shape[-1]
        if self.hidden is not None:
            z.masked_fill_(block_hidden(self.hidden, b, slice(None), i0, i0 + r, n_k), -math.inf)
        if self.causal and i0 + 1 < n_k:  # keys j > i0 + t, all within the diagonal square
            z[..., i0 + 1:].masked_fill_(self.future[:r, :n_k - i0 - 1], -math.inf)
        return z

    def row_blocks(self, b: int, *tensors: Tensor) -> list[tuple]:
        """(i0, n_k, blocks of each (B, H, Nq, ·) tensor) for batch element b's row blocks in
        order: (H, r, ·) views from one ``split`` per tensor."""
        parts = [t[b].split(self.rows, dim=1) for t in tensors]
        return [(i0, self.n_keys(i0, min(i0 + self.rows, self.n_q)), *views)
                for i0, *views in zip(self.starts(), *parts)]


class _ForgetBlocks:
    """FoX's c_i − c_j per block, from c split into float32 halves c = hi + lo (exact for
    float64 c), so a bias far from zero keeps float32's precision near the diagonal: hi_i − hi_j
    is exact where c_i and c_j are within a factor 2 (Sterbenz), the keys that carry weight."""

    ordered = False

    def __init__(self, c: Tensor, work: torch.dtype):
        # Every pass over c (B, H, N) runs in the worker of its batch element: on 2 threads a
        # whole-c op (2^15 values at B4 H8 N1024) would wake an OpenMP team of its own.
        self.c, self.work = c.detach(), work
        self.halves: dict[int, tuple[Tensor, Tensor | None]] = {}         # b -> (hi, lo)
        self.dc: Tensor | None = None                                      # ∂L/∂c, (B, H, N)

    def _halves(self, b: int) -> tuple[Tensor, Tensor | None]:
        """Batch element b's c = hi + lo in the working precision (lo None when c is in it)."""
        got = self.halves.get(b)
        if got is None:
            c = self.c[b]                                                  # (H, N)
            hi = c.to(self.work)
            lo = (c - hi.to(c.dtype)).to(self.work) if c.dtype != self.work else None
            got = self.halves[b] = (hi, lo)
        return got

    def start(self, b: int, like: Tensor) -> None:
        return None

    # Scratch buffers add() writes into beside the logits' (buffer 1: c_i − c_j).
    temporaries = 1

    def add(self, s: Tensor, b: int, i0: int, state: None, scratch: Scratch) -> None:
        """Add the block's c_i − c_j to s (H, r, n_k) in place: (hi_i − hi_j + lo_i) − lo_j, the
        first difference exact near the diagonal, in this thread's scratch buffer 1."""
        r, n_k = s.shape[-2], s.shape[-1]
        hi, lo = self._halves(b)
        t = torch.sub(hi[:, i0:i0 + r, None], hi[:, None, :n_k],
                      out=scratch.block(1, s.shape))                          # (H, r, n_k)
        if lo is not None:
            t.add_(lo[:, i0:i0 + r, None]).sub_(lo[:, None, :n_k])
        s.add_(t)

    def prune(self, z: Tensor, state: None) -> Tensor:
        return z

    def begin_backward(self) -> None:
        """∂L/∂c in c's dtype, each batch element's rows zeroed by its worker (begin_element)."""
        self.dc = torch.empty(self.c.shape, dtype=self.c.dtype, device=self.c.device)

    def begin_element(self, b: int) -> None:
        """Before batch element b's first block in the backward: its ∂L/∂c rows at 0."""
        self.dc[b].zero_()

    def backward(self, dz: Tensor, b: int, i0: int) -> None:
        # c_m enters as + on row m and as − on column m: ∂L/∂c_m = Σ_j dZ_mj − Σ_i dZ_im.
        r, n_k = dz.shape[-2], dz.shape[-1]
        self.dc[b, :, i0:i0 + r] += dz.sum(-1)
        self.dc[b, :, :n_k] -= dz.sum(-2)


class _SelectBlocks:
    """Selective attention's −F per block, carrying Σ_{k < block} S_kj from block to block."""

    ordered = True

    def __init__(self, bias: SelectBias, n_k: int):
        self.budget = bias.budget
        self.hidden = None
        if bias.mask is not None:
            m = bias.mask.reshape((1,) * (4 - bias.mask.dim()) + tuple(bias.mask.shape))
            self.hidden = ~m[:, 0]                                           # (B|1, Nq|1, Nk|1)
        self.n_k = n_k
        self.carries: dict[tuple[int, int], Tensor] = {}                     # (b, i0) -> carry

    def selected(self, z0: Tensor, b: int, i0: int) -> Tensor:
        """S of the block's first-head logits z0 (r, n_k): max(0, z⁰_kj) where 1 <= j < k (k =
        i0 + row) and query k attends key j, else 0 (a NaN logit where S is not valid stays
        out), as a new tensor.  A clamp and a fill above a diagonal: a boolean ``where`` takes
        ten times as long on the CPU."""
        r, n_k = z0.shape
        sel = z0.clamp(min=0.0).tril_(i0 - 1)                                # j < k
        sel[:, :1] = 0.0                                                     # j >= 1
        if self.hidden is not None:
            h = self.hidden[b if self.hidden.shape[0] > 1 else 0]
            h = h[i0:i0 + r] if h.shape[0] > 1 else h
            sel.masked_fill_(h[:, :n_k] if h.shape[1] > 1 else h, 0.0)
        return sel

    def start(self, b: int, like: Tensor) -> tuple[Tensor, None]:
        """A batch element's state before its first block: the carry Σ_{k < i0} S_kj, zeros
        (Nk,), and the last block's F (none yet).  Each batch element (a worker thread) has its
        own."""
        return like.new_zeros(self.n_k), None

    temporaries = 0

    def add(self, s: Tensor, b: int, i0: int, state: tuple[Tensor, Tensor | None],
            scratch: Scratch) -> tuple[Tensor, Tensor]:
        """Subtract the block's F from s (H, r, n_k) in place; return the state for the next
        block: the carry, and this block's F (r, n_k)."""
        carry, _ = state
        n_k = s.shape[-1]
        self.carries[b, i0] = carry.clone()
        f, total = self._exclusive(self.selected(s[0], b, i0), carry[:n_k])
        carry[:n_k] += total
        s.sub_(f)
        return carry, f

    @staticmethod
    def _exclusive(sel: Tensor, carry: Tensor) -> tuple[Tensor, Tensor]:
        """F = Σ_{k' < k} S_k'j + carry over the block's rows k, and Σ_k S_kj (the next carry's
        increment)."""
        cs = sel.cumsum(0)
        total = cs[-1].clone()
        return cs.sub_(sel).add_(carry), total

    def prune(self, z: Tensor, state: tuple[Tensor | None, Tensor]) -> Tensor:
        """With a budget, the block's pruned keys at -inf, in place: z (H, r, n_k) masked, whose
        first head's hidden keys are the ones a row does not attend; F from ``state``."""
        if self.budget is not None:
            z.masked_fill_(pruned(state[1], torch.isneginf(z[0]), self.budget), -math.inf)
        return z

    def recompute(self, s: Tensor, b: int, i0: int) -> tuple[Tensor, Tensor]:
        """In the backward: subtract the block's F from s (H, r, n_k) in place; return S
        (r, n_k), whose positive entries pass the gradient through max(0, ·), and F."""
        sel = self.selected(s[0], b, i0)
        f, _ = self._exclusive(sel, self.carries[b, i0][:s.shape[-1]])
        s.sub_(f)
        return sel, f


def _softmax_(z: Tensor) -> Tensor:
    """softmax over the last dimension of ``z``, in place (the same values as torch.softmax, in
    about half its time on a 2 MiB block: no new block to fault in)."""
    return torch.ops.aten._softmax.out(z, -1, False, out=z)


def _biased_blocks(q: Tensor, k: Tensor, scale: float, blocks: _Blocks, bias, b: int,
                   scratch: Scratch):
    """Batch element b's blocks in order, as ``(i0, i1, n_k, z)``: z (H, i1 − i0, n_k) the
    biased, masked logits of queries i0..i1-1 against the keys they can see, in this thread's
    scratch buffer 0 (the scale applied by the matmul itself)."""
    state = bias.start(b, q)
    k_b = k[b]
    for i0, n_k, q_blk in blocks.row_blocks(b, q):
        s = scratch.scores(0, q_blk, k_b[:, :n_k], scale)                   # (H, r, n_k)
        state = bias.add(s, b, i0, state, scratch)
        yield i0, i0 + q_blk.shape[1], n_k, bias.prune(blocks.hide(s, b, i0), state)


class _BiasedAttention(torch.autograd.Function):
    """softmax(scale q kᵀ + bias) v with ``strategy`` the bias's blocks; see the module doc.

    Every pass over a whole (B, H, N, ·) tensor runs inside the batch elements' workers, block
    by block (δ, the zero fill of dK and dV, the scale of dQ and dK in their matmuls): on 2
    threads a torch op of its own would open an OpenMP team, which stalls whenever the other
    core is taken (4-16 ms an op at load 4, against 0.4-1.5 ms on one thread)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                causal: bool, block_elements: int, given: Bias, c: Tensor | None) -> Tensor:
        # c: FoX's cumulative log forget gates, an input here so that it receives a gradient
        blocks = _Blocks(q, k, mask, causal, block_elements)
        if c is not None:
            bias = _ForgetBlocks(c, q.dtype)
        else:
            bias = _SelectBlocks(given, blocks.n_k)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])                        # (B, H, Nq, d_v)
        scratch = Scratch(blocks.elements(), q.dtype, 1 + bias.temporaries, q.device)

        def element(b: int) -> None:
            for i0, i1, n_k, z in _biased_blocks(q, k, scale, blocks, bias, b, scratch):
                torch.bmm(_softmax_(z), v[b, :, :n_k], out=out[b, :, i0:i1])

        team_map(element, range(blocks.n_b), workers_for(q.device, blocks.n_b))
        ctx.save_for_backward(q, k, v, out, mask, c)
        ctx.args = (scale, causal, block_elements, bias)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, out, mask, c = ctx.saved_tensors
        scale, causal, block_elements, bias = ctx.args
        blocks = _Blocks(q, k, mask, causal, block_elements)
        d_out = d_out.contiguous()
        dq = torch.empty_like(q)
        # dK and dV accumulate transposed: dKᵀ += Qᵀ dZ reads dZ untransposed (a faster gemm).
        dk_t = k.new_empty(*k.shape[:2], k.shape[-1], k.shape[-2])          # (B, H, d, Nk)
        dv_t = v.new_empty(*v.shape[:2], v.shape[-1], v.shape[-2])          # (B, H, d_v, Nk)
        scratch = Scratch(blocks.elements(), q.dtype, 2, q.device)
        if not bias.ordered:
            bias.begin_backward()

        def element(b: int) -> None:
            k_b, v_b, dk_b, dv_b = k[b], v[b], dk_t[b].zero_(), dv_t[b].zero_()
            if not bias.ordered:
                bias.begin_element(b)
            after = None  # selective: Σ over the rows after the block of ∂L/∂F, per key
            for i0, n_k, q_blk, do, out_blk, dq_blk in reversed(
                    blocks.row_blocks(b, q, d_out, out, dq)):
                k_p, v_p = k_b[:, :n_k], v_b[:, :n_k]                        # (H, n_k, ·)
                s = scratch.scores(0, q_blk, k_p, scale)                     # (H, r, n_k)
                if bias.ordered:
                    sel, f = bias.recompute(s, b, i0)
                    state = (None, f)
                else:
                    state = bias.add(s, b, i0, None, scratch)  # before dP takes buffer 1
                p = _softmax_(bias.prune(blocks.hide(s, b, i0), state))
                delta = torch.linalg.vecdot(do, out_blk).unsqueeze_(-1)     # δ = Σ_j P dP
                dv_b[..., :n_k].baddbmm_(do.transpose(1, 2), p)             # dVᵀ += dOᵀ P
                dz = scratch.scores(1, do, v_p)                              # dP = dO Vᵀ
                dz.sub_(delta).mul_(p)                                       # dZ = P ∘ (dP − δ)
                if bias.ordered:
                    after = _select_backward(dz, sel, after, blocks.n_k)
                else:
                    bias.backward(dz, b, i0)
                torch.baddbmm(dq_blk, dz, k_p, beta=0.0, alpha=scale,
                              out=dq_blk)                                    # dQ = s dZ K
                dk_b[..., :n_k].baddbmm_(q_blk.transpose(1, 2), dz,
                                         alpha=scale)                        # dKᵀ += s Qᵀ dZ

        team_map(element, range(blocks.n_b), workers_for(q.device, blocks.n_b))
        d_c = None if c is None else bias.dc
        return (dq, dk_t.transpose(-2, -1), dv_t.transpose(-2, -1), None, None, None, None,
                None, d_c)


def _select_backward(dz: Tensor, sel: Tensor, after: Tensor | None, n_keys: int) -> Tensor:
    """Selective attention's gradient in one block, rows processed last to first: F's gradient
    is −Σ_h dZ; the block's rows k pass it on to S_kj summed over the later rows i > k (those in
    the block and ``after`` it), then through max(0, ·) (where S, ``sel``, is positive) into the
    first head's logits, added to ``dz[0]`` in place.  Returns the new ``after`` (this block's
    rows included)."""
    n_k = dz.shape[-1]
    if after is None:
        after = dz.new_zeros(n_keys)
    d_f = dz.sum(0).neg_()                                                   # ∂L/∂F, (r, n_k)
    total = d_f.flip(0).cumsum(0).flip(0)                                    # Σ_{i ≥ k}
    d_s = (total - d_f).add_(after[:n_k])                                    # Σ_{i > k}
    after[:n_k] += total[0]
    dz[0] += torch.where(sel > 0, d_s, 0.0)
    return after


def bias_row_stats(q: Tensor, k: Tensor, scale: float, bias: Bias, mask: Tensor | None,
                   causal: bool, rows: Tensor, row_stats: Callable[..., Tensor]) -> None:
    """Fill ``rows`` (float64 (B, H, Nq, columns)) with ``row_stats`` (:func:`attnscale.stats.
    row_stats`) of every query's biased, masked logits, block by block as the kernel forms them
    (one q kᵀ; the pipeline's observers ask for it).  ``mask`` is the keys each query attends
    (a query without any gets count 0); q, k prepared, (B, H, N·, d)."""
    with torch.no_grad():
        q, k = q.detach(), k.detach()
        blocks = _Blocks(q, k, mask, causal, BIASED_BLOCK_ELEMENTS)
        strategy = (_ForgetBlocks(bias.c, q.dtype) if isinstance(bias, ForgetBias)
                    else _SelectBlocks(bias, blocks.n_k))
        workers = workers_for(q.device, blocks.n_b)
        threads = 1 if workers > 1 else None  # the row kernel inside a worker: one thread
        scratch = Scratch(blocks.elements(), q.dtype, 1 + strategy.temporaries, q.device)

        def element(b: int) -> None:
            for i0, i1, _, z in _biased_blocks(q, k, scale, blocks, strategy, b, scratch):
                rows[b, :, i0:i1].copy_(row_stats(z, threads=threads))

        team_map(element, range(blocks.n_b), workers)
