"""One forward pass measured per (layer, head): the monitor's row statistics, and what only q and k
tell (coherence, the rms of q's and k's components), never forming the (B, H, N, N) matrix.

The row statistics are :func:`attnscale.monitor`'s (entropy, max weight, Jacobian norm, logit std
and largest logit over the keys each query attends, under the call's own normaliser).  Its
``on_call`` hook hands this module the pipeline's :class:`~attnscale.pipeline.Observation` of the
same call, with the mechanism-prepared q and k (after projections, q/k norms and RoPE), from
which :func:`qk_totals` takes, ``block`` queries at a time:

* ``coherence`` (:func:`attnscale.stats.coherence`): std_i(q·k_i) / (|q| · rms_i|k_i| / √d) over
  the attended keys, about 1 for independent q and k, up to √d when they are aligned;
* ``q_rms`` = |q| / √d and ``k_rms`` = rms_i |k_i| / √d over the attended keys: the rms of one
  component, 1 under the footnote's premise (unit-variance q and k);
* ``ln_keys``: ln of the keys attended, so that ``entropy_ratio`` = entropy ÷ ln n is 1 for
  uniform attention whatever the mask.

A row's logit std then splits into the footnote's factors, exactly for one row without a cap or
a bias: ``logit_std = scale · √d · q_rms · k_rms · coherence``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnscale.measure.monitor import DEFAULT_BLOCK, monitor
from attnscale.pipeline import MASKED_BIAS, Observation
from attnscale.precision import work_dtype
from attnscale.stats import qk_row_stats

# Per-head sums kept for each attention site, merged exactly over blocks and calls (float64).
QK_SUMS = ("rows", "ln_keys", "q_rms", "k_rms", "coherent_rows", "coherence")


@dataclass
class QKTotals:
    """Per-head sums over the query rows of one site, each (H,) float64 (see :data:`QK_SUMS`):
    ``rows`` with at least one key and their ``ln_keys``, ``q_rms`` and ``k_rms``;
    ``coherent_rows`` where coherence is defined (two keys or more) and their ``coherence``.
    ``d_head`` and ``n_keys`` (the most keys a row attends) are the site's."""

    sums: dict[str, Tensor]
    d_head: int
    n_keys: int

    def merge(self, other: QKTotals) -> QKTotals:
        return QKTotals({k: self.sums[k] + other.sums[k] for k in QK_SUMS},
                        self.d_head, max(self.n_keys, other.n_keys))

    def means(self) -> dict[str, list[float]]:
        """Per head: ``mean_ln_keys``, ``q_rms``, ``k_rms`` and ``coherence`` (means over their
        rows; NaN where a head has none), ``coherent_rows``."""
        s = self.sums

        def mean(total: Tensor, n: Tensor) -> list[float]:
            return torch.where(n > 0, total / n.clamp(min=1), math.nan).tolist()

        return {"mean_ln_keys": mean(s["ln_keys"], s["rows"]),
                "q_rms": mean(s["q_rms"], s["rows"]), "k_rms": mean(s["k_rms"], s["rows"]),
                "coherence": mean(s["coherence"], s["coherent_rows"]),
                "coherent_rows": [int(x) for x in s["coherent_rows"].tolist()]}


