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

from attnscale import families, pipeline
from attnscale.errors import ConfigError
from attnscale.measure.monitor import DEFAULT_BLOCK, monitor
from attnscale.pipeline import MASKED_BIAS, Observation
from attnscale.precision import work_dtype
from attnscale.stats import columns, qk_row_factors, qk_row_stats

# Per-head sums kept for each attention site, merged exactly over blocks and calls (float64).
QK_SUMS = ("rows", "ln_keys", "inv_keys", "q_rms", "k_rms", "coherent_rows", "coherence")


@dataclass
class QKTotals:
    """Per-head sums over the query rows of one site, each (H,) float64 (see :data:`QK_SUMS`):
    ``rows`` with at least one key and their ``ln_keys``, ``inv_keys`` (1/n: the max weight of
    uniform attention over the row's n keys), ``q_rms`` and ``k_rms``;
    ``coherent_rows`` where coherence is defined (two keys or more) and their ``coherence``.
    ``d_head``, ``n_keys`` (the most keys a row attends, as its mask says: a sliding window's
    width, not the sequence length, on a windowed layer) and ``key_len`` (the keys the call
    was handed) are the site's."""

    sums: dict[str, Tensor]
    d_head: int
    n_keys: int
    key_len: int

    def merge(self, other: QKTotals) -> QKTotals:
        return QKTotals({k: self.sums[k] + other.sums[k] for k in QK_SUMS},
                        self.d_head, max(self.n_keys, other.n_keys),
                        max(self.key_len, other.key_len))

    def means(self) -> dict[str, list[float]]:
        """Per head: ``mean_ln_keys``, ``uniform_max_weight`` (the mean max weight uniform
        attention over the same keys would have: the floor of ``max_weight_mean``), ``q_rms``,
        ``k_rms`` and ``coherence`` (means over their rows; NaN where a head has none),
        ``coherent_rows``."""
        s = self.sums

        def mean(total: Tensor, n: Tensor) -> list[float]:
            return torch.where(n > 0, total / n.clamp(min=1), math.nan).tolist()

        return {"mean_ln_keys": mean(s["ln_keys"], s["rows"]),
                "uniform_max_weight": mean(s["inv_keys"], s["rows"]),
                "q_rms": mean(s["q_rms"], s["rows"]), "k_rms": mean(s["k_rms"], s["rows"]),
                "coherence": mean(s["coherence"], s["coherent_rows"]),
                "coherent_rows": [int(x) for x in s["coherent_rows"].tolist()]}


