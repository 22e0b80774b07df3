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
from dataclasses import dataclass

import torch
from torch import Tensor

from attnscale.columns import MONITOR_SUMMARIES, ROW_STATS_COLUMNS, WEIGHT_DEFAULTS, Summary
from attnscale.errors import check_int
from attnscale.kernels.biased import bias_row_stats
from attnscale.kernels.team import team_map
from attnscale.kernels.tiles import Scratch
from attnscale.mechanisms.base import inv_sqrt
from attnscale.pipeline import (MASKED_BIAS, Observation, Scale, key_mask, normalise,
                                rule_logits)
from attnscale.precision import work_dtype
from attnscale.stats import columns, row_mass, row_stats
from attnscale.workers import workers_for

# Queries per statistics block: the monitor's extra memory is a few (B, H, DEFAULT_BLOCK, N)
# float32 tensors, e.g. 4 MiB each at B=1, H=4, N=2048.
DEFAULT_BLOCK = 128


@dataclass
class HeadStats:
    """Per-head totals over every (batch, query) row seen so far, each of shape (H,), float64:
    ``queries`` (rows with at least one unmasked key) and one running total per summary of
    :data:`attnscale.columns.MONITOR_SUMMARIES` (a sum for a mean, the extreme for a min or a
    max), read as attributes by :attr:`~attnscale.columns.Summary.field`: ``entropy_sum``,
    ``entropy_min``, ``max_weight_sum``, ``logit_std_sum``, ``logit_absmax``,
    ``jacobian_fro_sum``, ``logit_max``, ``mass_sum``, ``sink_mass_sum``, ``gate_sum``.

    Sums rather than means, so that blocks, calls and forward passes merge exactly.
    """

    queries: Tensor
    totals: dict[str, Tensor]  # by Summary.field

    def __getattr__(self, name: str) -> Tensor:
        totals = self.__dict__.get("totals", {})
        if name in totals:
            return totals[name]
        raise AttributeError(f"HeadStats has no statistic {name!r}")

    @classmethod
    def zeros(cls, n_heads: int) -> HeadStats:
        z = torch.zeros(n_heads, dtype=torch.float64)
        return cls(z, {s.field: torch.full_like(z, s.start) for s in MONITOR_SUMMARIES})

    @classmethod
    def from_rows(cls, rows: Tensor, weights: dict[str, Tensor] | None = None) -> HeadStats:
        """Per-head totals of per-row statistics (B, H, Nq, len(ROW_STATS_COLUMNS)) of
        :func:`attnscale.stats.row_stats`; rows whose count is 0 (no key to attend) are left out.
        ``weights``: per-row (B, H, Nq) values of :data:`attnscale.columns.WEIGHT_COLUMNS`
        (``mass``, ``sink_mass``, ``gate``); a missing one takes its softmax value
        (:data:`~attnscale.columns.WEIGHT_DEFAULTS`)."""
        col = columns(rows)
        ok = col["count"] > 0
        for name, default in WEIGHT_DEFAULTS.items():
            given = (weights or {}).get(name)
            col[name] = (torch.full_like(col["count"], default) if given is None
                         else given.to(col["count"].device, torch.float64).expand_as(ok))

        def reduce(s: Summary) -> Tensor:
            x = col[s.column]
            if s.reduce == "mean":
                return torch.where(ok, x, 0.0).sum(dim=(0, 2), dtype=torch.float64)
            extreme = torch.amin if s.reduce == "min" else torch.amax
            return extreme(torch.where(ok, x, s.start), dim=(0, 2)).double()

        return cls(ok.sum(dim=(0, 2), dtype=torch.float64),
                   {s.field: reduce(s) for s in MONITOR_SUMMARIES})

    def merge(self, other: HeadStats) -> HeadStats:
        """Statistics over the rows of both."""
        both = {"mean": torch.add, "min": torch.minimum, "max": torch.maximum}
        return HeadStats(self.queries + other.queries,
                         {s.field: both[s.reduce](self.totals[s.field], other.totals[s.field])
                          for s in MONITOR_SUMMARIES})

    def pooled(self) -> HeadStats:
        """All heads together as one: every total of shape (1,)."""
        over = {"mean": torch.sum, "min": torch.amin, "max": torch.amax}
        return HeadStats(self.queries.sum(0, keepdim=True),
                         {s.field: over[s.reduce](self.totals[s.field], 0, keepdim=True)
                          for s in MONITOR_SUMMARIES})

    def means(self) -> dict[str, list[float]]:
        """``queries`` and each summary per head under its key (means over rows for a mean);
        NaN for a head that saw no row."""
        n = self.queries
        safe = n.clamp(min=1)
        none = n == 0
        out = {s.key: self.totals[s.field] / safe if s.reduce == "mean" else self.totals[s.field]
               for s in MONITOR_SUMMARIES}
        return {"queries": n.tolist(),
                **{k: torch.where(none, math.nan, v).tolist() for k, v in out.items()}}


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
    return call_head_stats(q, k, scale=scale, cap=cap, mask=mask, causal=causal,
                           causal_offset=causal_offset,
                           block=check_int("block", block, minimum=1))


