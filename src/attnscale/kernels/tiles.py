"""How the blockwise attention kernels cut (B, H, Nq) into blocks of whole softmax rows.

The soft-cap, sigmoid, softpick / stick-breaking and entropy kernels all work on the same blocks:
a few heads of one batch element by a run of queries, against every key those queries can see
(all of them, or under top-left causality the prefix up to the block's last query).  A block
holds whole rows, so a row's maximum and sum are exact within it and nothing is rescaled online;
its extra memory is O(heads · rows · Nk) instead of the (B, H, Nq, Nk) logits.
"""

from __future__ import annotations

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
