"""Watch the attention temperature inside a running model: entropy, max weight and logit scale
per layer and head, without materialising the (B, H, N, N) attention matrix.

::

    with attnscale.monitor(model) as mon:
        model(inputs)
    mon.records      # one flat dict per (layer, head)
    mon.to_frame()   # the same as a pandas DataFrame

What is observed, and where (all of it attached on ``__enter__`` and removed on ``__exit__``, also
when the body raises):

* :func:`attnscale.attention.attention` is replaced by a wrapper that reads the mechanism, mask
  and causality it is given, then calls the original with the very same arguments.  This covers
  attnscale's :class:`~attnscale.attention.MultiHeadAttention` and bare mechanisms on both kernels
  (fused SDPA and blockwise soft-cap) and Hugging Face models running
  ``attn_implementation="attnscale"`` (:mod:`attnscale.hf`).
* ``torch.nn.functional.scaled_dot_product_attention`` is wrapped the same way, from its
  ``(q, k, attn_mask, is_causal, scale, enable_gqa)``: the fallback for any other module that calls
  SDPA, such as HF models on ``"sdpa"``.  The SDPA call made inside an observed ``attention`` call
  is not counted twice.
* Every submodule of ``model`` gets a forward pre-hook and an always-called forward hook that keep
  a stack of the modules currently running; an observation is attributed to the innermost one
  that is not a mechanism, by its qualified name (``model.layers.3.self_attn``).  ``layer`` numbers modules in the order of
  their first observation.

Statistics (those of :mod:`attnscale.stats`, reduced per row by the compiled kernel of
:mod:`attnscale.kernels.rowstats`, or by :mod:`attnscale.stats` itself where the kernel is not installed or
the logits are not float32 on the CPU) are taken row by row over the keys each query may attend
to; masked keys are excluded and a query with no key at all is not counted.  The logits are the
ones after the mechanism (scale, normalisation, soft-cap) and before the mask; an additive
float mask's finite entries (ALiBi, relative position biases) are part of the logits, entries at or
below :data:`MASKED_BIAS` mark masked keys.  Dropout is not applied: the statistics describe the
distribution dropout samples from.  Everything is computed in float32 or better under
``torch.no_grad()`` from detached tensors, ``block`` queries at a time, so the model's outputs are
bit for bit the same as without the monitor and the extra memory is O(B·H·block·N).

Not observed: ``torch.compile``-d graphs (they captured the original functions) and callers that
bound ``scaled_dot_product_attention`` or ``attention`` to a local name at import time.  The taps
are process-wide while a monitor is active; do not run monitored models from several threads.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.kernels import native, rowstats
from attnscale.errors import check_int
from attnscale.mechanisms import Mechanism, build_mechanism
from attnscale.mechanisms.base import upcast
from attnscale.stats import logit_std, softmax_stats
from attnscale.workers import parallel_map, workers_for

# Queries per statistics block: the monitor's extra memory is a few (B, H, DEFAULT_BLOCK, N)
# float32 tensors, e.g. 4 MiB each at B=1, H=4, N=2048.
DEFAULT_BLOCK = 128
# An additive-mask entry at or below this marks a masked key: exp(z - 1e4) is exactly 0 in every
# float dtype for any sane logit z, and HF (finfo.min), PyTorch (-inf) and BERT-era code (-1e4)
# all use values at or below it.  Finite entries above it are biases that belong to the logits.
MASKED_BIAS = -1e4
# The keys of every record, in order (the column order of ``to_frame`` and ``records.json``).
RECORD_KEYS = ("layer", "head", "module", "queries", "entropy_mean", "entropy_min",
               "max_weight_mean", "logit_std", "logit_absmax", "jacobian_fro_mean")
# The statistics a TensorBoard writer receives, per (layer, head) and per layer.
SCALAR_KEYS = RECORD_KEYS[4:]


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
    jacobian_fro_sum: Tensor  # sum of ||diag(p) - p p^T||_F

    @classmethod
    def zeros(cls, n_heads: int) -> HeadStats:
        z = torch.zeros(n_heads, dtype=torch.float64)
        return cls(z, z.clone(), torch.full_like(z, math.inf), z.clone(), z.clone(), z.clone(),
                   z.clone())

    def merge(self, other: HeadStats) -> HeadStats:
        """Statistics over the rows of both."""
        return HeadStats(
            self.queries + other.queries, self.entropy_sum + other.entropy_sum,
            torch.minimum(self.entropy_min, other.entropy_min),
            self.max_weight_sum + other.max_weight_sum, self.logit_std_sum + other.logit_std_sum,
            torch.maximum(self.logit_absmax, other.logit_absmax),
            self.jacobian_fro_sum + other.jacobian_fro_sum)

    def pooled(self) -> HeadStats:
        """All heads together as one: every field of shape (1,)."""
        def total(t: Tensor) -> Tensor:
            return t.sum(0, keepdim=True)
        return HeadStats(total(self.queries), total(self.entropy_sum),
                         self.entropy_min.amin(0, keepdim=True), total(self.max_weight_sum),
                         total(self.logit_std_sum), self.logit_absmax.amax(0, keepdim=True),
                         total(self.jacobian_fro_sum))

    def means(self) -> dict[str, list[float]]:
        """The record statistics per head (means over rows); NaN for a head that saw no row."""
        n = self.queries
        safe = n.clamp(min=1)
        none = n == 0
        out = {"queries": n,
               "entropy_mean": self.entropy_sum / safe, "entropy_min": self.entropy_min,
               "max_weight_mean": self.max_weight_sum / safe,
               "logit_std": self.logit_std_sum / safe, "logit_absmax": self.logit_absmax,
               "jacobian_fro_mean": self.jacobian_fro_sum / safe}
        return {k: torch.where(none, math.nan, v).tolist() if k != "queries" else v.tolist()
                for k, v in out.items()}


def _rows(t: Tensor | float | None, i0: int, i1: int) -> Tensor | float | None:
    """Rows ``i0:i1`` of a tensor broadcastable to (..., Nq, X); broadcast (size-1) rows stay."""
    if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[-2] > 1:
        return t[..., i0:i1, :]
    return t


def head_stats(q: Tensor, k: Tensor, *, scale: float | Tensor | None = None,
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
    block = check_int("block", block, minimum=1)
    with torch.no_grad():
        # float32 at least, like SDPA's accumulation; float64 inputs stay float64.
        work = torch.promote_types(q.dtype, torch.float32)
        q, k = q.detach().to(work), k.detach().to(work)
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
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
        kt = k.transpose(-2, -1)  # (B, H, d, Nk)
        starts = range(0, q.shape[-2], block)
        workers = workers_for(q.device, len(starts))
        # Blocks are independent: with several threads, each computes the logits and statistics
        # of whole blocks side by side (the small matmuls and the row kernel parallelise poorly
        # on their own); results come back in block order, so they do not depend on threads.
        blocks = parallel_map(
            lambda i0: _block_stats(q[..., i0:i0 + block, :], kt, cap,
                                    _rows(mask, i0, i0 + block), _rows(bias, i0, i0 + block),
                                    causal, causal_offset, i0, threads=1 if workers > 1 else None),
            starts, workers)
        rows = [part for part in blocks if part is not None]  # O(B H Nq) in all
        return _totals(torch.cat(rows, dim=-2)) if rows else HeadStats.zeros(n_heads)


def _block_stats(q: Tensor, kt: Tensor, cap: float | None, keep: Tensor | None,
                 bias: Tensor | None, causal: bool, causal_offset: int, i0: int, *,
                 threads: int | None = None) -> Tensor | None:
    """Per-row statistics of query rows ``i0 : i0 + Nb``: float64 (B, H, Nb, 6) with the columns
    of :data:`attnscale.kernels.native.ROW_STATS_COLUMNS`, or None when no row of the block has a key.

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
    if z.dtype == torch.float32 and z.device.type == "cpu" and native.available():
        # The compiled kernel reads causality as a per-row key count: no mask is written.
        limit = None
        if causal and first_hidden < hi - lo:
            limit = torch.arange(first_hidden, first_hidden + n_b, dtype=torch.int64)
        return rowstats.row_stats(z, limit=limit, threads=threads)
    if causal and first_hidden < hi - lo:
        # Query i0 + r hides keys j > i0 + r + offset: only this corner of the block.
        corner = z[..., max(first_hidden, 0):]
        j = torch.arange(corner.shape[-1], device=z.device) + max(first_hidden, 0)
        r = torch.arange(n_b, device=z.device).unsqueeze(-1)
        corner.masked_fill_(j > r + first_hidden - 1, -math.inf)

    s = softmax_stats(z)                                     # each (B, H, Nb)
    std = logit_std(z)
    absmax = z.masked_fill_(torch.isneginf(z), 0.0).abs_().amax(dim=-1)  # masked -> 0; z is done
    # A row with no key has max weight 0 (every valid row has max weight >= 1 / Nk); a row with
    # a NaN logit has NaN statistics and is counted, so the NaN reaches its head's record.
    count = (s["max_weight"] != 0).to(s["max_weight"].dtype)
    return torch.stack([count, s["max_weight"], s["entropy"], s["jacobian_fro"], std, absmax],
                       dim=-1).double()