def call_head_stats(q: Tensor, k: Tensor, *, scale: Scale | None = None,
                    cap: float | None = None, mask: Tensor | None = None, causal: bool = False,
                    causal_offset: int = 0, block: int, offset: float | Tensor = 0.0,
                    normaliser: str = "softmax", sink: Tensor | None = None,
                    gate: Tensor | None = None, lam: Tensor | None = None) -> HeadStats:
    """:func:`head_stats` of one observed call, ``block`` already validated (by the caller, where
    it entered: the monitor, once);
    ``offset`` (float or broadcastable to (B, H, Nq, 1)) is added to the logits before the cap,
    the weights are the ``normaliser``'s (``sink``: the per-head sink logits; ``lam``: λ of the
    differential normaliser, whose two maps are the halves of q and k), and ``gate``
    (B, H, Nq, 1 or d), the output gate, is summarised as its mean per row."""
    parts = _blocks(q, k, scale=scale, cap=cap, mask=mask, causal=causal,
                    causal_offset=causal_offset, block=block, offset=offset,
                    normaliser=normaliser, sink=sink, lam=lam)
    kept = [(i0, part) for i0, part in parts if part is not None]
    if not kept:  # O(B H Nq) rows in all
        return HeadStats.zeros(q.shape[-3])
    if normaliser == "softmax":
        stats, mass = torch.cat([part for _, part in kept], dim=-2), None  # (B, H, Nq', cols)
    else:
        stats = torch.cat([part[0] for _, part in kept], dim=-2)
        mass = torch.cat([part[1] for _, part in kept], dim=-1)             # (B, H, Nq')
    if gate is not None:  # the gate's mean per query row, for the rows kept
        per_row = gate.detach().double().mean(-1).expand(*stats.shape[:2], -1)
        gate = torch.cat([per_row[..., i0:i0 + block] for i0, _ in kept], -1)
    return _from_rows(stats, normaliser, mass, gate)


def _from_rows(stats: Tensor, normaliser: str, mass: Tensor | None,
               gate_rows: Tensor | None) -> HeadStats:
    """HeadStats of row statistics under ``normaliser``, with each row's key ``mass`` (None
    under softmax) and the output gate's mean per row (None: no gate)."""
    weights = {}
    if mass is not None:
        weights["mass"] = mass
        if normaliser == "sink":
            weights["sink_mass"] = 1.0 - mass
    if gate_rows is not None:
        weights["gate"] = gate_rows
    return HeadStats.from_rows(stats, weights)


