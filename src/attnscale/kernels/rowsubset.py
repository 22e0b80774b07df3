"""A few query rows out of (B, H, Nq): the second pass of the kernels that first find, cheaply,
the rows that matter (the bfloat16 screen of :mod:`attnscale.kernels.peak`, the rows of
:mod:`attnscale.kernels.entropy`'s backward that receive a gradient) and then score only those.

Each (batch, head) keeps its own rows, padded to the most any of them has by repeating its first
one, so the subset stays a dense (B, H, c, ·) tensor that one batched matmul scores against its
head's keys.  :func:`block_hidden` is the mask of a block of whole rows, as the blockwise kernels
(soft-cap, entropy, the screen's first pass) cut them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class RowSubset:
    """The rows where ``select`` (B, H, Nq) is True.

    Attributes:
        idx: (B, H, c) int64, each (batch, head)'s selected query indices, padded by repeating its
            first (index 0 for a head with none).
        real: (B, H, c) bool, False at the padding.
        most: c, the most rows one (batch, head) selects.
    """

    def __init__(self, select: Tensor):
        counts = select.sum(dim=-1)                                        # (B, H)
        self.most = int(counts.max()) if counts.numel() else 0
        order = torch.argsort(select.to(torch.int8), dim=-1, descending=True, stable=True)
        slot = torch.arange(self.most, device=select.device)
        self.real = slot < counts.unsqueeze(-1)                            # (B, H, c)
        idx = order[..., :self.most]
        self.idx = torch.where(self.real, idx, idx[..., :1])

    def gather(self, t: Tensor) -> Tensor:
        """The selected rows of a (B, H, Nq, ·) tensor: (B, H, c, ·)."""
        b, h, c = self.idx.shape
        return t.gather(2, self.idx.unsqueeze(-1).expand(b, h, c, t.shape[-1]))

    def hidden(self, hidden: Tensor | None, n_k: int, causal: bool) -> Tensor | None:
        """The keys each selected row does not attend: bool (B, H, c, Nk) or None, from
        ``hidden`` (True = masked, broadcastable to (B, H, Nq, Nk)) and top-left causality."""
        b, h, c = self.idx.shape
        batch = torch.arange(b, device=self.idx.device).view(b, 1, 1)
        head = torch.arange(h, device=self.idx.device).view(1, h, 1)
        return hidden_rows(hidden, (batch, head, self.idx), n_k, causal)


def hidden_rows(hidden: Tensor | None, at: tuple[Tensor, Tensor, Tensor], n_k: int,
                causal: bool) -> Tensor | None:
    """The keys hidden from the query rows ``at`` = (batch, head, query) index tensors (broadcast
    together to the rows' shape S), as bool (*S, Nk), or None when nothing is hidden: the rows of
    ``hidden`` (True = masked, broadcastable to (B, H, Nq, Nk); read through a broadcast view, so
    never expanded), and under top-left causality every key after the row's query."""
    out = None
    if hidden is not None:
        m = hidden.reshape((1,) * (4 - hidden.dim()) + tuple(hidden.shape))
        # a size-1 dimension of the mask serves every index along it
        out = m[tuple(i if m.shape[d] > 1 else torch.zeros_like(i) for d, i in enumerate(at))]
        out = out.expand(*torch.broadcast_shapes(*(i.shape for i in at)), n_k)
    if causal:
        above = torch.arange(n_k, device=at[2].device) > at[2].unsqueeze(-1)
        out = above if out is None else out | above
    return out


def block_hidden(hidden: Tensor, b: int, heads: slice, i0: int, i1: int, n_k: int) -> Tensor:
    """The part of ``hidden`` (True = masked, (B|1, H|1, Nq|1, Nk|1)) over a block of rows: batch
    ``b``, ``heads``, queries ``i0:i1`` and the first ``n_k`` keys, as a view broadcastable to
    the block's (h, r, n_k) logits (a size-1 dimension stays size 1)."""
    m = hidden[b if hidden.shape[0] > 1 else 0]
    m = m[heads] if m.shape[0] > 1 else m
    m = m[:, i0:i1] if m.shape[1] > 1 else m
    return m[..., :n_k] if m.shape[2] > 1 else m


def masked(z: Tensor, hidden: Tensor | None) -> Tensor:
    """``z`` with the hidden entries at -inf (in place)."""
    return z if hidden is None else z.masked_fill_(hidden, -math.inf)
