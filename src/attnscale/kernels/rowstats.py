"""Fused per-row softmax statistics: the compiled kernel behind :func:`attnscale.stats.row_stats`.

:func:`row_stats` reduces float32 logits of shape (..., n) to the statistics of
:mod:`attnscale.stats` for every row -- number of unmasked keys, max weight, entropy,
``||J||_F``, logit std, ``max |z|`` and the signed ``max z`` -- reading each logit twice in one C kernel instead
of the ~20 tensor passes of the PyTorch formulation.  The numerics and the answers for special
rows (no key: 0; NaN or ``+inf``: NaN) are those of :mod:`attnscale.stats` (centred on the top
key, nothing cancels or underflows near one-hot); sums are taken in float32 over runs of 512 keys
and in float64 across them.

Call it through :func:`attnscale.stats.row_stats`, which validates the input and falls back to the
PyTorch formulation where the compiled kernels (:mod:`attnscale.kernels.native`) are not available.
"""

from __future__ import annotations

import torch

from attnscale.kernels import native
from attnscale.errors import check_int
from attnscale.kernels.native import ROW_STATS_COLUMNS
from attnscale.kernels.team import team_map

Tensor = torch.Tensor

# Below this many logits a call runs on the calling thread only (thread hand-off costs ~50 us).
PARALLEL_MIN_ELEMENTS = 1 << 16


def row_stats(z: Tensor, *, limit: Tensor | None = None, portable: int = False,
              threads: int | None = None) -> Tensor:
    """Per-row statistics of ``softmax(z)`` over the last dimension.

    The columns are :data:`attnscale.kernels.native.ROW_STATS_COLUMNS`.

    Args:
        z: float32 CPU logits (..., n); ``-inf`` marks a masked key.  A row holding NaN or
            ``+inf`` counts it as a key and gets NaN statistics.
        limit: optional int64 tensor (P,): row ``r`` of the flattened (R, n) view sees only its
            first ``limit[r % P]`` keys (clamped to [0, n]) -- causal attention without writing
            a mask, with P the number of query rows per (batch, head).
        portable: the build to run (:mod:`attnscale.kernels.native`): the best (default), the
            portable 128-bit one (True) or AVX2 at most (``native.AVX2``), to test each.
        threads: worker threads (default ``torch.get_num_threads()``).
    Returns:
        float64 tensor (..., len(ROW_STATS_COLUMNS)).  A row with no key (also n = 0) has count 0 and every
        statistic 0.
    Raises:
        RuntimeError: the kernel is not available (see :func:`attnscale.kernels.native.available`).
        ValueError: ``z`` is not float32 on the CPU, ``limit`` is not int64, or ``threads``
            is below 1.
    """
    native.require()
    if z.dtype != torch.float32 or z.device.type != "cpu":
        raise ValueError(f"z must be float32 on the CPU, got {z.dtype} on {z.device}")
    n = z.shape[-1]
    if n == 0 or z.numel() == 0:  # rows without keys, or no rows
        return torch.zeros(*z.shape[:-1], len(ROW_STATS_COLUMNS), dtype=torch.float64)
    flat = z.detach().reshape(-1, n)
    if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) < n):
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, len(ROW_STATS_COLUMNS), dtype=torch.float64)
    if limit is not None:
        if limit.dtype != torch.int64:
            raise ValueError(f"limit must be int64, got {limit.dtype}")
        limit = limit.detach().cpu().contiguous()
        if limit.numel() < 1:
            raise ValueError("limit must have at least one entry")
    if threads is not None:
        threads = check_int("threads", threads, minimum=1)
    workers = 1
    if rows * n >= PARALLEL_MIN_ELEMENTS:
        workers = max(1, min(threads or torch.get_num_threads(), rows))
    bounds = [rows * w // workers for w in range(workers + 1)]
    team_map(lambda span: native.row_stats_rows(flat, out, span, limit=limit,
                                                portable=portable),
             zip(bounds[:-1], bounds[1:]), workers)
    return out.reshape(*z.shape[:-1], len(ROW_STATS_COLUMNS))