def logit_stats(z: Tensor, *, normaliser: str = "softmax", sink: Tensor | None = None,
                gate: Tensor | None = None, lam: Tensor | None = None) -> HeadStats:
    """Per-head statistics of logits a model formed itself, (B, H, Nq, Nk) with masked keys at
    -inf, under ``normaliser`` (``sink``: the per-head sink logits (H,); ``lam``: λ, z the two
    maps side by side, under the differential normaliser); ``gate`` (B, H, Nq, 1 or d) the
    output gate, summarised as its mean per row.  The same statistics :func:`head_stats` gives
    from q and k."""
    with torch.no_grad():
        z = z.detach().to(work_dtype(z.dtype))
        if normaliser == "softmax":
            stats, mass = row_stats(z), None
        else:
            sink = None if sink is None else sink.detach().to(z.dtype)
            lam = None if lam is None else lam.detach().to(z.dtype)
            stats = row_stats(z, normaliser=normaliser, sink=sink, lam=lam)
            mass = row_mass(z, normaliser, sink, lam)
        gate_rows = None if gate is None else gate.detach().double().mean(-1).expand(
            *stats.shape[:3])
        return _from_rows(stats, normaliser, mass, gate_rows)


def query_rows(q: Tensor, k: Tensor, *, scale: Scale | None = None, cap: float | None = None,
               mask: Tensor | None = None, causal: bool = False, causal_offset: int = 0,
               block: int = DEFAULT_BLOCK, offset: float | Tensor = 0.0,
               normaliser: str = "softmax", sink: Tensor | None = None,
               lam: Tensor | None = None) -> Tensor:
    """The row statistics of every query, blockwise like :func:`head_stats` (same arguments, and
    the logit ``offset``, the ``normaliser`` and its ``sink`` logits or ``lam``, as a pipeline
    :class:`~attnscale.pipeline.Observation` reports them): float64 (B, H, Nq,
    len(ROW_STATS_COLUMNS)) of :func:`attnscale.stats.row_stats` under that normaliser, a query
    with no key to attend all zeros.  For statistics by query position."""
    parts = _blocks(q, k, scale=scale, cap=cap, mask=mask, causal=causal,
                    causal_offset=causal_offset, block=check_int("block", block, minimum=1),
                    offset=offset, normaliser=normaliser, sink=sink, lam=lam)
    if normaliser != "softmax":  # (rows, key mass) per block: the rows
        parts = [(i0, None if part is None else part[0]) for i0, part in parts]
    b, h, n_q = q.shape[0], q.shape[-3], q.shape[-2]
    return torch.cat([part if part is not None else
                      torch.zeros(b, h, min(block, n_q - i0), len(ROW_STATS_COLUMNS),
                                  dtype=torch.float64, device=q.device)
                      for i0, part in parts], dim=-2)


def _blocks(q: Tensor, k: Tensor, *, scale: Scale | None, cap: float | None,
            mask: Tensor | None, causal: bool, causal_offset: int, block: int,
            offset: float | Tensor = 0.0, normaliser: str = "softmax",
            sink: Tensor | None = None,
            lam: Tensor | None = None) -> list[tuple[int, Tensor | tuple | None]]:
    """``(first query, row statistics)`` of each block of ``block`` queries, in order; None for
    a block in which no query has a key.  Under another normaliser than softmax the statistics
    come as ``(rows, key mass per row)``."""
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
        if lam is not None:
            lam = lam.detach().to(work)
        kt = k.transpose(-2, -1)  # (B, H, d, Nk)
        starts = range(0, q.shape[-2], block)
        workers = workers_for(q.device, len(starts))
        # One reusable logits buffer per thread, (B, H, block, Nk) float32 at most: a fresh
        # multi-MiB tensor per block costs its page faults every time (the allocator hands large
        # blocks back to the system), about a quarter of the monitor's time on the tiny Llama of
        # benchmarks/bench_monitor.py at N=2048.
        lead = torch.broadcast_shapes(q.shape[:-2], kt.shape[:-2])
        scratch = Scratch(math.prod(lead) * min(block, q.shape[-2]) * kt.shape[-1], q.dtype, 1,
                          q.device)
        # Blocks are independent: with several threads, each computes the logits and statistics
        # of whole blocks side by side (the small matmuls and the row kernel parallelise poorly
        # on their own); results come back in block order, so they do not depend on threads.
        blocks = team_map(
            lambda i0: _block_stats(q[..., i0:i0 + block, :], kt, cap,
                                    _rows(mask, i0, i0 + block), _rows(bias, i0, i0 + block),
                                    causal, causal_offset, i0, threads=1 if workers > 1 else None,
                                    offset=_rows(offset, i0, i0 + block), normaliser=normaliser,
                                    sink=sink, lam=lam, scratch=scratch),
            starts, workers)
        return list(zip(starts, blocks))