def qk_totals(q: Tensor, k: Tensor, *, mask: Tensor | None = None, causal: bool = False,
              block: int = DEFAULT_BLOCK, sink: bool = False, rows: Tensor | None = None,
              scale: float | Tensor | None = None) -> QKTotals:
    """:class:`QKTotals` of queries q (B, H, Nq, d) against keys k (B, Hk, Nk, d), ``H % Hk == 0``.

    ``mask``: broadcastable to (B, H, Nq, Nk): bool, True = attend, or additive float, where
    entries at or below :data:`~attnscale.pipeline.MASKED_BIAS` mark masked keys (its finite
    values, position biases, are part of the logits, not of q·k, so coherence leaves them out);
    ``causal``: query i attends keys 0..i (top-left, as the pipeline's); ``sink``: the head has
    an attention sink, one more outcome of its softmax, so ``ln_keys`` and ``inv_keys`` count
    n + 1 (the entropy the monitor reports covers the sink).  Computed ``block``
    queries at a time by :func:`attnscale.stats.qk_row_stats`, in float32 or better, over only
    the key columns some query of the block attends: the largest tensor is (B, H, block, Nk).

    ``rows`` (with ``scale``): the call's row statistics from the kernel that formed its logits
    ``scale · q kᵀ`` (:meth:`attnscale.pipeline.Observation.request_rows`; no cap, bias or
    offset), whose logit std over ``|scale|`` is each row's std of q·k: the factors then come
    from q and k alone (:func:`attnscale.stats.qk_row_factors`), no product formed again.
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
        most = 0  # the most keys a row attends
        known = None
        if rows is not None:  # each row's std of q·k and its keys, from the kernel's rows
            got_rows = columns(rows.detach().to(q.device))
            size = torch.as_tensor(scale, dtype=torch.float64, device=q.device).abs()
            if size.dim():
                size = size.squeeze(-1)                                # (B|1, H|1, Nq|1)
            known = (got_rows["logit_std"] / size, got_rows["count"])
        for i0 in range(0, n_q, block):
            qb = q[..., i0:i0 + block, :]                              # (B, H, b, d)
            row_ids = torch.arange(i0, i0 + qb.shape[-2], device=q.device)
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
            limit = (row_ids + 1 - lo) if causal else None             # keys 0..i, from lo
            cut = None if keep is None else keep[..., lo:hi]
            if known is None:
                got = qk_row_stats(qb, k[..., lo:hi, :], mask=cut, limit=limit)
            else:
                std, count = (x[..., i0:i0 + qb.shape[-2]] for x in known)
                got = qk_row_factors(qb, k[..., lo:hi, :], std, count, mask=cut, limit=limit)

            def head_sum(x: Tensor, where: Tensor) -> Tensor:
                return torch.where(where, x, 0.0).sum(dim=(0, 2), dtype=torch.float64)

            count = got["count"].expand(*qb.shape[:-1])
            has = count > 0                                            # (B, H, b)
            most = max(most, int(count.max()))
            # Rows where coherence is undefined (one key, a zero query such as a padding
            # token's, zero keys) are left out; a NaN query or key is not (x != 0 holds for
            # NaN), so NaN reaches the head's mean, as in every other statistic.
            defined = (count >= 2) & (got["q_rms"] != 0) & (got["k_rms"] != 0)
            sums["rows"] += head_sum(torch.ones_like(count), has)
            outcomes = (count + int(sink)).clamp(min=1)
            sums["ln_keys"] += head_sum(outcomes.log(), has)
            sums["inv_keys"] += head_sum(1.0 / outcomes, has)
            sums["q_rms"] += head_sum(got["q_rms"], has)
            sums["k_rms"] += head_sum(got["k_rms"], has)
            sums["coherent_rows"] += head_sum(torch.ones_like(count), defined)
            sums["coherence"] += head_sum(got["coherence"], defined)
        return QKTotals(sums, d, most, n_k)


def sink_key_weight(seen: Observation, block: int = DEFAULT_BLOCK) -> tuple[Tensor, Tensor]:
    """Per head, the sum over query rows with a key of the largest weight a key (not the sink)
    takes, and the number of those rows, ((H,), (H,)) float64, for a call with an attention sink:
    the monitor's max weight covers the sink, so a head resting on its sink would read as
    saturated on a key.  The logits are the call's own (``scale``, ``offset``, ``cap``, the
    additive bias and mask, causality), with the sink logit as one more outcome, ``block``
    queries at a time."""
    with torch.no_grad():
        q, k = seen.q.detach(), seen.k.detach()
        work = work_dtype(q.dtype)
        q, k = q.to(work), k.to(work)
        n_heads, n_q, n_k = q.shape[-3], q.shape[-2], k.shape[-2]
        if k.shape[-3] != n_heads:
            k = k.repeat_interleave(n_heads // k.shape[-3], dim=-3)
        b = seen.sink.detach().to(torch.float64).view(1, -1, 1, 1)     # (1, H, 1, 1)
        total = torch.zeros(n_heads, dtype=torch.float64, device=q.device)
        rows = torch.zeros(n_heads, dtype=torch.float64, device=q.device)

        def rows_of(x, i0: int, i1: int):  # a scale or offset, cut to the block's query rows
            if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[-2] == n_q:
                return x[..., i0:i1, :]
            return x

        for i0 in range(0, n_q, block):
            i1 = min(n_q, i0 + block)
            z = pipeline.logits(q[..., i0:i1, :], k, rows_of(seen.scale, i0, i1), seen.cap,
                                rows_of(seen.offset, i0, i1)).double()
            keep = torch.ones_like(z, dtype=torch.bool)
            if seen.mask is not None:
                m = seen.mask.detach()
                m = m[..., i0:i1, :] if m.shape[-2] > 1 else m
                if m.dtype == torch.bool:
                    keep = keep & m
                else:  # additive: masked at or below MASKED_BIAS, a bias above it
                    keep = keep & (m > MASKED_BIAS)
                    z = z + torch.where(m > MASKED_BIAS, m.double(), 0.0)
            if seen.causal:
                keep = keep & (torch.arange(n_k, device=q.device)
                               <= torch.arange(i0, i1, device=q.device).unsqueeze(-1))
            z = z.masked_fill(~keep, -math.inf)
            top = z.amax(dim=-1)                                          # (B, H, b)
            lse = torch.logaddexp(torch.logsumexp(z, dim=-1), b.squeeze(-1))
            has = keep.any(dim=-1)
            weight = torch.where(has, (top - lse).exp(), 0.0)
            total += weight.sum(dim=(0, 2))
            rows += has.expand_as(weight).sum(dim=(0, 2)).double()
        return total, rows


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
    bias: bool = False      # whether the caller added a logit bias (T5's position bias): an
                            # additive mask with finite values other than 0


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
    bias = seen.bias
    carries = bias is not None and bool(((bias > MASKED_BIAS) & (bias != 0)).any())
    return Call(name, fixed, math.nan if mean is None else mean, seen.cap, seen.normaliser,
                seen.sink is not None,
                isinstance(seen.offset, Tensor) or float(seen.offset) != 0.0, carries)


@dataclass
class Measured:
    """One forward pass, measured: per (layer, head) ``records`` (the monitor's keys plus
    ``d_head``, ``n_keys``, ``key_len``, ``mean_ln_keys``, ``uniform_max_weight``, ``q_rms``, ``k_rms``,
    ``coherence``, ``coherent_rows``) and each site's :class:`Call`, by module name."""
    records: list[dict]
    calls: dict[str, Call]
    counts: dict[str, int]  # attention calls per site in the pass


