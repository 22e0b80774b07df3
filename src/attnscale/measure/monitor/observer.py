"""The monitor: a context manager that observes attention calls inside a model's forward passes.

It listens in two places, both attached on ``__enter__`` and removed on ``__exit__`` (also when the
body raises):

* an observer on attnscale's attention pipeline (:func:`attnscale.pipeline.add_observer`), which
  hands it the mechanism-prepared q and k, the scale, cap, mask and causality of every call of
  :func:`attnscale.attention.attention`: attnscale's MultiHeadAttention, bare mechanisms, Hugging
  Face models on ``attn_implementation="attnscale"``, and the logits a model formed itself and
  handed to :func:`attnscale.pipeline.observe_logits`.  Nothing is replaced or run again.  Where the
  pipeline's kernel forms the logits anyway (soft-cap on the CPU), the monitor takes the row
  statistics from that kernel (``Observation.request_rows``); so it does for plain softmax on
  the CPU without gradients, where the pipeline then forms the logits once for the output and
  the statistics (:mod:`attnscale.kernels.softmax_rows`; the output equals SDPA's to float32
  rounding, ``monitor(exact_outputs=True)`` keeps its bits); elsewhere it scores q kᵀ
  blockwise itself (:mod:`attnscale.measure.monitor.blocks`).
* a tap on ``torch.nn.functional.scaled_dot_product_attention``, only for foreign models (HF on
  ``"sdpa"``, anything else calling SDPA); the SDPA call made inside attnscale's own pipeline is
  skipped (:func:`attnscale.pipeline.running`).  This tap is the one process-wide patch; it passes
  every call on unchanged and dispatches to the watches active in the calling context.

**The observer contract**, which :class:`Monitor` and :func:`attnscale.guard` both build on:

* :class:`Watch` attaches to a model for a ``with`` block and hands every attention call it
  observes, as a :class:`Call`, to one ``observe(call)`` function.  Its owner says which forward
  passes are observed (``selects``: the monitor's one in ``every``, the guard's training
  passes), which attention modules' calls count in them (``counts``; by default every call but
  gradient checkpointing's recomputation, :func:`recomputing`), and hears when a pass ends
  (``ended``, with the number of calls it observed: 0 is a model the watch cannot see).
* A :class:`Call` is one attention call: its ``site`` (the record name: the attention module's
  qualified name, ``name#1`` for its second call in one forward pass), q and k, scale, cap,
  mask and causality, the pipeline's :class:`~attnscale.pipeline.Observation` where it came
  through the pipeline, and what can be measured of it: :meth:`Call.statistics` (per-head
  :class:`~attnscale.measure.monitor.blocks.HeadStats`, from the kernel's rows where it formed the
  logits), :meth:`Call.most_keys` (from the pipeline's key counts) and :meth:`Call.peak_logits`
  (QK-Clip's S_max).
* :class:`Totals` keeps per-site statistics merged call by call; :meth:`Totals.take` hands them
  over and clears them (the guard once per recorded step, the monitor once per TensorBoard
  flush, beside the totals of its whole ``with`` block).
"""

from __future__ import annotations

import contextvars
import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.columns import RECORD_STATS
from attnscale.errors import ConfigError, check_int
from attnscale.kernels.differential import split_maps
from attnscale.kernels.peak import head_peaks
from attnscale.mechanisms import Mechanism
from attnscale.mechanisms.base import inv_sqrt
from attnscale.measure.monitor.blocks import (DEFAULT_BLOCK, HeadStats, call_head_stats,
                                              logit_stats)
from attnscale.pipeline import MASKED_BIAS, Observation, Scale, add_observer, running

# The keys of every record, in order (the column order of ``to_frame`` and ``records.json``).
RECORD_KEYS = ("layer", "head", "module", "queries", *RECORD_STATS)
# The statistics a TensorBoard writer receives, per (layer, head) and per layer.
SCALAR_KEYS = RECORD_STATS
# The attribute torch.compile's wrapper (OptimizedModule) keeps the compiled module under; it
# appears in qualified names as a path segment.
COMPILED_SEGMENT = "_orig_mod"

# The autograd engine's id of the backward pass running in this thread, -1 outside one.  torch
# has no public name for it; torch.utils.checkpoint keys its non-reentrant recomputation on it.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def recomputing() -> bool:
    """Whether the caller runs inside a backward pass.  A forward made there is gradient
    checkpointing's recomputation (``torch.utils.checkpoint``, reentrant or not, which HF's
    ``gradient_checkpointing_enable()`` uses): it repeats a forward pass already observed, on the
    same weights and inputs, so it is never an observation of its own."""
    return _graph_task_id() >= 0