def _block_stats(q: Tensor, kt: Tensor, cap: float | None, keep: Tensor | None,
                 bias: Tensor | None, causal: bool, causal_offset: int, i0: int, *,
                 threads: int | None = None, offset: float | Tensor = 0.0,
                 normaliser: str = "softmax", sink: Tensor | None = None,
                 lam: Tensor | None = None, scratch: Scratch | None = None):
    """Per-row statistics of query rows ``i0 : i0 + Nb``: float64 (B, H, Nb, len(ROW_STATS_COLUMNS)) with the columns
    of :data:`attnscale.stats.ROW_STATS_COLUMNS`, or None when no row of the block has a key.

    q (B, H, Nb, d) already multiplied by the scale (and 1/cap); kt (B, H, d, Nk);
    keep (bool) and bias broadcastable to (B, H, Nb, Nk); threads: for the row kernel;
    scratch: where the logits of the block's first map are written (None: a new tensor).
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

    def scores(q: Tensor, kt: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None:
            z = q @ kt[..., lo:hi]                           # (B, H, Nb, W), scaled logits
        else:
            z = torch.matmul(q, kt[..., lo:hi], out=out)
        if isinstance(offset, Tensor) or offset != 0.0:
            z = z + offset                                   # sigmoid attention's bias
        if cap is not None:
            z = z.tanh_().mul_(cap)                          # the soft-cap, before the mask
        if bias is not None:
            z = z + cols_of(bias)
        if keep is not None:
            kept = cols_of(keep)
            if torch.broadcast_shapes(kept.shape, z.shape) == z.shape:
                z.masked_fill_(~kept, -math.inf)
            else:  # the mask has a batch the logits broadcast over
                z = torch.where(kept, z, -math.inf)
        return z

    if normaliser == "differential":  # the two maps of q's and k's halves, side by side
        half = q.shape[-1] // 2
        z = torch.cat([scores(q[..., :half], kt[..., :half, :]),
                       scores(q[..., half:], kt[..., half:, :])], dim=-1)  # (B, H, Nb, 2W)
    else:
        z = scores(q, kt, None if scratch is None else scratch.block(
            0, (*torch.broadcast_shapes(q.shape[:-2], kt.shape[:-2]), n_b, hi - lo)))
    first_hidden = i0 + causal_offset + 1 - lo  # first block column that causality can hide
    # Causality as a per-row key count (no mask is written): query i0 + r sees the first
    # first_hidden + r columns of the block.
    limit = None
    if causal and first_hidden < hi - lo:
        limit = torch.arange(first_hidden, first_hidden + n_b, dtype=torch.int64, device=z.device)
    if normaliser == "softmax":
        return row_stats(z, limit=limit, threads=threads)
    if limit is not None:  # the key mass needs the hidden keys written out
        hidden = torch.arange(hi - lo, device=z.device) >= limit.view(-1, 1)
        z = z.masked_fill(hidden if z.shape[-1] == hi - lo else torch.cat([hidden, hidden], -1),
                          -math.inf)
    # Another normaliser: its statistics (attnscale.stats) and each row's key mass.
    return (row_stats(z, threads=threads, normaliser=normaliser, sink=sink, lam=lam),
            row_mass(z, normaliser, sink, lam))


def first_key_weight(seen: Observation, *, block: int = DEFAULT_BLOCK) -> tuple[Tensor, Tensor]:
    """The weight each query of one pipeline call puts on the first key, under the call's
    normaliser: ``(sum, rows)``, each float64 (H,), over the (batch, query) rows that attend key
    0.  ``sum / rows`` is a head's mean weight on the first key, the quantity of the attention-sink
    rate (Gu et al. 2024, arXiv 2410.10781: a head sinks when it exceeds a threshold; the
    softpick paper, arXiv 2504.20966, measures its normaliser by it).  Under the differential
    normaliser it is the net weight p1 − λ p2, which can be negative; every logit bias (the
    caller's, the mechanism's: forgetting, selective) is included.

    From the observation's q and k (or the logits handed to ``observe_logits``), ``block``
    queries at a time: the weights of whole rows are formed, O(B · H · block · Nk) memory (a
    mechanism's logit bias: the blocks of :func:`attnscale.kernels.biased.bias_row_stats`; with
    a caller's bias too, every query at once, since selective attention's F runs over the rows
    in order).
    """
    with torch.no_grad():
        if seen.logits is None and seen.mechanism_bias is not None and seen.bias is None:
            return _biased_first_key_weight(seen)
        two_maps = seen.normaliser == "differential"
        lam = None if seen.lam is None else seen.lam.detach()
        if seen.logits is not None:  # formed by the model, masked at -inf
            z_all = seen.logits.to(work_dtype(seen.logits.dtype))
            keep_all = None
        else:
            work = work_dtype(seen.q.dtype)
            q, k = seen.q.detach().to(work), seen.k.detach().to(work)
            mask = seen.mask
            if seen.bias is not None:  # the caller's bias is in the additive mask: its keys
                mask = mask > MASKED_BIAS
            keep_all = key_mask(mask, seen.causal, q, k)
            if seen.mechanism_bias is not None:  # with a caller's bias (above): whole rows
                block = max(q.shape[-2], 1)
        n_q = z_all.shape[-2] if seen.logits is not None else q.shape[-2]
        total = rows = None
        for i0 in range(0, n_q, block):
            if seen.logits is not None:
                z = z_all[..., i0:i0 + block, :]
            else:
                scale, offset = _rows(seen.scale, i0, i0 + block), _rows(seen.offset, i0,
                                                                         i0 + block)
                z = rule_logits(q[..., i0:i0 + block, :], k, scale, seen.cap, offset,
                                seen.normaliser, seen.mechanism_bias,
                                _rows(seen.bias, i0, i0 + block))  # (B, H, Nb, Nk|2 Nk)
                if keep_all is not None:
                    keep = _rows(keep_all, i0, i0 + block).expand(*z.shape[:-1], -1)
                    if two_maps:  # both maps of a row see the same keys
                        keep = torch.cat([keep, keep], dim=-1)
                    z = z.masked_fill(~keep, -math.inf)
            sees = ~torch.isneginf(z[..., 0])                          # (B, H, Nb)
            p0 = normalise(z, seen.normaliser, seen.sink, lam)[..., 0]  # (B, H, Nb)
            part = torch.where(sees, p0, 0.0).double().sum(dim=(0, 2))
            count = sees.double().sum(dim=(0, 2))
            total = part if total is None else total + part
            rows = count if rows is None else rows + count
        return total, rows


def _biased_first_key_weight(seen: Observation) -> tuple[Tensor, Tensor]:
    """:func:`first_key_weight` of a call with a mechanism's logit bias (and no caller's), on the
    blocks of the biased kernel (selective attention's F runs over the rows in order, so it is
    not cut by query blocks)."""
    work = work_dtype(seen.q.dtype)
    q, k = seen.q.detach().to(work), seen.k.detach().to(work)
    full = key_mask(seen.mask, seen.causal, q, k)
    per_row = torch.zeros(*q.shape[:-1], 2, dtype=torch.float64)   # (B, H, Nq, [p0, sees])

    def on_key_0(z: Tensor, threads: int | None = None) -> Tensor:  # z (H, r, n_k), masked
        sees = ~torch.isneginf(z[..., 0])
        p0 = torch.where(sees, torch.softmax(z, dim=-1)[..., 0], 0.0)
        return torch.stack([p0, sees.to(p0.dtype)], dim=-1)

    bias_row_stats(q, k, seen.scale, seen.mechanism_bias, full, seen.causal and full is None,
                   per_row, on_key_0)
    return per_row[..., 0].sum(dim=(0, 2)), per_row[..., 1].sum(dim=(0, 2))
