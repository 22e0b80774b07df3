"""Blockwise attention statistics per head, without the (B, H, Nq, Nk) attention matrix.

:func:`head_stats` scores ``block`` queries at a time against their keys and reduces each row with
:func:`attnscale.stats.row_stats` (the compiled kernel where it runs, PyTorch elsewhere);
:class:`HeadStats` holds per-head sums,
so blocks, calls and forward passes merge exactly.  Masked keys are excluded and a query with no
key is not counted; an additive float mask's entries at or below
:data:`~attnscale.pipeline.MASKED_BIAS` mark masked keys, finite entries above it are logit biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnscale.errors import check_int
from attnscale.mechanisms.base import inv_sqrt
from attnscale.pipeline import MASKED_BIAS, Scale
from attnscale.precision import work_dtype
from attnscale.stats import columns, row_mass, row_stats
from attnscale.workers import parallel_map, workers_for

# Queries per statistics block: the monitor's extra memory is a few (B, H, DEFAULT_BLOCK, N)
# float32 tensors, e.g. 4 MiB each at B=1, H=4, N=2048.
DEFAULT_BLOCK = 128


@dataclass
class HeadStats:
    """Per-head sums over every (batch, query) row seen so far; each field has shape (H,), float64.

    Sums rather than means, so that blocks, calls and forward passes merge exactly.
    """

    queries: Tensor           # rows with at least one unmasked key
    entropy_sum: Tensor       # sum of H(p) over those rows, nats
    entropy_min: Tensor       # smallest H(p), nats (+inf before any row)
    max_weight_sum: Tensor    # sum of max_i p_i
    logit_std_sum: Tensor     # sum of the per-row std of the unmasked logits
    logit_absmax: Tensor      # largest |z| over unmasked logits
    jacobian_fro_sum: Tensor  # sum of ||diag(p) - p p^T||_F (the normaliser's, attnscale.stats)
    logit_max: Tensor         # largest signed z over unmasked logits (-inf before any row)
    # Σ_i p_i over the keys, summed over rows: 1 per row under softmax, 1 - the sink's weight
    # under a sink, Σ σ(z_i) under sigmoid (attnscale.stats.row_mass).
    mass_sum: Tensor = None
    sink_mass_sum: Tensor = None  # the weight left on the sink, summed over rows (0 without one)
    gate_sum: Tensor = None       # the output gate's values, summed (1 per row without a gate)
    gate_count: Tensor = None     # how many gate values gate_sum adds up

    def __post_init__(self):
        for name in ("mass_sum", "gate_sum", "gate_count"):  # softmax without a gate
            if getattr(self, name) is None:
                setattr(self, name, self.queries.clone())
        if self.sink_mass_sum is None:
            self.sink_mass_sum = torch.zeros_like(self.queries)

    @classmethod
    def zeros(cls, n_heads: int) -> HeadStats:
        z = torch.zeros(n_heads, dtype=torch.float64)
        return cls(z, z.clone(), torch.full_like(z, math.inf), z.clone(), z.clone(), z.clone(),
                   z.clone(), torch.full_like(z, -math.inf))

    @classmethod
    def from_rows(cls, rows: Tensor, mass: Tensor | None = None,
                  sink: bool = False) -> HeadStats:
        """Per-head sums of per-row statistics (B, H, Nq, len(ROW_STATS_COLUMNS)) of
        :func:`attnscale.stats.row_stats`; rows whose count is 0 (no key to attend) are left out.
        ``mass`` (B, H, Nq): each row's key mass (:func:`attnscale.stats.row_mass`; 1 when None,
        softmax); ``sink``: the rest of each row's weight is the sink's."""
        col = columns(rows)
        ok = col["count"] > 0

        def total(x: Tensor) -> Tensor:
            return torch.where(ok, x, 0.0).sum(dim=(0, 2), dtype=torch.float64)

        def extreme(x: Tensor, fill: float, reduce) -> Tensor:
            return reduce(torch.where(ok, x, fill), dim=(0, 2)).double()

        return cls(
            queries=ok.sum(dim=(0, 2), dtype=torch.float64),
            entropy_sum=total(col["entropy"]),
            entropy_min=extreme(col["entropy"], math.inf, torch.amin),
            max_weight_sum=total(col["max_weight"]),
            logit_std_sum=total(col["logit_std"]),
            logit_absmax=extreme(col["logit_absmax"], 0.0, torch.amax),
            jacobian_fro_sum=total(col["jacobian_fro"]),
            logit_max=extreme(col["logit_max"], -math.inf, torch.amax),
            mass_sum=None if mass is None else total(mass),
            sink_mass_sum=total(1.0 - mass) if sink and mass is not None else None,
        )

    def with_gate(self, gate: Tensor) -> HeadStats:
        """These statistics with the output gate's values (B, H, Nq, 1 or d) as the gate's."""
        g = gate.detach().double()
        return replace(self, gate_sum=g.sum(dim=(0, 2, 3)).cpu(),
                       gate_count=torch.full_like(self.queries, float(g[:, 0].numel())))

    def merge(self, other: HeadStats) -> HeadStats:
        """Statistics over the rows of both."""
        return HeadStats(
            self.queries + other.queries, self.entropy_sum + other.entropy_sum,
            torch.minimum(self.entropy_min, other.entropy_min),
            self.max_weight_sum + other.max_weight_sum, self.logit_std_sum + other.logit_std_sum,
            torch.maximum(self.logit_absmax, other.logit_absmax),
            self.jacobian_fro_sum + other.jacobian_fro_sum,
            torch.maximum(self.logit_max, other.logit_max), self.mass_sum + other.mass_sum,
            self.sink_mass_sum + other.sink_mass_sum, self.gate_sum + other.gate_sum,
            self.gate_count + other.gate_count)

    def pooled(self) -> HeadStats:
        """All heads together as one: every field of shape (1,)."""
        def total(t: Tensor) -> Tensor:
            return t.sum(0, keepdim=True)
        return HeadStats(total(self.queries), total(self.entropy_sum),
                         self.entropy_min.amin(0, keepdim=True), total(self.max_weight_sum),
                         total(self.logit_std_sum), self.logit_absmax.amax(0, keepdim=True),
                         total(self.jacobian_fro_sum), self.logit_max.amax(0, keepdim=True),
                         total(self.mass_sum), total(self.sink_mass_sum), total(self.gate_sum),
                         total(self.gate_count))

    def means(self) -> dict[str, list[float]]:
        """The record statistics per head (means over rows); NaN for a head that saw no row."""
        n = self.queries
        safe = n.clamp(min=1)
        none = n == 0
        out = {"queries": n,
               "entropy_mean": self.entropy_sum / safe, "entropy_min": self.entropy_min,
               "max_weight_mean": self.max_weight_sum / safe,
               "logit_std": self.logit_std_sum / safe, "logit_absmax": self.logit_absmax,
               "jacobian_fro_mean": self.jacobian_fro_sum / safe, "logit_max": self.logit_max,
               "mass_mean": self.mass_sum / safe, "sink_mass_mean": self.sink_mass_sum / safe,
               "gate_mean": self.gate_sum / self.gate_count.clamp(min=1)}
        return {k: torch.where(none, math.nan, v).tolist() if k != "queries" else v.tolist()
                for k, v in out.items()}


def _rows(t: Tensor | float | None, i0: int, i1: int) -> Tensor | float | None:
    """Rows ``i0:i1`` of a tensor broadcastable to (..., Nq, X); broadcast (size-1) rows stay."""
    if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] > 1:
        return t[..., i0:i1, :]
    return t


def head_stats(q: Tensor, k: Tensor, *, scale: Scale | None = None,
               cap: float | None = None, mask: Tensor | None = None, causal: bool = False,
               causal_offset: int = 0, block: int = DEFAULT_BLOCK) -> HeadStats:
    """Per-head statistics of ``softmax(z)``, ``z = cap · tanh(scale · q kᵀ / cap)``, blockwise.

    Args:
        q: queries (B, H, Nq, d); k: keys (B, Hk, Nk, d) with ``H % Hk == 0`` (grouped-query
            attention: query head h reads key head ``h // (H // Hk)``, as SDPA's ``enable_gqa``).
        scale: float, or tensor broadcastable to (B, H, Nq, 1); None means ``1/sqrt(d)``.
        cap: soft-cap c, or None for no cap.
        mask: bool (True = attend) or additive float, broadcastable to (B, H, Nq, Nk).
        causal: query i attends key j only when ``j <= i + causal_offset`` (0 = SDPA's top-left
            alignment, ``Nk - Nq`` = bottom-right).
        block: queries per block; memory is O(T · B · H · block · Nk) instead of
            O(B · H · Nq · Nk), with T = ``torch.get_num_threads()`` blocks in flight on the CPU.
    Returns:
        :class:`HeadStats` with one entry per query head.
    """
    return _head_stats(q, k, scale=scale, cap=cap, mask=mask, causal=causal,
                       causal_offset=causal_offset, block=check_int("block", block, minimum=1))


def _head_stats(q: Tensor, k: Tensor, *, scale: Scale | None = None, cap: float | None = None,
                mask: Tensor | None = None, causal: bool = False, causal_offset: int = 0,
                block: int, offset: float | Tensor = 0.0, normaliser: str = "softmax",
                sink: Tensor | None = None) -> HeadStats:
    """:func:`head_stats` with ``block`` already validated (by the caller, where it entered);
    ``offset`` (float or broadcastable to (B, H, Nq, 1)) is added to the logits before the cap,
    and the weights are the ``normaliser``'s (``sink``: the per-head sink logits)."""
    with torch.no_grad():
        # float32 at least, like SDPA's accumulation; float64 inputs stay float64.
        work = work_dtype(q.dtype)
        q, k = q.detach().to(work), k.detach().to(work)
        if scale is None:
            scale = inv_sqrt(q.shape[-1])
        elif isinstance(scale, Tensor):
            scale = scale.detach().to(work)
        # Fold the temperature (and 1/cap) into q: one multiply of (B, H, Nq, d) instead of one
        # pass over every (B, H, block, Nk) block.
        q = q * (scale if cap is None else scale / cap)
        n_heads = q.shape[-3]
        if k.shape[-3] != n_heads:  # GQA: an O(Nk d) copy, never O(N^2)
            k = k.repeat_interleave(n_heads // k.shape[-3], dim=-3)
        bias = None
        if mask is not None and mask.dtype != torch.bool:  # additive: "masked" + a logit bias
            bias = mask.detach().to(work)
            mask = bias > MASKED_BIAS
            bias = torch.where(mask, bias, 0.0)
            if not bool(bias.any()):
                bias = None
        if isinstance(offset, Tensor):
            offset = offset.detach().to(work)
        if cap is not None and (isinstance(offset, Tensor) or offset != 0.0):
            offset = offset / cap  # it joins the scaled logits inside tanh
        if sink is not None:
            sink = sink.detach().to(work)
        kt = k.transpose(-2, -1)  # (B, H, d, Nk)
        starts = range(0, q.shape[-2], block)
        workers = workers_for(q.device, len(starts))
        # Blocks are independent: with several threads, each computes the logits and statistics
        # of whole blocks side by side (the small matmuls and the row kernel parallelise poorly
        # on their own); results come back in block order, so they do not depend on threads.
        blocks = parallel_map(
            lambda i0: _block_stats(q[..., i0:i0 + block, :], kt, cap,
                                    _rows(mask, i0, i0 + block), _rows(bias, i0, i0 + block),
                                    causal, causal_offset, i0, threads=1 if workers > 1 else None,
                                    offset=_rows(offset, i0, i0 + block), normaliser=normaliser,
                                    sink=sink),
            starts, workers)
        rows = [part for part in blocks if part is not None]  # O(B H Nq) in all
        if not rows:
            return HeadStats.zeros(n_heads)
        if normaliser == "softmax":
            return HeadStats.from_rows(torch.cat(rows, dim=-2))
        stats = torch.cat([part[0] for part in rows], dim=-2)         # (B, H, Nq, columns)
        mass = torch.cat([part[1] for part in rows], dim=-1)          # (B, H, Nq)
        return HeadStats.from_rows(stats, mass, sink=normaliser == "sink")


def _block_stats(q: Tensor, kt: Tensor, cap: float | None, keep: Tensor | None,
                 bias: Tensor | None, causal: bool, causal_offset: int, i0: int, *,
                 threads: int | None = None, offset: float | Tensor = 0.0,
                 normaliser: str = "softmax", sink: Tensor | None = None):
    """Per-row statistics of query rows ``i0 : i0 + Nb``: float64 (B, H, Nb, len(ROW_STATS_COLUMNS)) with the columns
    of :data:`attnscale.stats.ROW_STATS_COLUMNS`, or None when no row of the block has a key.

    q (B, H, Nb, d) already multiplied by the scale (and 1/cap); kt (B, H, d, Nk);
    keep (bool) and bias broadcastable to (B, H, Nb, Nk); threads: for the row kernel.
    """
    n_b, n_k = q.shape[-2], kt.shape[-1]
    # Only the keys some row of this block may attend are scored: under a causal or sliding-window
    # mask that skips about half of the work.  Dropping masked columns leaves every statistic as
    # it is, because masked keys carry no weight.
    lo, hi = 0, n_k
    if causal:
        hi = min(n_k, max(0, i0 + n_b + causal_offset))
    if keep is not None and keep.shape[-1] == n_k:
        cols = keep[..., :hi].reshape(-1, hi).any(dim=0).nonzero()  # (n_cols, 1)
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 0)
    if hi <= lo:  # no query of the block has a key
        return None

    def cols_of(t: Tensor) -> Tensor:
        return t[..., lo:hi] if t.shape[-1] == n_k else t

    z = q @ kt[..., lo:hi]                                   # (B, H, Nb, W), scaled logits
    if isinstance(offset, Tensor) or offset != 0.0:
        z = z + offset                                       # sigmoid attention's bias
    if cap is not None:
        z = z.tanh_().mul_(cap)                              # the soft-cap, before the mask
    if bias is not None:
        z = z + cols_of(bias)
    if keep is not None:
        keep = cols_of(keep)
        if torch.broadcast_shapes(keep.shape, z.shape) == z.shape:
            z.masked_fill_(~keep, -math.inf)
        else:  # the mask has a batch the logits broadcast over
            z = torch.where(keep, z, -math.inf)
    first_hidden = i0 + causal_offset + 1 - lo  # first block column that causality can hide
    # Causality as a per-row key count (no mask is written): query i0 + r sees the first
    # first_hidden + r columns of the block.
    limit = None
    if causal and first_hidden < hi - lo:
        limit = torch.arange(first_hidden, first_hidden + n_b, dtype=torch.int64, device=z.device)
    if normaliser == "softmax":
        return row_stats(z, limit=limit, threads=threads)
    if limit is not None:  # the key mass needs the hidden keys written out
        cols = torch.arange(hi - lo, device=z.device)
        z = z.masked_fill(cols >= limit.view(-1, 1), -math.inf)
    # Another normaliser: its statistics (attnscale.stats) and each row's key mass.
    return (row_stats(z, threads=threads, normaliser=normaliser, sink=sink),
            row_mass(z, normaliser, sink))