def _totals(rows: Tensor) -> HeadStats:
    """Per-head sums of per-row statistics (B, H, Nb, len(ROW_STATS_COLUMNS)); rows whose
    count is 0 (no key to attend) are left out."""
    col = {name: rows[..., i] for i, name in enumerate(native.ROW_STATS_COLUMNS)}
    ok = col["count"] > 0

    def total(x: Tensor) -> Tensor:
        return torch.where(ok, x, 0.0).sum(dim=(0, 2), dtype=torch.float64)

    def extreme(x: Tensor, fill: float, reduce) -> Tensor:
        return reduce(torch.where(ok, x, fill), dim=(0, 2)).double()

    return HeadStats(
        queries=ok.sum(dim=(0, 2), dtype=torch.float64),
        entropy_sum=total(col["entropy"]),
        entropy_min=extreme(col["entropy"], math.inf, torch.amin),
        max_weight_sum=total(col["max_weight"]),
        logit_std_sum=total(col["logit_std"]),
        logit_absmax=extreme(col["logit_absmax"], 0.0, torch.amax),
        jacobian_fro_sum=total(col["jacobian_fro"]),
    )


# --------------------------------------------------------------------------------------------
# Call points.  Each is patched once while at least one monitor is active: the patch hands the
# call to every active monitor, then calls the original with the very same arguments.  A call made
# inside an observed call (the SDPA call inside attnscale's ``attention``) is not observed again.

