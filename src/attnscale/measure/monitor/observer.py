"""The monitor: a context manager that observes attention calls inside a model's forward passes.

It listens in two places, both attached on ``__enter__`` and removed on ``__exit__`` (also when the
body raises):

* an observer on attnscale's attention pipeline (:func:`attnscale.pipeline.add_observer`), which
  hands it the mechanism-prepared q and k, the scale, cap, mask and causality of every call of
  :func:`attnscale.attention.attention`: attnscale's MultiHeadAttention, bare mechanisms, Hugging
  Face models on ``attn_implementation="attnscale"``, and the logits a model formed itself and
  handed to :func:`attnscale.pipeline.observe_logits`.  Nothing is replaced or run again.  Where the
  pipeline's kernel forms the logits anyway (soft-cap on the CPU), the monitor takes the row
  statistics from that kernel (``Observation.request_rows``); elsewhere it scores q kᵀ
  blockwise itself (:mod:`attnscale.measure.monitor.blocks`).
* a tap on ``torch.nn.functional.scaled_dot_product_attention``, only for foreign models (HF on
  ``"sdpa"``, anything else calling SDPA); the SDPA call made inside attnscale's own pipeline is
  skipped (:func:`attnscale.pipeline.running`).  This tap is the one process-wide patch; it passes
  every call on unchanged and dispatches to the monitors active in the calling context.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.columns import RECORD_STATS
from attnscale.errors import ConfigError, check_int
from attnscale.mechanisms import Mechanism
from attnscale.measure.monitor.blocks import (DEFAULT_BLOCK, HeadStats, call_head_stats,
                                              logit_stats)
from attnscale.pipeline import Observation, add_observer, running

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


def _eager(method):
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


class _SdpaTap:
    """The tap on ``F.scaled_dot_product_attention`` for foreign models.

    Installed while at least one monitor is active anywhere in the process (a count), it calls the
    original with the very same arguments after handing the call to the monitors active in the
    calling context; calls made by attnscale's pipeline (whose observer already saw them) and
    calls made inside an observed SDPA call are skipped.
    """

    _monitors: contextvars.ContextVar[tuple[Monitor, ...]] = contextvars.ContextVar(
        "attnscale_sdpa_monitors", default=())
    _inside: contextvars.ContextVar[bool] = contextvars.ContextVar("attnscale_sdpa_inside",
                                                                   default=False)
    _users = 0
    _original = None
    _tap = None

    def __init__(self, mon: Monitor):
        self.mon = mon
        self.attached = True

    @classmethod
    def attach(cls, mon: Monitor) -> _SdpaTap:
        if cls._users == 0:
            cls._original = F.scaled_dot_product_attention
            cls._tap = cls._make(cls._original)
            F.scaled_dot_product_attention = cls._tap
        cls._users += 1
        cls._monitors.set(cls._monitors.get() + (mon,))
        return cls(mon)

    def remove(self) -> None:
        """Detach (idempotent); the patch goes when the last monitor in the process detaches."""
        if not self.attached:
            return
        self.attached = False
        cls = type(self)
        cls._monitors.set(tuple(m for m in cls._monitors.get() if m is not self.mon))
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
            for mon in cls._monitors.get():
                mon._sdpa_observer(*args, **kwargs)
            token = cls._inside.set(True)
            try:
                return original(*args, **kwargs)
            finally:
                cls._inside.reset(token)

        return tap


class Monitor:
    """Context manager that records attention statistics per (layer, head); see the module doc.

    Use :func:`monitor` to build one.  Records accumulate over every forward pass inside the
    ``with`` block (means are over all rows seen); :meth:`reset` starts over.
    """

    def __init__(self, model: nn.Module, *, block: int = DEFAULT_BLOCK, writer=None,
                 step: int = 0, every: int = 1,
                 on_call: Callable[[str, Observation], None] | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"monitor() needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.block = check_int("block", block, minimum=1)  # validated here, once
        self.writer = writer      # SummaryWriter-like: add_scalar(tag, value, step)
        self.step = check_int("step", step, minimum=0)  # index of the model's next forward pass
        self.every = check_int("every", every, minimum=1)
        if on_call is not None and not callable(on_call):
            raise ConfigError(f"on_call must be callable, got {type(on_call).__name__}.")
        self.on_call = on_call  # (site, observation) of every observed pipeline call
        self._observing = True  # whether the current forward pass is one in `every`
        self._totals: dict[str, HeadStats] = {}   # insertion order is layer order
        self._pending: dict[str, HeadStats] = {}  # since the last writer flush
        self._names: dict[nn.Module, str] = {}
        self._stack: list[list] = []  # [module, calls observed so far] per running module
        self._handles: list = []
        self._seen = 0        # attention calls observed in the current forward pass
        self._warned = False  # the "nothing observed" warning is given once per monitor
        self._sdpa_observer = self._observe_sdpa  # what the SDPA tap calls (see _eager)

    # -- attaching ---------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if self._handles:
            raise RuntimeError("this monitor is already active")
        try:
            self._names = module_names(self.model)
            push, pop, observe = _eager(self._push), _eager(self._pop), _eager(self._observe)
            self._sdpa_observer = _eager(self._observe_sdpa)
            for module in self._names:
                self._handles.append(module.register_forward_pre_hook(push, with_kwargs=True))
                # always_call: the stack is popped even when the forward raises.
                self._handles.append(module.register_forward_hook(pop, always_call=True))
            self._handles.append(add_observer(observe))
            self._handles.append(_SdpaTap.attach(self))
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
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _push(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._stack:
            # A forward pass enters the model: at its root, or at a submodule (Lightning's
            # training_step calling self.model, a loop calling model.encoder).  A recomputation
            # during backward (gradient checkpointing) is never observed.
            self._observing = False  # until _entered says otherwise (it may raise)
            self._observing = not recomputing() and self._entered(module, args, kwargs)
            self._seen = 0
        self._stack.append([module, 0])

    def _pop(self, module: nn.Module, args, output) -> None:
        if self._stack:
            self._stack.pop()
        if self._stack:
            return
        if module is self.model and self._observing and not self._seen:
            self._warn_unobserved()
        self.flush()  # what this forward pass saw goes to TensorBoard at its own step
        if module is self.model:
            self.step += 1  # ``step`` counts whole forward passes of the model

    def _entered(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether the forward pass entering the model at ``module`` now is observed: one in
        ``every`` (by :attr:`step`)."""
        return self.step % self.every == 0

    def _counts(self, module: nn.Module) -> bool:
        """Whether an attention call made by ``module`` inside an observed forward pass is
        observed: always, but for gradient checkpointing's recomputation (:func:`recomputing`)."""
        return not recomputing()

    def _warn_unobserved(self) -> None:
        """Warn (once) that a whole forward pass reached no call point the monitor observes."""
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"attnscale.monitor {self._unobserved()}", RuntimeWarning, stacklevel=2)

    def _unobserved(self) -> str:
        """Why a forward pass of the model reached no observed call, with what to do about it."""
        root = self._names.get(self.model, type(self.model).__name__)
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if impl == "eager":
            hint = ("it runs Hugging Face attn_implementation='eager', which is not observed; "
                    "use model.set_attn_implementation('attnscale') (or 'sdpa').")
        else:
            hint = "it calls neither attnscale.attention nor torch's scaled_dot_product_attention."
        return f"observed no attention call in a forward pass of {root}: {hint}"

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
        if not self._counts(frame[0]):
            return None
        frame[1] += 1
        name = self._names[frame[0]]
        return name if frame[1] == 1 else f"{name}#{frame[1] - 1}"

    # -- observing ---------------------------------------------------------------------------
    def _observe(self, seen: Observation) -> None:
        """Pipeline observer: statistics of what the pipeline computed, nothing run again."""
        if self._watching():
            # Rows with no key to attend are excluded here; the pipeline zeroes their output.
            self._add(seen.q, seen.k, seen=seen, scale=seen.scale, cap=seen.cap, mask=seen.mask,
                      causal=seen.causal, offset=seen.offset,
                      normaliser=seen.normaliser, sink=seen.sink)

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

    def _add(self, q: Tensor, k: Tensor, seen: Observation | None = None, **how) -> None:
        site = self._site()
        if site is None:
            return
        self._seen += 1
        if self.on_call is not None and seen is not None:
            self.on_call(site, seen)  # a record's `module` is this site
        # From the kernel that forms the logits, when the pipeline's path has one; the
        # statistics then arrive once the call's output is computed.
        gate = None if seen is None else seen.gate  # the output gate, where there is one
        if seen is not None and seen.logits is not None:  # formed by the model itself
            self._merge_logits(site, seen)
            return

        def from_kernel(rows: Tensor) -> None:
            weights = {} if gate is None else {"gate": gate.detach().double().mean(-1)}
            self._merge(site, HeadStats.from_rows(rows, weights))

        if (seen is not None and how.get("normaliser", "softmax") == "softmax"
                and seen.request_rows(from_kernel)):
            return
        self._merge(site, call_head_stats(q, k, block=self.block, gate=gate, **how))

    def _merge_logits(self, site: str, seen: Observation) -> None:
        """The statistics of a call whose logits the model handed over (``observe_logits``)."""
        self._merge(site, logit_stats(seen.logits, normaliser=seen.normaliser, sink=seen.sink,
                                      gate=seen.gate))

    def _merge(self, site: str, stats: HeadStats) -> None:
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
        Called at the end of every forward pass of the monitored model (wherever it entered)
        and on a clean exit.
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
            every: int = 1,
            on_call: Callable[[str, Observation], None] | None = None) -> Monitor:
    """Observe the attention statistics of ``model`` per (layer, head) inside a ``with`` block.

    Args:
        model: any ``nn.Module``; attnscale's MultiHeadAttention, an HF model running
            ``attn_implementation="attnscale"`` (or ``"sdpa"``), or anything calling SDPA.
        block: queries per statistics block (extra memory O(T · B · H · block · N) with T the
            number of torch threads); soft-cap attention on the CPU hands over statistics from
            its own kernel blocks instead, so ``block`` does not apply there.
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
    Returns:
        a :class:`Monitor`; after the block, ``mon.records`` and ``mon.to_frame()`` hold the
        statistics (entropy in nats, weights in [0, 1], logits in logit units).
    """
    return Monitor(model, block=block, writer=writer, step=step, every=every, on_call=on_call)