def qk_totals(q: Tensor, k: Tensor, *, mask: Tensor | None = None, causal: bool = False,
              block: int = DEFAULT_BLOCK) -> QKTotals:
    """:class:`QKTotals` of queries q (B, H, Nq, d) against keys k (B, Hk, Nk, d), ``H % Hk == 0``.

    ``mask``: broadcastable to (B, H, Nq, Nk): bool, True = attend, or additive float, where
    entries at or below :data:`~attnscale.pipeline.MASKED_BIAS` mark masked keys (its finite
    values, position biases, are part of the logits, not of q·k, so coherence leaves them out);
    ``causal``: query i attends keys 0..i (top-left, as the pipeline's).  Computed ``block``
    queries at a time by :func:`attnscale.stats.qk_row_stats`, in float32 or better, over only
    the key columns some query of the block attends: the largest tensor is (B, H, block, Nk).
    """
    with torch.no_grad():
        work = work_dtype(q.dtype)
        q, k = q.detach().to(work), k.detach().to(work)
        n_heads, n_q, d = q.shape[-3], q.shape[-2], q.shape[-1]
        if k.shape[-3] != n_heads:  # grouped-query attention: an O(Nk d) copy
            k = k.repeat_interleave(n_heads // k.shape[-3], dim=-3)
        n_k = k.shape[-2]
        if mask is not None and mask.dtype != torch.bool:  # additive: masked keys and biases
            mask = mask.detach() > MASKED_BIAS
        sums = {name: torch.zeros(n_heads, dtype=torch.float64, device=q.device)
                for name in QK_SUMS}
        for i0 in range(0, n_q, block):
            qb = q[..., i0:i0 + block, :]                              # (B, H, b, d)
            rows = torch.arange(i0, i0 + qb.shape[-2], device=q.device)
            keep = None
            if mask is not None:
                keep = mask[..., i0:i0 + block, :] if mask.shape[-2] > 1 else mask
                keep = keep.expand(*keep.shape[:-1], n_k)
            # The key columns some row of the block attends: causality ends them at the block's
            # last row, a mask (sliding window, padding) may start them later.
            lo, hi = 0, min(n_k, i0 + qb.shape[-2]) if causal else n_k
            if keep is not None:
                cols = keep[..., :hi].reshape(-1, hi).any(dim=0).nonzero()
                lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 0)
            if hi <= lo:
                continue                                               # no row has a key
            limit = (rows + 1 - lo) if causal else None                # keys 0..i, from lo
            got = qk_row_stats(qb, k[..., lo:hi, :],
                               mask=None if keep is None else keep[..., lo:hi], limit=limit)

            def head_sum(x: Tensor, where: Tensor) -> Tensor:
                return torch.where(where, x, 0.0).sum(dim=(0, 2), dtype=torch.float64)

            count = got["count"].expand(*qb.shape[:-1])
            has = count > 0                                            # (B, H, b)
            # Rows where coherence is undefined (one key, a zero query such as a padding
            # token's, zero keys) are left out; a NaN query or key is not (x != 0 holds for
            # NaN), so NaN reaches the head's mean, as in every other statistic.
            defined = (count >= 2) & (got["q_rms"] != 0) & (got["k_rms"] != 0)
            sums["rows"] += head_sum(torch.ones_like(count), has)
            sums["ln_keys"] += head_sum(count.clamp(min=1).log(), has)
            sums["q_rms"] += head_sum(got["q_rms"], has)
            sums["k_rms"] += head_sum(got["k_rms"], has)
            sums["coherent_rows"] += head_sum(torch.ones_like(count), defined)
            sums["coherence"] += head_sum(got["coherence"], defined)
        return QKTotals(sums, d, n_k)


@dataclass(frozen=True)
class Call:
    """How one observed attention call formed its logits (the temperature as measured)."""
    mechanism: str          # registry name of the mechanism that prepared q and k; "native"
    scale: float | None     # the softmax scale; None where it varies per row (its mean in mean_scale)
    mean_scale: float       # the mean scale over the call's rows
    cap: float | None       # soft-cap, or None
    normaliser: str         # one of attnscale.stats.NORMALISERS
    sinks: bool             # whether the call had per-head sink logits
    offset: bool            # whether a logit offset was added (sigmoid's bias)


def describe_call(seen: Observation) -> Call:
    """The temperature of one pipeline call, from what the pipeline handed its observers."""
    name = getattr(seen.mechanism, "name", None) or "native"
    scale = seen.scale
    if isinstance(scale, Tensor):
        mean = float(scale.detach().double().mean())
        fixed = float(scale.detach().flatten()[0]) if bool((scale == scale.flatten()[0]).all()) \
            else None
    else:
        mean = fixed = None if scale is None else float(scale)
    return Call(name, fixed, math.nan if mean is None else mean, seen.cap, seen.normaliser,
                seen.sink is not None,
                isinstance(seen.offset, Tensor) or float(seen.offset) != 0.0)