_ACTIVE: list[Monitor] = []
_INSTALLED: list[tuple[object, str, Callable, Callable]] = []  # (owner, attr, original, tap)
_DEPTH = 0  # observed calls currently running


def _call_points() -> list[tuple[object, str, str]]:
    """(owner, attribute, Monitor method) of every call point the monitor taps."""
    # By module name: the package re-exports the *function* ``attnscale.attention``.
    module = importlib.import_module("attnscale.attention")
    package = importlib.import_module("attnscale")
    points = [(module, "attention", "_observe_attention")]
    if getattr(package, "attention", None) is module.attention:  # attnscale.attention(...)
        points.append((package, "attention", "_observe_attention"))
    return points + [(F, "scaled_dot_product_attention", "_observe_sdpa")]


def _make_tap(original: Callable, method: str) -> Callable:
    @functools.wraps(original)
    def tap(*args, **kwargs):
        global _DEPTH
        if _DEPTH == 0:
            for mon in tuple(_ACTIVE):
                getattr(mon, method)(*args, **kwargs)
        _DEPTH += 1
        try:
            return original(*args, **kwargs)
        finally:
            _DEPTH -= 1

    return tap


def _install() -> None:
    for owner, attr, method in _call_points():
        original = getattr(owner, attr)
        tap = _make_tap(original, method)
        setattr(owner, attr, tap)
        _INSTALLED.append((owner, attr, original, tap))


def _uninstall() -> None:
    while _INSTALLED:
        owner, attr, original, tap = _INSTALLED.pop()
        if getattr(owner, attr) is tap:  # whoever patched after us keeps their patch
            setattr(owner, attr, original)


