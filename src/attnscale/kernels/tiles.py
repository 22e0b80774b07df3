"""How the blockwise attention kernels cut (B, H, Nq) into blocks of whole softmax rows.

The soft-cap, sigmoid, softpick / stick-breaking and entropy kernels all work on the same blocks:
a few heads of one batch element by a run of queries, against every key those queries can see
(all of them, or under top-left causality the prefix up to the block's last query).  A block
holds whole rows, so a row's maximum and sum are exact within it and nothing is rescaled online;
its extra memory is O(heads · rows · Nk) instead of the (B, H, Nq, Nk) logits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from attnscale.kernels.rowsubset import block_hidden


class Tiles:
    """The blocks of about ``block_elements`` logits that q (B, H, Nq, d) and k (B, H, Nk, d)
    are cut into, with the block's view of ``mask`` (boolean, True = attend, broadcastable to
    (B, H, Nq, Nk)) and of top-left causality.

    A block is ``heads`` heads of one batch element by ``rows`` queries, by all the keys those
    queries can see: every key, or under causality the prefix up to the block's last query.
    """

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool,
                 block_elements: int):
        self.n_b, self.n_h, self.n_q, _ = q.shape
        self.n_k, self.causal = k.shape[-2], causal
        self.rows = max(1, min(self.n_q, block_elements // max(self.n_k, 1)))
        self.heads = max(1, min(self.n_h, block_elements // max(self.rows * self.n_k, 1)))
        self.hidden = None
        if mask is not None:  # invert once; view as (B|1, H|1, Nq|1, Nk|1)
            self.hidden = ~mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))

    def block_elements(self) -> int:
        """Logits in the largest block: heads · rows · Nk."""
        return self.heads * self.rows * self.n_k

    def groups(self) -> Iterator[tuple[int, slice]]:
        """(b, heads) of each head group, ``heads`` a slice."""
        for b in range(self.n_b):
            for h0 in range(0, self.n_h, self.heads):
                yield b, slice(h0, h0 + self.heads)

    def split(self, b: int, heads: slice, *tensors: Tensor) -> list[tuple[Tensor, ...]]:
        """Each (B, H, Nq, ·) tensor's row blocks for one head group: (h, r, ·) views."""
        return [t[b, heads].split(self.rows, dim=1) for t in tensors]

    def rows_of(self, t: Tensor, b: int, heads: slice, i: int) -> Tensor:
        """The (h, r, ·) view of a (B, H, Nq, ·) tensor that row block i of a head group covers."""
        i0 = i * self.rows
        return t[b, heads, i0:i0 + self.rows]

    def n_keys(self, i: int) -> int:
        """Keys the i-th row block can see: all, or the causal prefix min(Nk, last row + 1)."""
        return min(self.n_k, (i + 1) * self.rows) if self.causal else self.n_k

    def hide_masked(self, z: Tensor, b: int, heads: slice, i: int, j0: int = 0) -> Tensor:
        """Set the logits of block i (from its row ``j0`` on) that the mask hides to -inf, in
        place."""
        if self.hidden is not None:
            i0 = i * self.rows + j0
            z.masked_fill_(block_hidden(self.hidden, b, heads, i0, i0 + z.shape[1], z.shape[-1]),
                           float("-inf"))
        return z

    def causal_counts(self, i: int, rows: int) -> Tensor | None:
        """Keys each of the ``rows`` queries of block i sees under causality (None: all)."""
        if not self.causal:
            return None
        i0 = i * self.rows
        return torch.arange(i0 + 1, i0 + rows + 1, dtype=torch.int64)

    def hide(self, z: Tensor, b: int, heads: slice, i: int) -> Tensor:
        """Set masked logits of block i to -inf in place: the mask, then keys j > i if causal."""
        i0, n_k = i * self.rows, z.shape[-1]
        self.hide_masked(z, b, heads, i)
        if self.causal and i0 + 1 < n_k:  # only the block's diagonal square can hide keys
            j = torch.arange(i0 + 1, n_k, device=z.device)                    # (c,)
            rows = torch.arange(i0, i0 + z.shape[1], device=z.device)[:, None]  # (r, 1)
            z[..., i0 + 1:].masked_fill_(j > rows, float("-inf"))
        return z


class Scratch:
    """Blocks a kernel call's workers write their logits and gradients into, each worker thread
    its own ``count`` buffers of ``elements`` values, reused from block to block: a fresh 2 MiB
    block page-faults, which costs about a tenth of the matmul that fills it (measured on one
    core of an AMD EPYC at B4 H8 N1024 d64)."""

    def __init__(self, elements: int, dtype: torch.dtype, count: int,
                 device: torch.device | str = "cpu"):
        self.elements, self.dtype, self.count, self.device = elements, dtype, count, device
        self._local = threading.local()

    def block(self, slot: int, shape: tuple[int, ...]) -> Tensor:
        """This thread's buffer ``slot`` as a contiguous tensor of ``shape`` (its contents are
        whatever the last block left)."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = [
                torch.empty(self.elements, dtype=self.dtype, device=self.device)
                for _ in range(self.count)]
        return buffers[slot][:math.prod(shape)].view(shape)

    def scores(self, slot: int, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
        """alpha · a bᵀ for (h, r, d) a and (h, n, d) b, into buffer ``slot``: (h, r, n)."""
        out = self.block(slot, (a.shape[0], a.shape[1], b.shape[1]))
        if alpha == 1.0:
            return torch.bmm(a, b.transpose(1, 2), out=out)
        return torch.baddbmm(out, a, b.transpose(1, 2), beta=0.0, alpha=alpha, out=out)