@dataclass
class Measured:
    """One forward pass, measured: per (layer, head) ``records`` (the monitor's keys plus
    ``d_head``, ``n_keys``, ``mean_ln_keys``, ``q_rms``, ``k_rms``, ``coherence``,
    ``coherent_rows``) and each site's :class:`Call`, by module name."""
    records: list[dict]
    calls: dict[str, Call]
    counts: dict[str, int]  # attention calls per site in the pass


def measure(model: nn.Module, inputs: Mapping[str, Tensor], *, block: int = DEFAULT_BLOCK,
            on_layer: Callable[[], None] | None = None) -> Measured:
    """Run ``model(**inputs)`` once under the monitor and :func:`qk_totals`.

    ``on_layer`` is called after each attention call (a progress bar over layers).  Calls the
    monitor attributes to one module (a second call of one module in a forward pass is
    ``module#1``) are merged as its records are.
    """
    totals: dict[str, QKTotals] = {}
    calls: dict[str, Call] = {}
    counts: dict[str, int] = {}

    def on_call(site: str, seen: Observation) -> None:
        if seen.q is not None:  # None: a model that handed its logits (observe_logits)
            got = qk_totals(seen.q, seen.k, mask=seen.mask, causal=seen.causal, block=block)
            totals[site] = totals[site].merge(got) if site in totals else got
        calls.setdefault(site, describe_call(seen))
        counts[site] = counts.get(site, 0) + 1
        if on_layer is not None:
            on_layer()

    with warnings.catch_warnings():
        # A pass that reaches no attention call is the caller's error to raise, not a warning.
        warnings.filterwarnings("ignore", "attnscale.monitor observed no attention call",
                                RuntimeWarning)
        with torch.no_grad(), monitor(model, block=block, on_call=on_call) as mon:
            model(**inputs)
    records = []
    means = {site: t.means() for site, t in totals.items()}
    for r in mon.records:
        got, t = means.get(r["module"]), totals.get(r["module"])
        h = r["head"]
        records.append({**r, "d_head": None if t is None else t.d_head,
                        "n_keys": None if t is None else t.n_keys,
                        **{key: math.nan if got is None else got[key][h]
                           for key in ("mean_ln_keys", "q_rms", "k_rms", "coherence",
                                       "coherent_rows")}})
    return Measured(records, calls, counts)


@contextlib.contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """Leave ``model`` exactly as it was before the block, whatever the block swapped in
    (:func:`attnscale.hf.set_mechanism`: a mechanism submodule per layer, forward pre-hooks,
    ``config._attn_implementation`` and ``config.attnscale_mechanism``): the attributes of every
    module and of every config it holds (sub-configs included) are put back, the containers among
    them (submodules, parameters, hooks) emptied and refilled in place, so the very objects the
    caller holds (a mechanism and its parameters, hook handles) are the model's again."""
    def configs() -> list:
        seen, todo = {}, [getattr(m, "config", None) for m in model.modules()]
        while todo:
            c = todo.pop()
            if c is None or not hasattr(c, "sub_configs") or id(c) in seen:
                continue
            seen[id(c)] = c
            todo += [getattr(c, key, None) for key in c.sub_configs]
        return list(seen.values())

    objects = [*model.modules(), *configs()]
    saved = [(obj, {k: (v, dict(v) if isinstance(v, dict) else None)
                    for k, v in vars(obj).items()}) for obj in objects]
    try:
        yield
    finally:
        for obj, attrs in saved:
            for key in [k for k in vars(obj) if k not in attrs]:
                del obj.__dict__[key]
            for key, (value, content) in attrs.items():
                obj.__dict__[key] = value
                if content is not None:
                    value.clear()
                    value.update(content)