class Monitor:
    """Context manager that records attention statistics per (layer, head); see the module doc.

    Use :func:`monitor` to build one.  Records accumulate over every forward pass inside the
    ``with`` block (means are over all rows seen); :meth:`reset` starts over.
    """

    def __init__(self, model: nn.Module, *, block: int = DEFAULT_BLOCK, writer=None,
                 step: int = 0, every: int = 1):
        if not isinstance(model, nn.Module):
            raise TypeError(f"monitor() needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.block = check_int("block", block, minimum=1)
        self.writer = writer      # SummaryWriter-like: add_scalar(tag, value, step)
        self.step = check_int("step", step)  # index of the model's next forward pass
        self.every = check_int("every", every, minimum=1)
        self._observing = True  # whether the current forward pass is one in `every`
        self._totals: dict[str, HeadStats] = {}   # insertion order is layer order
        self._pending: dict[str, HeadStats] = {}  # since the last writer flush
        self._names: dict[nn.Module, str] = {}
        self._stack: list[list] = []  # [module, calls observed so far] per running module
        self._handles: list = []

    # -- attaching ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if self in _ACTIVE:
            raise RuntimeError("this monitor is already active")
        try:
            root = type(self.model).__name__
            for name, module in self.model.named_modules():
                self._names[module] = name or root
                self._handles.append(module.register_forward_pre_hook(self._push))
                # always_call: the stack is popped even when the forward raises.
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
        except BaseException:
            self._detach()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self._detach()

    def _detach(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if not _ACTIVE:
            _uninstall()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _push(self, module: nn.Module, args) -> None:
        if module is self.model and not self._stack:
            self._observing = self.step % self.every == 0
        self._stack.append([module, 0])

    def _pop(self, module: nn.Module, args, output) -> None:
        if self._stack:
            self._stack.pop()
        if module is self.model and not self._stack:
            self.flush()  # what this forward pass saw goes to TensorBoard at its own step
            self.step += 1

    def _watching(self) -> bool:
        """Inside a forward pass of this monitor's model that ``every`` selects."""
        return bool(self._stack) and self._observing

    def _site(self) -> str | None:
        """Name of the innermost running attention module; a second call in one forward of the
        same module is ``name#1``.  A mechanism called as a module is attributed to its owner."""
        if not self._watching():
            return None
        frames = [f for f in self._stack if not isinstance(f[0], Mechanism)] or self._stack
        frame = frames[-1]
        frame[1] += 1
        name = self._names[frame[0]]
        return name if frame[1] == 1 else f"{name}#{frame[1] - 1}"

    # -- observing ---------------------------------------------------------------------------
    def _observe_attention(self, q: Tensor, k: Tensor, v: Tensor,
                           mechanism: Mechanism | str = "scaled", *, mask: Tensor | None = None,
                           causal: bool = False) -> None:
        """Observer with :func:`attnscale.attention.attention`'s signature (q, k (B, H, N, d))."""
        if not self._watching():
            return
        from attnscale.attention import _causal_counts, key_mask

        with torch.no_grad():
            if isinstance(mechanism, str):
                mechanism = build_mechanism(mechanism, q.shape[-1], q.shape[1])
            # The keys each row attends, as attention() counts them for the mechanism (ssmax's
            # temperature depends on it); causality alone is counted without an (Nq, Nk) mask.
            n_q, n_k = q.shape[-2], k.shape[-2]
            if mask is not None:
                n_keys = key_mask(mask, causal, q, k).sum(-1, keepdim=True)    # (..., Nq, 1)
            elif causal:
                n_keys = _causal_counts(n_q, n_k, q.device)
            else:
                n_keys = n_k
            qs, ks, scale = mechanism.prepare(upcast(q.detach()), upcast(k.detach()), n_keys)
            # Rows with no key to attend are excluded here; attention() zeroes their output.
            self._add(qs, ks, scale=scale, cap=mechanism.cap, mask=mask, causal=causal)

    def _observe_sdpa(self, query: Tensor, key: Tensor, value: Tensor,
                      attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, **_) -> None:
        """Observer with SDPA's signature: (..., L, E) query, (..., S, E) key, mask (.., L, S)."""
        if not self._watching() or getattr(query, "is_nested", False):
            return
        if query.dim() == 3:  # (N, L, E): one head
            query, key = query.unsqueeze(-3), key.unsqueeze(-3)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(-3)
        if query.dim() != 4 or key.dim() != 4:
            return  # SDPA's rarely used (N, ..., L, E) ranks are not observed
        # is_causal in SDPA is top-left aligned: query i sees keys 0..i.
        self._add(query, key, scale=scale, mask=attn_mask, causal=bool(is_causal))

    def _add(self, q: Tensor, k: Tensor, **how) -> None:
        site = self._site()
        if site is None:
            return
        stats = head_stats(q, k, block=self.block, **how)
        for table in (self._totals, self._pending):
            table[site] = table[site].merge(stats) if site in table else stats

    # -- results -----------------------------------------------------------------------------
    @property
    def records(self) -> list[dict]:
        """One flat dict per (layer, head) with the keys of :data:`RECORD_KEYS`."""
        out = []
        for layer, (module, stats) in enumerate(self._totals.items()):
            means = stats.means()
            for head in range(len(means["queries"])):
                out.append({"layer": layer, "head": head, "module": module,
                            "queries": int(means["queries"][head]),
                            **{key: means[key][head] for key in SCALAR_KEYS}})
        return out

    def to_frame(self):
        """The records as a pandas DataFrame, columns in :data:`RECORD_KEYS` order."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("Monitor.to_frame() needs pandas (pip install pandas); "
                              "Monitor.records has the same data as a list of dicts.") from None
        return pd.DataFrame(self.records, columns=list(RECORD_KEYS))

    def reset(self) -> None:
        """Forget every observation so far (layer numbers start again at 0)."""
        self._totals.clear()
        self._pending.clear()

    def flush(self) -> None:
        """Log what was observed since the last flush to the writer at step ``self.step``.

        Tags: ``attnscale/<stat>/layer<L>/head<h>`` and the head-pooled ``attnscale/<stat>/layer<L>``.
        Called at the end of every forward pass of the monitored model and on a clean exit.
        """
        if self.writer is None or not self._pending:
            self._pending.clear()
            return
        layers = {module: layer for layer, module in enumerate(self._totals)}
        for module, stats in self._pending.items():
            layer = layers[module]
            per_head, pooled = stats.means(), stats.pooled().means()
            for key in SCALAR_KEYS:
                for head, value in enumerate(per_head[key]):
                    self.writer.add_scalar(f"attnscale/{key}/layer{layer}/head{head}", value,
                                           self.step)
                self.writer.add_scalar(f"attnscale/{key}/layer{layer}", pooled[key][0], self.step)
        self._pending.clear()


def monitor(model: nn.Module, *, block: int = DEFAULT_BLOCK, writer=None, step: int = 0,
            every: int = 1) -> Monitor:
    """Observe the attention statistics of ``model`` per (layer, head) inside a ``with`` block.

    Args:
        model: any ``nn.Module``; attnscale's MultiHeadAttention, an HF model running
            ``attn_implementation="attnscale"`` (or ``"sdpa"``), or anything calling SDPA.
        block: queries per statistics block (extra memory O(T · B · H · block · N) with T the
            number of torch threads).
        writer: optional TensorBoard ``SummaryWriter`` (anything with ``add_scalar``); receives
            the per-(layer, head) and per-layer statistics after every forward pass.
        step: index of the first forward pass, the TensorBoard step its scalars are logged at;
            it counts forward passes of ``model`` and can be set at any time (``mon.step = i``).
        every: observe one forward pass of ``model`` in ``every`` (those whose step is a multiple
            of it), so a training loop pays for the statistics only there.
    Returns:
        a :class:`Monitor`; after the block, ``mon.records`` and ``mon.to_frame()`` hold the
        statistics (entropy in nats, weights in [0, 1], logits in logit units).
    """
    return Monitor(model, block=block, writer=writer, step=step, every=every)


def layer_summary(records: list[dict]) -> list[dict]:
    """One row per layer from per-head ``records``: head means of the means, min of the minima,
    max of the maxima, plus ``heads``.  Same keys as a record otherwise (no ``head``)."""
    by_layer: dict[int, list[dict]] = {}
    for r in records:
        by_layer.setdefault(r["layer"], []).append(r)
    rows = []
    for layer, heads in sorted(by_layer.items()):
        def mean(key: str) -> float:
            return sum(h[key] for h in heads) / len(heads)
        rows.append({"layer": layer, "module": heads[0]["module"], "heads": len(heads),
                     "queries": heads[0]["queries"],
                     "entropy_mean": mean("entropy_mean"),
                     "entropy_min": min(h["entropy_min"] for h in heads),
                     "max_weight_mean": mean("max_weight_mean"), "logit_std": mean("logit_std"),
                     "logit_absmax": max(h["logit_absmax"] for h in heads),
                     "jacobian_fro_mean": mean("jacobian_fro_mean")})
    return rows


def plot_entropy(records: list[dict], ax, *, stat: str = "entropy_mean") -> None:
    """Heatmap of ``stat`` (default mean entropy, nats) per (layer, head) on matplotlib ``ax``."""
    n_layers = 1 + max(r["layer"] for r in records)
    n_heads = 1 + max(r["head"] for r in records)
    grid = [[float("nan")] * n_heads for _ in range(n_layers)]
    for r in records:
        grid[r["layer"]][r["head"]] = r[stat]
    image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper")
    bar = ax.figure.colorbar(image, ax=ax, label=f"{stat} (nats)" if "entropy" in stat else stat)
    bar.formatter.set_useOffset(False)  # an offset label would collide with the title
    bar.update_ticks()
    if n_layers * n_heads <= 256:  # small grids: print each value in its cell
        for r in records:
            ax.text(r["head"], r["layer"], f"{r[stat]:.3g}", ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    # Integer ticks; label every one while they stay legible.
    ax.set_xticks(range(0, n_heads, max(1, n_heads // 16)))
    ax.set_yticks(range(0, n_layers, max(1, n_layers // 32)))
