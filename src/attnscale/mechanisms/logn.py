"""``logn``: Qwen's log-n attention scaling, z = max(1, log_L n) · qᵀk / √d.

Qwen (Qwen-7B's ``modeling_qwen.py``, ``use_logn_attn``) builds ``logn_list[i - 1] =
log(i) / log(seq_length)`` for positions i > seq_length and 1 up to it, and multiplies the query
of the i-th position by it, so the temperature grows like log n only beyond the training length
L = ``seq_length``.  Here n is the number of keys the query attends (its causal prefix, i for the
i-th position, or its unmasked keys), so left padding does not count and a query decoding with a
KV cache gets the count of the keys it actually attends.  Option ``train_len``: L (Qwen-7B's
``seq_length`` is 2048).  A sibling of ``ssmax`` (s · ln n, learned s) and ``llama4-temp``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnscale.errors import check_int
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Qwen-7B's training length, its config's seq_length.
QWEN_TRAIN_LEN = 2048


def logn_factor(n: int | Tensor, train_len: int) -> float | Tensor:
    """max(1, log_L n) = max(1, ln n / ln L) for n keys; float64 for tensors."""
    if isinstance(n, Tensor):
        return (torch.log(n.clamp(min=1).to(torch.float64)) / math.log(train_len)).clamp(min=1.0)
    return max(1.0, math.log(max(n, 1)) / math.log(train_len))


@register("logn")
class LogN(Mechanism):
    """z = max(1, log_L n) qᵀk / √d, L = train_len (2048), n keys attended.
    Source: Qwen's log-n attention scaling (modeling_qwen.py, use_logn_attn)."""

    def __init__(self, d_head: int, n_heads: int, *, train_len: int = QWEN_TRAIN_LEN):
        super().__init__(d_head, n_heads)
        self.train_len = check_int("train_len", train_len, minimum=2)

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        factor = logn_factor(n_keys, self.train_len)
        if isinstance(factor, Tensor):  # per query row, (..., Nq, 1)
            return q, k, (factor * inv_sqrt(self.d_head)).to(q.dtype)
        return q, k, factor * inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_len={self.train_len}"