def eager(method):
    """``method`` run as plain Python even inside a ``torch.compile``-d model
    (``torch.compiler.disable``: a graph break, never traced), so that a compiled model or
    submodule is observed as the same model run eagerly.  Only once the compiler is loaded in
    this process (``torch.compile`` loads it; loading it costs a second or two): before, nothing
    can be compiled."""
    if "torch._dynamo" not in sys.modules:
        return method
    return torch.compiler.disable(method)


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Every module of ``model`` -> the name observations are attributed to: its qualified name
    as in the model before ``torch.compile`` (the compiled wrapper's ``_orig_mod`` segments left
    out: ``_orig_mod.model.layers.0`` -> ``model.layers.0``), the model's class name for the
    root (the compiled module's class for a compiled root)."""
    inner = getattr(model, COMPILED_SEGMENT, None)
    root = type(inner if isinstance(inner, nn.Module) else model).__name__
    names = {}
    for name, module in model.named_modules():
        names.setdefault(module, ".".join(p for p in name.split(".") if p != COMPILED_SEGMENT)
                         or root)
    return names


@dataclass(frozen=True)
class Call:
    """One observed attention call, as a :class:`Watch` hands it to its owner.

    From attnscale's pipeline, ``observation`` is the pipeline's own
    :class:`~attnscale.pipeline.Observation` (q and k after the mechanism; ``q``/``k`` None for
    logits handed to :func:`~attnscale.pipeline.observe_logits`); from a foreign model's SDPA
    call, q and k are SDPA's, ``scale`` None is SDPA's 1/√d, and ``observation`` is None.  The
    tensors are the model's own: read them, never modify them.
    """

    site: str                    # the record's name: the module's, "name#i" for its (i+1)-th call
    layer: str                   # the attention module's name (the site without "#i")
    q: Tensor | None             # (B, H, Nq, d)
    k: Tensor | None             # (B, Hk, Nk, d), H % Hk == 0 (grouped-query attention)
    scale: Scale | None          # the logits are cap(scale · q kᵀ + offset); None: 1/√d
    cap: float | None            # soft-cap c, or None
    mask: Tensor | None          # boolean (True = attend) or additive float, without causality
    causal: bool                 # top-left causal, on top of ``mask``
    observation: Observation | None = None  # the pipeline's (None: an SDPA-tapped call)

    @property
    def logits(self) -> Tensor | None:
        """(B, H, Nq, Nk) logits the model formed itself and handed over, masked at -inf."""
        return None if self.observation is None else self.observation.logits

    @property
    def offset(self) -> float | Tensor:
        return 0.0 if self.observation is None else self.observation.offset

    @property
    def normaliser(self) -> str:
        return "softmax" if self.observation is None else self.observation.normaliser

    @property
    def sink(self) -> Tensor | None:
        return None if self.observation is None else self.observation.sink

    @property
    def gate(self) -> Tensor | None:
        return None if self.observation is None else self.observation.gate

    @property
    def lam(self) -> Tensor | None:
        """λ of the ``"differential"`` normaliser (0-d), None under the others."""
        return None if self.observation is None else self.observation.lam

    @property
    def peaks_in_statistics(self) -> bool:
        """Whether :meth:`statistics`' ``logit_max`` is :meth:`peak_logits` (logits scored from
        q and k without a cap), so that a caller wanting both scores the logits once."""
        return self.logits is None and self.cap is None and not self.biased

    @property
    def biased(self) -> bool:
        """Whether the call's logits carry a logit bias, which no rescaling of W_Q and W_K moves:
        the caller's (T5's relative position bias, ALiBi; in the additive mask) or the
        mechanism's own (forgetting's forget gates, selective attention's selection)."""
        seen = self.observation
        return seen is not None and (seen.bias is not None or seen.mechanism_bias is not None)

    def most_keys(self) -> int:
        """The most keys one query of the call attends (the n of the entropy's range [0, ln n]):
        the pipeline's key counts where the call came through it, else (SDPA) Nk less the keys a
        boolean or additive mask (entries at or below :data:`~attnscale.pipeline.MASKED_BIAS`)
        hides and top-left causality."""
        if self.observation is not None:
            n = self.observation.n_keys
            if isinstance(n, Tensor):
                return int(n.max()) if n.numel() else 0
            return int(n)
        n_q, n_k = self.q.shape[-2], self.k.shape[-2]
        if self.mask is None:
            return min(n_q, n_k) if self.causal else n_k
        keep = self.mask if self.mask.dtype == torch.bool else self.mask > MASKED_BIAS
        if self.causal:
            keep = keep & torch.ones(n_q, n_k, dtype=torch.bool, device=keep.device).tril()
        return int(keep.sum(-1).max()) if keep.numel() else 0

    def peak_logits(self) -> Tensor | None:
        """Per head, the largest logit over the keys each query attends, before any soft-cap and
        without a logit bias, the caller's position bias or the mechanism's own (QK-Clip's S_max,
        the logit W_Q and W_K make; :func:`attnscale.kernels.peak.head_peaks`): float64 (H,).
        Under the differential normaliser, the larger of its two maps'.  Of handed-over logits,
        their largest (None when there is none)."""
        if self.logits is not None:
            z = self.logits
            return z.amax(dim=(0, 2, 3)) if z.numel() else None
        scale = inv_sqrt(self.q.shape[-1]) if self.scale is None else self.scale
        mask = self.mask
        if (self.observation is not None and self.observation.bias is not None
                and mask is not None and mask.dtype != torch.bool):  # the keys, not the bias
            mask = mask > MASKED_BIAS
        if self.normaliser == "differential":  # two maps, of q's and k's halves: the larger
            (q1, q2), (k1, k2) = split_maps(self.q), split_maps(self.k)
            return torch.maximum(head_peaks(q1, k1, scale, mask=mask, causal=self.causal),
                                 head_peaks(q2, k2, scale, mask=mask, causal=self.causal))
        return head_peaks(self.q, self.k, scale, mask=mask, causal=self.causal)

    def statistics(self, then: Callable[[HeadStats], None], *, block: int,
                   exact_outputs: bool = False) -> None:
        """Hand ``then`` the call's per-head statistics: of handed-over logits; from the row
        statistics of the kernel that forms the logits where the pipeline offers them (softmax;
        ``then`` runs once the call's output is computed); else scored from q and k, ``block``
        queries at a time (:func:`~attnscale.measure.monitor.blocks.call_head_stats`: ``block``
        is not validated again).  Rows with no key to attend are left out (the pipeline zeroes
        their output).  ``exact_outputs``: take the pipeline's rows only where that leaves the
        output bit for bit (``Observation.rows_exact``), not where the pipeline would swap SDPA
        for its blockwise softmax kernel to form them."""
        if self.logits is not None:
            then(logit_stats(self.logits, normaliser=self.normaliser, sink=self.sink,
                             gate=self.gate, lam=self.lam))
            return
        gate = self.gate  # the output gate, summarised as its mean per row

        def from_kernel(rows: Tensor) -> None:
            weights = {} if gate is None else {"gate": gate.detach().double().mean(-1)}
            then(HeadStats.from_rows(rows, weights))

        if (self.observation is not None and self.normaliser == "softmax"
                and (self.observation.rows_exact or not exact_outputs)
                and self.observation.request_rows(from_kernel)):
            return
        then(call_head_stats(self.q, self.k, scale=self.scale, cap=self.cap, mask=self.mask,
                             causal=self.causal, block=block, offset=self.offset,
                             normaliser=self.normaliser, sink=self.sink, gate=gate,
                             lam=self.lam))


class Totals(dict):
    """Per-site :class:`~attnscale.measure.monitor.blocks.HeadStats` (``dict[str, HeadStats]``),
    merged call by call, in the order the sites were first seen (the layer order of records)."""

    def add(self, site: str, stats: HeadStats) -> None:
        """Merge ``stats`` into ``site``'s totals."""
        self[site] = self[site].merge(stats) if site in self else stats

    def take(self) -> dict[str, HeadStats]:
        """The totals so far, which are then cleared (the next ones start from nothing)."""
        out = dict(self)
        self.clear()
        return out


class _SdpaTap:
    """The tap on ``F.scaled_dot_product_attention`` for foreign models.

    Installed while at least one watch is active anywhere in the process (a count), it calls the
    original with the very same arguments after handing the call to the watches active in the
    calling context; calls made by attnscale's pipeline (whose observer already saw them) and
    calls made inside an observed SDPA call are skipped.
    """

    _watches: contextvars.ContextVar[tuple[Watch, ...]] = contextvars.ContextVar(
        "attnscale_sdpa_watches", default=())
    _inside: contextvars.ContextVar[bool] = contextvars.ContextVar("attnscale_sdpa_inside",
                                                                   default=False)
    _users = 0
    _original = None
    _tap = None

    def __init__(self, watch: Watch):
        self.watch = watch
        self.attached = True

    @classmethod
    def attach(cls, watch: Watch) -> _SdpaTap:
        if cls._users == 0:
            cls._original = F.scaled_dot_product_attention
            cls._tap = cls._make(cls._original)
            F.scaled_dot_product_attention = cls._tap
        cls._users += 1
        cls._watches.set(cls._watches.get() + (watch,))
        return cls(watch)

    def remove(self) -> None:
        """Detach (idempotent); the patch goes when the last watch in the process detaches."""
        if not self.attached:
            return
        self.attached = False
        cls = type(self)
        cls._watches.set(tuple(w for w in cls._watches.get() if w is not self.watch))
        cls._users -= 1
        if cls._users == 0:
            if F.scaled_dot_product_attention is cls._tap:  # a later patch keeps its place
                F.scaled_dot_product_attention = cls._original
            cls._original = cls._tap = None

    @classmethod
    def _make(cls, original):
        @functools.wraps(original)
        def tap(*args, **kwargs):
            if running() or cls._inside.get():
                return original(*args, **kwargs)
            for watch in cls._watches.get():
                watch._sdpa_observer(*args, **kwargs)
            token = cls._inside.set(True)
            try:
                return original(*args, **kwargs)
            finally:
                cls._inside.reset(token)

        return tap


def _every_pass(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    return True


def _not_recomputed(module: nn.Module) -> bool:
    return not recomputing()


class Watch:
    """Attach to ``model`` for a ``with`` block and hand each observed attention call to
    ``observe(call)`` (a :class:`Call`); see the module doc.

    Every submodule gets a forward pre-hook and an always-called forward hook that keep a stack
    of the modules running; a call is attributed to the innermost one that is not a mechanism.

    Args:
        model: the module whose forward passes are watched (entered at its root or at any
            submodule).
        observe: called with every observed call.
        selects: ``selects(module, args, kwargs)`` when a forward pass enters the model at
            ``module``: whether the pass is observed (default: every pass).  Never asked for
            gradient checkpointing's recomputation, which is never observed.
        counts: ``counts(module)``: whether an attention call of ``module`` inside an observed
            pass is observed (default: every call but a recomputation, :func:`recomputing`).
        ended: ``ended(module, calls)`` when a forward pass that entered the model at ``module``
            has left it (also when it raised): ``calls`` observed in it, None for a pass not
            selected.
    """

    def __init__(self, model: nn.Module, observe: Callable[[Call], None], *,
                 selects: Callable[[nn.Module, tuple, dict], bool] = _every_pass,
                 counts: Callable[[nn.Module], bool] = _not_recomputed,
                 ended: Callable[[nn.Module, int | None], None] | None = None):
        self.model = model
        self.observe, self.selects, self.counts, self.ended = observe, selects, counts, ended
        self.names: dict[nn.Module, str] = {}  # module -> its name in records (module_names)
        self._observing = True  # whether the current forward pass is selected
        self._stack: list[list] = []  # [module, calls observed so far] per running module
        self._handles: list = []
        self._seen = 0  # attention calls observed in the current forward pass
        self._sdpa_observer = self._observe_sdpa  # what the SDPA tap calls (see eager)

    @property
    def active(self) -> bool:
        """Whether the watch is attached (inside its ``with`` block)."""
        return bool(self._handles)

    def __enter__(self) -> Watch:
        if self._handles:
            raise RuntimeError("this watch is already active")
        try:
            self.names = module_names(self.model)
            push, pop = eager(self._push), eager(self._pop)
            self._sdpa_observer = eager(self._observe_sdpa)
            for module in self.names:
                self._handles.append(module.register_forward_pre_hook(push, with_kwargs=True))
                # always_call: the stack is popped even when the forward raises.
                self._handles.append(module.register_forward_hook(pop, always_call=True))
            self._handles.append(add_observer(eager(self._observe_pipeline)))
            self._handles.append(_SdpaTap.attach(self))
        except BaseException:
            self.detach()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()

    def detach(self) -> None:
        """Remove every hook, observer and tap (idempotent)."""
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def unobserved(self) -> str:
        """Why a forward pass of the model reached no observed call, with what to do about it."""
        root = self.names.get(self.model, type(self.model).__name__)
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if impl == "eager":
            hint = ("it runs Hugging Face attn_implementation='eager', which is not observed; "
                    "use model.set_attn_implementation('attnscale') (or 'sdpa').")
        else:
            hint = "it calls neither attnscale.attention nor torch's scaled_dot_product_attention."
        return f"observed no attention call in a forward pass of {root}: {hint}"

    # -- the module stack --------------------------------------------------------------------
    def _push(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._stack:
            # A forward pass enters the model: at its root, or at a submodule (Lightning's
            # training_step calling self.model, a loop calling model.encoder).  A recomputation
            # during backward (gradient checkpointing) is never observed.
            self._observing = False  # until selects says otherwise (it may raise)
            self._observing = not recomputing() and self.selects(module, args, kwargs)
            self._seen = 0
        self._stack.append([module, 0])

    def _pop(self, module: nn.Module, args, output) -> None:
        if self._stack:
            self._stack.pop()
        if self._stack or self.ended is None:
            return
        self.ended(module, self._seen if self._observing else None)

    def _site(self) -> tuple[str, str] | None:
        """``(site, layer)`` of a call now: the innermost running attention module's name, and
        for its second call in one forward ``name#1``.  A mechanism called as a module is
        attributed to its owner.  None outside an observed pass or for a call not counted."""
        if not self._stack or not self._observing:
            return None
        frames = [f for f in self._stack if not isinstance(f[0], Mechanism)] or self._stack
        frame = frames[-1]
        if not self.counts(frame[0]):
            return None
        frame[1] += 1
        name = self.names[frame[0]]
        return (name if frame[1] == 1 else f"{name}#{frame[1] - 1}"), name

    def _observe_pipeline(self, seen: Observation) -> None:
        """Pipeline observer: what the pipeline computed, nothing run again."""
        where = self._site()
        if where is None:
            return
        self._seen += 1
        self.observe(Call(*where, seen.q, seen.k, seen.scale, seen.cap, seen.mask, seen.causal,
                          seen))

    def _observe_sdpa(self, query: Tensor, key: Tensor, value: Tensor,
                      attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, **_) -> None:
        """Observer with SDPA's signature: (..., L, E) query, (..., S, E) key, mask (.., L, S)."""
        if not self._stack or not self._observing or getattr(query, "is_nested", False):
            return
        if query.dim() == 3:  # (N, L, E): one head
            query, key = query.unsqueeze(-3), key.unsqueeze(-3)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(-3)
        if query.dim() != 4 or key.dim() != 4:
            return  # SDPA's rarely used (N, ..., L, E) ranks are not observed
        where = self._site()
        if where is None:
            return
        self._seen += 1
        # is_causal in SDPA is top-left aligned: query i sees keys 0..i.
        self.observe(Call(*where, query, key, scale, None, attn_mask, bool(is_causal)))


class Monitor:
    """Context manager that records attention statistics per (layer, head); see the module doc.

    Use :func:`monitor` to build one.  Records accumulate over every forward pass inside the
    ``with`` block (means are over all rows seen); :meth:`reset` starts over.
    """

    def __init__(self, model: nn.Module, *, block: int = DEFAULT_BLOCK, writer=None,
                 step: int = 0, every: int = 1,
                 on_call: Callable[[str, Observation], None] | None = None,
                 exact_outputs: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"monitor() needs a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(exact_outputs, bool):
            raise ConfigError(f"exact_outputs must be True or False, got {exact_outputs!r}.")
        self.model = model
        self.exact_outputs = exact_outputs
        self.block = check_int("block", block, minimum=1)  # validated here, once
        self.writer = writer      # SummaryWriter-like: add_scalar(tag, value, step)
        self.step = check_int("step", step, minimum=0)  # index of the model's next forward pass
        self.every = check_int("every", every, minimum=1)
        if on_call is not None and not callable(on_call):
            raise ConfigError(f"on_call must be callable, got {type(on_call).__name__}.")
        self.on_call = on_call  # (site, observation) of every observed pipeline call
        self._totals = Totals()   # over the with block (until reset)
        self._pending = Totals()  # since the last writer flush
        self._warned = False  # the "nothing observed" warning is given once per monitor
        self._watch = Watch(model, self._observe, selects=self._selects, ended=self._ended)

    # -- attaching ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if self._watch.active:
            raise RuntimeError("this monitor is already active")
        self._watch.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self._watch.detach()

    def _selects(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A forward pass entering the model is observed when it is one in ``every`` (by
        :attr:`step`)."""
        return self.step % self.every == 0

    def _ended(self, module: nn.Module, calls: int | None) -> None:
        if module is self.model and calls == 0 and not self._warned:
            self._warned = True
            warnings.warn(f"attnscale.monitor {self._watch.unobserved()}", RuntimeWarning,
                          stacklevel=2)
        self.flush()  # what this forward pass saw goes to TensorBoard at its own step
        if module is self.model:
            self.step += 1  # ``step`` counts whole forward passes of the model

    # -- observing ---------------------------------------------------------------------------
    def _observe(self, call: Call) -> None:
        if self.on_call is not None and call.observation is not None:
            self.on_call(call.site, call.observation)  # a record's `module` is this site
        call.statistics(functools.partial(self._merge, call.site), block=self.block,
                        exact_outputs=self.exact_outputs)

    def _merge(self, site: str, stats: HeadStats) -> None:
        self._totals.add(site, stats)
        self._pending.add(site, stats)

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
        Called at the end of every forward pass of the monitored model (wherever it entered)
        and on a clean exit.
        """
        pending = self._pending.take()
        if self.writer is None or not pending:
            return
        layers = {module: layer for layer, module in enumerate(self._totals)}
        for module, stats in pending.items():
            layer = layers[module]
            per_head, pooled = stats.means(), stats.pooled().means()
            for key in SCALAR_KEYS:
                for head, value in enumerate(per_head[key]):
                    self.writer.add_scalar(f"attnscale/{key}/layer{layer}/head{head}", value,
                                           self.step)
                self.writer.add_scalar(f"attnscale/{key}/layer{layer}", pooled[key][0], self.step)


def monitor(model: nn.Module, *, block: int = DEFAULT_BLOCK, writer=None, step: int = 0,
            every: int = 1,
            on_call: Callable[[str, Observation], None] | None = None,
            exact_outputs: bool = False) -> Monitor:
    """Observe the attention statistics of ``model`` per (layer, head) inside a ``with`` block.

    Args:
        model: any ``nn.Module``; attnscale's MultiHeadAttention, an HF model running
            ``attn_implementation="attnscale"`` (or ``"sdpa"``), or anything calling SDPA.
        block: queries per statistics block (extra memory O(T · B · H · block · N) with T the
            number of torch threads); soft-cap attention on the CPU, and softmax on the CPU
            under ``torch.no_grad()`` (see ``exact_outputs``), hand over statistics from their
            own kernel blocks instead, so ``block`` does not apply there.
        writer: optional TensorBoard ``SummaryWriter`` (anything with ``add_scalar``); receives
            the per-(layer, head) and per-layer statistics after every forward pass.
        step: index of the first forward pass, the TensorBoard step its scalars are logged at;
            it counts forward passes of ``model`` and can be set at any time (``mon.step = i``).
        every: observe one forward pass of ``model`` in ``every`` (those whose step is a multiple
            of it), so a training loop pays for the statistics only there.
        on_call: optional ``fn(site, observation)``, called with the record's ``module`` name and
            the pipeline's :class:`~attnscale.pipeline.Observation` of every pipeline call the
            monitor records (not SDPA-tapped calls), for measurements of q and k beyond the row
            statistics (``attnscale inspect``'s coherence).
        exact_outputs: keep the model's outputs bit for bit.  By default, a softmax call on the
            CPU in float32 under ``torch.no_grad()`` runs on attnscale's blockwise softmax
            kernel, which forms the logits once for the output and the statistics (about a
            fifth of a small Llama's forward saved on one core, benchmarks/bench_monitor.py);
            its output equals SDPA's to float32 rounding, not bit for bit.  With True, SDPA
            runs as unmonitored and the monitor scores q kᵀ beside it.  Outputs with gradients
            are never touched: there the calls run as unmonitored either way.
    Returns:
        a :class:`Monitor`; after the block, ``mon.records`` and ``mon.to_frame()`` hold the
        statistics (entropy in nats, weights in [0, 1], logits in logit units).
    """
    return Monitor(model, block=block, writer=writer, step=step, every=every, on_call=on_call,
                   exact_outputs=exact_outputs)