def measure(model: nn.Module, inputs: Mapping[str, Tensor], *, block: int = DEFAULT_BLOCK,
            on_layer: Callable[[], None] | None = None) -> Measured:
    """Run ``model(**inputs)`` once under the monitor and :func:`qk_totals`.

    ``on_layer`` is called after each attention call (a progress bar over layers).  A second
    call of one module in a forward pass is the monitor's ``module#1``, measured as one more
    layer, except where the family calls attention several times with the same q and k
    (``LayerFacts.calls``: DiffLlama, whose two calls differ only in v): those repeat one
    attention map and are left out, so each layer counts once.
    """
    totals: dict[str, QKTotals] = {}
    calls: dict[str, Call] = {}
    counts: dict[str, int] = {}
    key_weight: dict[str, tuple[Tensor, Tensor]] = {}
    modules = dict(model.named_modules())
    repeats: set[str] = set()

    def on_call(site: str, seen: Observation) -> None:
        if _repeat(site, modules):
            repeats.add(site)
            return
        def add(got: QKTotals) -> None:
            totals[site] = totals[site].merge(got) if site in totals else got

        def from_rows(rows: Tensor) -> None:  # each row's std of q·k from the kernel's rows
            add(qk_totals(seen.q, seen.k, mask=seen.mask, causal=seen.causal, block=block,
                          rows=rows, scale=seen.scale))

        # seen.q is None for a model that handed its logits (observe_logits)
        if seen.q is not None and not (_plain_logits(seen) and seen.request_rows(from_rows)):
            add(qk_totals(seen.q, seen.k, mask=seen.mask, causal=seen.causal, block=block,
                          sink=seen.sink is not None))
            if seen.sink is not None:
                new = sink_key_weight(seen, block)
                old = key_weight.get(site)
                key_weight[site] = new if old is None else (old[0] + new[0], old[1] + new[1])
        if site not in calls:
            calls[site] = describe_call(seen)
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
    kept_records = [r for r in mon.records if r["module"] not in repeats]
    layer_index = {layer: i for i, layer in enumerate(sorted({r["layer"] for r in kept_records}))}
    for r in kept_records:
        got, t = means.get(r["module"]), totals.get(r["module"])
        h = r["head"]
        weight = key_weight.get(r["module"])
        records.append({**r, "layer": layer_index[r["layer"]],
                        "key_max_weight_mean": math.nan if weight is None else
                        float(weight[0][h] / weight[1][h]) if weight[1][h] > 0 else math.nan,
                        "d_head": None if t is None else t.d_head,
                        "n_keys": None if t is None else t.n_keys,
                        "key_len": None if t is None else t.key_len,
                        **{key: math.nan if got is None else got[key][h]
                           for key in ("mean_ln_keys", "uniform_max_weight", "q_rms", "k_rms",
                                       "coherence", "coherent_rows")}})
    return Measured(records, calls, counts)


def _plain_logits(seen: Observation) -> bool:
    """Whether the call's logits are ``scale · q kᵀ`` under softmax, with a positive finite
    scale constant over each row's keys and nothing else added (no cap, bias, offset or sink):
    then the logit std its kernel measures is ``|scale|`` times the std of q·k."""
    if (seen.normaliser != "softmax" or seen.cap is not None or seen.bias is not None
            or seen.mechanism_bias is not None or seen.sink is not None
            or seen.logits is not None or seen.lam is not None):
        return False
    offset = seen.offset
    if isinstance(offset, Tensor) or offset != 0.0:
        return False
    scale = seen.scale
    if isinstance(scale, Tensor):
        return scale.shape[-1:] in ((), (1,)) and bool(torch.isfinite(scale).all()) \
            and bool((scale > 0).all())
    return math.isfinite(scale) and scale > 0


def _repeat(site: str, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``site`` (``module#k``) is a repeated call of an attention layer whose family
    calls attention ``calls`` times per forward on the same q and k (DiffLlama)."""
    name, sep, index = site.rpartition("#")
    if not sep or not index.isdigit() or name not in modules:
        return False
    layer = modules[name]
    if not families.is_attention_layer(layer):
        return False
    try:
        return int(index) < families.facts(layer).calls
    except ConfigError:  # a family outside the table: every call is a layer
        return False


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
