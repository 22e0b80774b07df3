"""The guard: attention-temperature records, alarms and QK-Clip inside a training loop.

::

    with attnscale.guard(model, optimizer=opt, qk_clip=100, every=10,
                         log="runs/guard.jsonl") as g:
        for step, batch in enumerate(loader):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            g.step(step)          # after the optimizer step: records, alarms
            if g.should_stop:     # on_alarm="stop"
                break

**What it observes.**  The guard is built on the monitor's observer contract
(:mod:`attnscale.measure.monitor.observer`): a :class:`~attnscale.measure.monitor.observer.Watch`
(the pipeline observer and the SDPA tap) hands it each call, attributed to the attention module
that made it, and the call's statistics, key count and S_max come from its
:class:`~attnscale.measure.monitor.observer.Call`.  The model's outputs are bit for bit those
without the guard.  Only the forward passes of a *training step* count, however the trainer calls
the model: a forward pass that enters the model (at its root, or at a submodule as Lightning's
``training_step`` calling ``self.model`` does) in training mode with grad enabled, and in it the
calls of attention modules in training mode.  Evaluation and prediction passes (``eval()`` or
``torch.no_grad()``), sanity checks and generation never count, nor does gradient checkpointing's
recomputation during backward (:func:`attnscale.measure.monitor.observer.recomputing`); a reentrant
checkpoint's first forward, which runs without grad inside a training forward, does.  A recorded
step is the first one and every step whose label (the ``step`` passed to :meth:`Guard.step`) is a
multiple of ``every``.  A ``torch.compile``-d model or submodule is observed as the same model run
eagerly: the guard's hooks are graph breaks, run as plain Python.

**Records** (:data:`GUARD_KEYS`), one per (step, layer, head), over every query row of that step's
training forward passes and only the keys each query attends (``n_keys``: the most keys in one of
the layer's calls, the n of the entropy's range [0, ln n]), with the statistics of
:data:`attnscale.columns.GUARD_STATS`: ``logit_max`` (largest pre-softmax logit, signed),
``logit_absmax``, ``entropy_min`` and ``entropy_mean`` (nats), ``max_weight_mean``,
``jacobian_fro_mean`` (the mean Frobenius norm of the softmax Jacobian, the essay's gradient-flow
quantity), ``logit_std``; then ``logit_std_ratio`` (``logit_std``'s ratio to the head's value at
the first recorded step: how far the temperature has drifted from where it started), and with the
clip ``s_max`` and ``clip_gamma`` (the factor the head's logits were multiplied by at that step, 1
= untouched).  :meth:`Guard.record_next` records the next step whatever its label.  They go to
``Guard.records`` / :meth:`Guard.to_frame`, to a JSONL file (``log=``, :mod:`attnscale.guard.log`),
to a TensorBoard ``SummaryWriter`` (``writer=``) and, per layer, to :attr:`Guard.latest` (what the
HF and Lightning callbacks hand to their loggers).  Per layer the spread over heads is
:func:`layer_rows`.  Logits a model formed itself reach the guard through
:func:`attnscale.pipeline.observe_logits`.

**Data parallelism** (``torch.distributed`` initialised): on a recorded step the statistics are
all-reduced over the ranks (sums, minima and maxima), so every rank records the same rows, over
the whole global batch, and its alarms fire alike (``on_alarm="stop"`` stops every rank at the
same step); rank 0 alone writes the log and the writer.

**Resuming** (``resume=step``: the run continues from a checkpoint taken after ``step``): the log
is appended to, after a resume mark that supersedes the records a stopped run wrote past its
checkpoint (:mod:`attnscale.guard.log`), and the references (each head's first recorded values,
the base of ``logit_std_ratio`` and of the entropy-collapse alarm; the layer numbers; the alarms
holding) are read back from the log, or from :meth:`Guard.state_dict` saved with the checkpoint
(:meth:`Guard.load_state_dict`).  The callbacks do this from their trainers' own checkpoints.

**Alarms**, per head, on recorded steps: ``max_logit`` when ``logit_max`` exceeds
``alarm_logit`` (attention-logit growth precedes divergence: Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities", arXiv 2309.14322); ``entropy_floor``
when the head's mean entropy falls below ``alarm_entropy_floor`` nats and ``entropy_collapse`` when
it falls below ``alarm_entropy_fraction`` of its first recorded value (entropy collapse: Zhai et
al. 2023, "Stabilizing Transformer Training by Preventing Attention Entropy Collapse", arXiv
2303.06296).  The mean over rows, not the row minimum: under causality the first query has one
key, so every causal head's minimum entropy is 0 from the start.  An alarm acts when it starts
(not again while it holds): ``on_alarm="warn"`` (one line naming layer, head, step and value),
``"raise"`` (:class:`GuardAlarm`, after the step's records are written), ``"stop"``
(:attr:`Guard.should_stop`; the callbacks stop their trainers) or a callable given the alarm dict.

A model built with attnscale's ``qk-clip`` mechanism carries its own clip (its τ, α and S_max):
given the optimizer, the guard installs it (:func:`attnscale.mechanisms.qk_clip.install`).

**QK-Clip** (``qk_clip=τ``; :mod:`attnscale.guard.clip` for the rule, GQA and where the factor
goes).  S_max per head is tracked over every training forward pass, recorded or not, from the
logits before any soft-cap; with an optimizer the clip runs as its step post-hook, otherwise in
:meth:`Guard.step`.  One clipping guard per attention layer: a second guard with ``qk_clip`` on
a layer that one already clips is refused (it would clip twice); guards without the clip may
watch beside it.  Two modes:

* K2's (default): S_max comes from the forward passes *before* the step and the factor is applied
  *after* it, so the step's own update is not measured.  Documented overshoot: after the clip, a
  head's largest logit on the batches it was measured on is ``τ · S'/S``, with S its S_max before
  the step and S' after the step, before the clip: one step's growth over τ (the next clip catches
  it).
* strict (``strict=True``): the guard keeps each training forward pass of the step (the module it
  entered and its inputs, by reference, with the autocast it ran under); after the step it runs
  them again in ``eval()`` under ``torch.no_grad()`` (no RNG drawn: no dropout; no KV cache built)
  and clips *during* that walk, layer by layer: when attention layer l has run on its actual
  inputs (the layers below it already clipped), its S_max on the stepped weights gives its
  factors, and a clipped layer runs once more on the same inputs with the clipped weights, so the
  layers above it see what the clipped model computes; that second run measures the layer's peak
  after the clip (:attr:`Guard.strict_peaks`).  One walk suffices when the step made one forward
  pass that called each attention layer once: the largest logit on that batch is then at most
  τ · (1 + :func:`strict_rtol`) after every step, for one extra forward plus a second run of the
  clipped attention layers alone.  Where a later clip can change what an earlier measurement saw
  (several forward passes in the step, as gradient accumulation makes; a layer called twice; a
  KV cache handed to the layers, which cannot be run twice), the walk is repeated until one
  leaves nothing out of date, at most once per layer plus one (layer l's inputs stop changing
  once the layers below it are settled); :attr:`Guard.strict_passes` counts them.  "Over τ" is
  taken to the rounding tolerance of :func:`strict_rtol`, so a head clipped to τ that re-reads a
  rounding above it is not clipped again.  A forward pass entered on an activation of the step (a
  tensor with a ``grad_fn``: ``training_step`` feeding one submodule's output to another) cannot
  be run again on the stepped weights and is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import warnings
import weakref
import zlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnscale.columns import GUARD_STATS, MONITOR_SUMMARIES, named
from attnscale.errors import ConfigError, check_float, check_int, did_you_mean
from attnscale.guard.clip import clip_sites
from attnscale.guard.log import (
    ALARMS, GUARD_KEYS, LogScan, read_log, repair_log, resume_mark, scan_log,
)
from attnscale.io import atomic_write, check_output_path, json_safe, owned
from attnscale.measure.monitor.blocks import DEFAULT_BLOCK, HeadStats
from attnscale.measure.monitor.observer import (
    Call, Totals, Watch, eager, module_names, recomputing,
)
from attnscale.mechanisms import qk_clip as qk_clip_mechanism
from attnscale.mechanisms.qk_clip import K2_ALPHA, K2_TAU

# Default max-logit alarm: K2's QK-Clip threshold, the logit scale past which K2 saw instability.
DEFAULT_ALARM_LOGIT = K2_TAU
# Default entropy-collapse alarm: a head's mean entropy under a tenth of its first value.
DEFAULT_ALARM_ENTROPY_FRACTION = 0.1
ON_ALARM = ("warn", "raise", "stop")
# The statistics of attnscale.columns this module reads by name (the alarms, Guard.latest,
# layer_rows): a ValueError at import if one is renamed there.
named("logit_max", "entropy_mean", "logit_std")
# The per-head scalars a TensorBoard writer receives on each recorded step (the records, the log
# and Guard.records carry every statistic of GUARD_KEYS).
WRITER_KEYS = (*named("logit_max", "entropy_min", "entropy_mean", "max_weight_mean"),
               "logit_std_ratio")
# Strict mode's rounding tolerance on "over τ" (strict_rtol), relative, in two parts.  A head
# clipped to exactly τ is measured again from weights rounded after the multiply (each element
# within half an epsilon of η^α W), q = W x summed again in float32 over the model's width, and
# q·k summed again, so its largest logit reads τ give or take a few roundings, above as often as
# below.  (1) float32 accumulation, whatever the dtype of q and k: 2^-16 = 128 float32 epsilons.
# Measured on random HF Llamas under AdamW, the worst excess over τ of a clipped head grows with
# the width like its square root: 3 ε at width 256, 7 at 576, 11 at 1024; SmolLM2-135M (width
# 576, benchmarks/bench_guard.py --real) at most 8.1 in 26 Trainer steps.  128 ε covers widths
# of about 10^5 by that trend.
STRICT_RTOL_FLOAT32 = 2.0**-16
# (2) q and k rounded to a half dtype (autocast, a bfloat16 model): 4 of its epsilons (measured
# worst 1.3 bfloat16 epsilons on the same Llamas under a bfloat16 autocast).
STRICT_EPS = 4
# The per-layer scalars of Guard.latest, each with the way two steps' values combine into the
# worse of them (worst()): the largest logit and spread, the lowest entropy, the largest drift.
LATEST_KEYS = {"logit_max": max, "logit_max_spread": max, "entropy_mean_min": min,
               "entropy_mean_spread": max, "logit_std_ratio_max": max}
# The state_dict() layout this module writes and reads.
STATE_VERSION = 1
# Attention modules under a clipping guard now -> that guard (one clip per layer).
_CLIPPING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GuardAlarm(RuntimeError):
    """Raised by ``on_alarm="raise"``; ``.alarm`` is the alarm dict."""

    def __init__(self, message: str, alarm: dict):
        super().__init__(message)
        self.alarm = alarm


def _optional_positive(param: str, value: object) -> float | None:
    return None if value is None else check_float(param, value, positive=True)


def _check_options(*, every: int, log, writer, qk_clip, alpha, strict, alarm_logit,
                   alarm_entropy_floor, alarm_entropy_fraction, on_alarm, block,
                   force) -> dict:
    """The options of :func:`guard` but the model, the optimizer and ``resume``, validated (a
    one-line ConfigError naming the option) and canonical: numbers as floats, ``log`` as a Path
    of the right form (whether an existing file may be written is decided with ``resume``)."""
    out = {"every": check_int("every", every, minimum=1),
           "block": check_int("block", block, minimum=1),
           "qk_clip": _optional_positive("qk_clip", qk_clip),
           "alpha": check_float("alpha", alpha),
           "alarm_logit": _optional_positive("alarm_logit", alarm_logit),
           "alarm_entropy_floor": _optional_positive("alarm_entropy_floor", alarm_entropy_floor),
           "alarm_entropy_fraction": _optional_positive("alarm_entropy_fraction",
                                                        alarm_entropy_fraction)}
    if not 0.0 <= out["alpha"] <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha!r}.")
    for name, flag in (("strict", strict), ("force", force)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{name} must be True or False, got {flag!r}.")
    if strict and out["qk_clip"] is None:
        raise ConfigError("strict=True is a mode of the clip; give qk_clip=tau as well.")
    out["strict"] = strict
    if out["alarm_entropy_fraction"] is not None and out["alarm_entropy_fraction"] >= 1:
        raise ConfigError(f"alarm_entropy_fraction must be in (0, 1), got "
                          f"{alarm_entropy_fraction!r}.")
    if not callable(on_alarm) and on_alarm not in ON_ALARM:
        raise ConfigError(f"on_alarm must be one of {', '.join(ON_ALARM)} or a callable, "
                          f"got {on_alarm!r}.")
    if writer is not None and not callable(getattr(writer, "add_scalar", None)):
        raise ConfigError("writer must have add_scalar(tag, value, step) (a TensorBoard "
                          "SummaryWriter).")
    # The form only (a file name, .jsonl, a writable folder): force=True here.
    out["log"] = None if log is None else check_output_path("log", log, suffixes=(".jsonl",),
                                                            force=True)
    return out


class Guard:
    """See the module doc; build it with :func:`guard`."""

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 every: int = 10, log: str | os.PathLike | None = None, writer=None,
                 qk_clip: float | None = None, alpha: float = K2_ALPHA, strict: bool = False,
                 alarm_logit: float | None = DEFAULT_ALARM_LOGIT,
                 alarm_entropy_floor: float | None = None,
                 alarm_entropy_fraction: float | None = DEFAULT_ALARM_ENTROPY_FRACTION,
                 on_alarm: str | Callable[[dict], None] = "warn", block: int = DEFAULT_BLOCK,
                 resume: int | None = None, force: bool = False):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}.")
        self.model, self.optimizer = model, optimizer
        options = _check_options(
            every=every, log=log, writer=writer, qk_clip=qk_clip, alpha=alpha, strict=strict,
            alarm_logit=alarm_logit, alarm_entropy_floor=alarm_entropy_floor,
            alarm_entropy_fraction=alarm_entropy_fraction, on_alarm=on_alarm, block=block,
            force=force)
        self.every, self.block = options["every"], options["block"]
        self.qk_clip, self.alpha, self.strict = (options["qk_clip"], options["alpha"],
                                                 options["strict"])
        self.alarm_logit = options["alarm_logit"]
        self.alarm_entropy_floor = options["alarm_entropy_floor"]
        self.alarm_entropy_fraction = options["alarm_entropy_fraction"]
        self.on_alarm, self.writer = on_alarm, writer
        self.resume = None if resume is None else check_int("resume", resume, minimum=0)
        self.force = force
        if log is not None and self.resume is not None and not force and _is_guard_log(log):
            force = True  # a stopped run's log is appended to, however it ended
        if _rank() != 0:
            force = True  # rank 0 writes the log (and may have created it); this one never
        self.log = None if log is None else check_output_path("log", log, suffixes=(".jsonl",),
                                                             force=force)
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl == "eager":
            raise ConfigError("attnscale.guard cannot see Hugging Face attn_implementation="
                              "'eager' (it forms the softmax by hand); load the model with "
                              "attn_implementation='sdpa' or 'attnscale' (Gemma 2: 'attnscale').")
        # Built now, so a layer the clip cannot handle is refused before any training.  Keyed by
        # the name the observer gives the layer's module (a compiled wrapper's _orig_mod left out).
        sites = clip_sites(model) if self.qk_clip is not None else []
        modules, names = dict(model.named_modules()), module_names(model)
        modules[type(model).__name__] = modules.get(type(model).__name__, model)  # the root's
        self._site_modules = {names[modules[s.name]]: modules[s.name] for s in sites}
        self.sites = {names[modules[s.name]]: s for s in sites}
        self.owner = "attnscale.guard"  # named in the error refusing a second clipping guard
        self.records: list[dict] = []
        self.latest: dict[str, float] = {}  # per-layer scalars of the last recorded step
        self.should_stop = False
        # The first step is always recorded; a resumed run's next step when `every` selects it.
        self._recording = self.resume is None or (self.resume + 1) % self.every == 0
        self._remeasuring = False
        self._s_max: dict[str, Tensor] = {}          # per module, since the last clip
        self._last_clip: dict[str, tuple[Tensor, Tensor]] = {}  # module -> (S_max, η per head)
        self._layers: dict[str, int] = {}            # module -> layer index (first seen)
        self._totals = Totals()                      # site -> this step's statistics
        self._keys: dict[str, int] = {}              # site -> this step's most keys in one call
        self._first: dict[tuple[str, int], dict] = {}  # (module, head) -> first recorded values
        self._active: set[tuple[str, str, int]] = set()  # (alarm, module, head) holding now
        self._restored = False                       # references back from a log or a state
        self._last_step: int | None = self.resume
        self._batches: list[tuple] = []  # this step's training forwards (strict mode)
        # Strict mode's walk (_remeasure, _walked): the layers done in this walk, whether a clip
        # left an earlier measurement of it out of date, whether a clipped layer runs again now,
        # and each layer's epsilon (the machine epsilon of its q and k).
        self._done: set[str] = set()
        self._stale = False
        self._rerun = False
        self._eps: dict[str, float] = {}
        self.strict_passes = 0  # walks the last strict clip took
        # per layer, each head's largest logit on the step's batches after the last strict clip
        self.strict_peaks: dict[str, Tensor] = {}
        # The monitor's watch, selecting the training forward passes (see _entered, _counts).
        self._watch = Watch(model, self._observe, selects=self._entered, counts=self._counts,
                            ended=self._ended)
        self._handles: list = []
        self._file = None
        self._writes = True  # rank 0 (or no torch.distributed) writes the log and the writer

    # -- attaching ---------------------------------------------------------------------------
    def __enter__(self) -> Guard:
        if self.active:
            raise RuntimeError("this guard is already active")
        self._claim_sites()
        try:
            self._writes = _rank() == 0
            self._watch.__enter__()
            if self.qk_clip is not None and self.optimizer is not None:
                self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
            if self.strict:
                # After the watch's own hooks; a no-op outside the strict walk.
                for name, module in self._site_modules.items():
                    self._handles.append(module.register_forward_hook(
                        eager(functools.partial(self._walked, name)), with_kwargs=True))
            if self.optimizer is not None and qk_clip_mechanism.clip_mechanisms(self.model):
                # A model built with the qk-clip mechanism clips itself after every step, from
                # its own S_max; the guard installs that clip (qk_clip.install) and records.
                self._handles.append(qk_clip_mechanism.install(self.optimizer, self.model))
            if self.log is not None:
                self._open_log()
        except BaseException:
            self._detach()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._detach()

    @property
    def active(self) -> bool:
        """Whether the guard is attached (inside its ``with`` block)."""
        return self._watch.active

    def _claim_sites(self) -> None:
        """Register this guard as the clip of its attention layers; a layer another active guard
        already clips is refused (two clips would multiply its logits twice)."""
        for name, module in self._site_modules.items():
            other = _CLIPPING.get(module)
            if other is not None and other is not self and other.active:
                where = f", log {str(other.log)!r}" if other.log is not None else ""
                raise ConfigError(
                    f"qk_clip: {name} is already clipped by an active {other.owner} "
                    f"(qk_clip={other.qk_clip:g}{where}); a second clipping guard would clip it "
                    f"twice. Keep one guard with qk_clip (others may watch without it).")
        for module in self._site_modules.values():
            _CLIPPING[module] = self

    def _open_log(self) -> None:
        """Open the log: a new one, or (resuming) the stopped run's, read back and appended to
        after a resume mark.  Every rank reads it back; rank 0 alone writes."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        scan = None
        if self.resume is not None and self.log.exists():
            try:
                scan = scan_log(self.log)
            except ConfigError:
                if not self.force:
                    raise
        if scan is not None:
            self._restore_from(scan)
        if not self._writes:
            return
        if scan is None:
            self._file = open(self.log, "w", encoding="utf-8")
            return
        repair_log(self.log, scan)
        superseded = sum(1 for r in scan.records if r["step"] > self.resume)
        self._file = open(self.log, "a", encoding="utf-8")
        self._file.write(json.dumps(resume_mark(self.resume, superseded)) + "\n")
        self._file.flush()

    def _detach(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles.clear()
        for module in self._site_modules.values():
            if _CLIPPING.get(module) is self:
                del _CLIPPING[module]
        self._watch.detach()
        if self._file is not None:
            self._file.close()
            self._file = None
            # The log was written line by line as training ran; registering it in the folder's
            # manifest (attnscale.io) lets a later run replace it without --force.
            atomic_write(self.log, self.log.read_bytes(), param="log", force=True)

    # -- resuming ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed run needs to continue this run's records, JSON-safe: save it with the
        checkpoint and hand it to :meth:`load_state_dict`.  The layer numbers, each head's first
        recorded ``logit_std`` and ``entropy_mean`` (the references of ``logit_std_ratio`` and
        of the entropy-collapse alarm), the alarms holding and the last step."""
        return json_safe({
            "version": STATE_VERSION, "step": self._last_step, "layers": dict(self._layers),
            "first": [[site, head, ref["logit_std"], ref["entropy_mean"]]
                      for (site, head), ref in self._first.items()],
            "active": sorted([list(a) for a in self._active])})

    def load_state_dict(self, state: dict) -> None:
        """Take the references of the run this one resumes (:meth:`state_dict`'s dict); they
        replace any read back from the log."""
        try:
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}")
            layers = {str(k): int(v) for k, v in state["layers"].items()}
            first = {(str(site), int(head)): {"logit_std": _float(std),
                                              "entropy_mean": _float(ent)}
                     for site, head, std, ent in state["first"]}
            active = {(str(a), str(site), int(head)) for a, site, head in state["active"]}
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"state is not a guard state_dict() ({err}).") from None
        self._layers, self._first, self._active = layers, first, active
        self._restored = True

    def _restore_from(self, scan: LogScan) -> None:
        """The references read back from a log: its records up to the resume step."""
        rows = [r for r in scan.records if r["step"] <= self.resume]
        if not rows:
            return
        for r in rows:
            self._layers.setdefault(r["module"], r["layer"])
            self._first.setdefault((r["module"], r["head"]), {"logit_std": r["logit_std"],
                                                              "entropy_mean": r["entropy_mean"]})
        last = max(r["step"] for r in rows)
        self._active = {(name, r["module"], r["head"]) for r in rows if r["step"] == last
                        for name in (r["alarm"].split(",") if r["alarm"] else [])}
        self._restored = True

    # -- what is observed --------------------------------------------------------------------
    def _tracking(self) -> bool:
        """Whether this call's S_max is wanted: K2 mode in training, or the strict re-measure."""
        if self.qk_clip is None:
            return False
        return self._remeasuring or not self.strict

    def _entered(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """A forward pass enters the model at ``module``: whether it is observed.  Only a
        training forward (module in training mode, grad enabled), and only where something is
        wanted of it (a recorded step, or the clip's S_max); strict mode keeps it."""
        if self._remeasuring:
            return True
        if not (module.training and torch.is_grad_enabled()):
            return False
        if self.strict:
            self._keep(module, args, kwargs)
        return self._recording or self._tracking()

    def _counts(self, module: nn.Module) -> bool:
        """Whether an attention call of ``module`` in an observed forward pass counts: the
        module in training mode, and not a recomputation during backward.  (Grad mode is read
        where the pass enters the model: a reentrant checkpoint's first forward runs without
        grad inside a training forward.)"""
        return self._remeasuring or (module.training and not recomputing())

    def _ended(self, module: nn.Module, calls: int | None) -> None:
        """A forward pass has left the model: one that entered at its root, was selected and
        reached no observed call is an error (the guard is useless on a model it cannot see)."""
        if module is self.model and calls == 0:
            raise ConfigError(f"attnscale.guard {self._watch.unobserved()}")

    def _observe(self, call: Call) -> None:
        """One attention call of a training forward: its S_max where the clip needs it, and on
        a recorded step its statistics and key count.  Uncapped logits scored for the
        statistics give S_max too (their logit_max), so they are scored once."""
        record = self._recording and not self._remeasuring
        track = self._tracking() and call.layer in self.sites
        if track and self._remeasuring:
            z = call.q if call.q is not None else call.logits
            eps = torch.finfo(z.dtype).eps if z.is_floating_point() else 0.0
            self._eps[call.layer] = max(self._eps.get(call.layer, 0.0), eps)
        if track and not (record and call.peaks_in_statistics):
            peaks = call.peak_logits()
            if peaks is not None:
                self._fold(call.layer, peaks)
        if not record:
            return
        self._keys[call.site] = max(self._keys.get(call.site, 0), call.most_keys())

        def take(stats: HeadStats) -> None:
            self._totals.add(call.site, stats)
            if track and call.peaks_in_statistics:
                self._fold(call.layer, stats.logit_max)

        call.statistics(take, block=self.block)

    def _fold(self, module: str, peaks: Tensor) -> None:
        peaks = peaks.detach().to(device="cpu", dtype=torch.float64)
        old = self._s_max.get(module)
        self._s_max[module] = peaks if old is None else torch.maximum(old, peaks)

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Strict mode: keep a training forward pass to run again after the step."""
        for value in _tensors(args, kwargs):
            if value.grad_fn is not None:
                name = self._watch.names.get(module, type(module).__name__)
                raise ConfigError(
                    f"qk_clip strict=True runs each training forward pass again after the step, "
                    f"but {name} was called on an activation of this step (a tensor with a "
                    f"grad_fn), which the step leaves stale; call the model once per batch on "
                    f"its data, or use strict=False.")
        self._batches.append((module, args, kwargs, _autocast_state()))

    # -- the clip ----------------------------------------------------------------------------
    def _after_step(self, *_) -> None:
        """After ``optimizer.step()``: the clip; in strict mode measured on the stepped weights."""
        self._last_clip.clear()
        if not self.strict:
            self._clip()
        else:
            self.strict_passes = 0
            # Layer l's inputs stop changing once the layers below it are settled: at most one
            # walk per layer, plus the one that finds nothing out of date.
            for _ in range(len(self.sites) + 1):
                self.strict_passes += 1
                if not self._remeasure():
                    break
        self._s_max.clear()
        self._batches.clear()

    @torch.no_grad()
    def _remeasure(self) -> bool:
        """One strict walk: run the step's training forward passes again in eval mode (every
        module's own mode put back after), each under the autocast it ran under, without a KV
        cache, clipping each attention layer as it finishes (:meth:`_walked`).  Whether a clip
        left an earlier measurement of this walk out of date (another walk is needed)."""
        self._s_max.clear()
        self._done.clear()
        self._stale = False
        self.strict_peaks = {}
        modes = [(m, m.training) for m in self.model.modules()]
        # Hugging Face models build a KV cache from config.use_cache even in a training forward;
        # a layer run twice would append its keys twice.  Off for the walk, put back after.
        configs = {id(m.config): m.config for m in self.model.modules()
                   if isinstance(getattr(getattr(m, "config", None), "use_cache", None), bool)}
        caching = [(c, c.use_cache) for c in configs.values()]
        self._remeasuring = True
        try:
            self.model.eval()
            for c, _ in caching:
                c.use_cache = False
            for module, args, kwargs, autocast in self._batches:
                if kwargs.get("use_cache") is True:
                    kwargs = {**kwargs, "use_cache": False}
                with contextlib.ExitStack() as stack:
                    for device, enabled, dtype in autocast:
                        # No cast cache: a layer clipped in place must be cast again for its
                        # second run, not served the copy of its weights from before the clip.
                        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                           cache_enabled=False))
                    module(*args, **kwargs)
        finally:
            self._remeasuring = False
            for c, use in caching:
                c.use_cache = use
            for m, mode in modes:
                m.training = mode
        return self._stale

    def _walked(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output):
        """Strict walk, forward hook of attention layer ``name``: it has just run on its actual
        inputs.  Its factors come from the peaks this call measured (all-reduced with MAX, so
        every rank clips alike); a clipped layer runs again on the same inputs with the clipped
        weights, whose output replaces the first run's, and whose peaks are the layer's after the
        clip.  A layer that already ran in this walk (its earlier output is now out of date), or
        whose call holds a KV cache (which a second run would extend), is clipped without the
        second run and marks the walk out of date."""
        if not self._remeasuring or self._rerun:
            return None
        site = self.sites[name]
        unseen = torch.full((site.n_heads,), -math.inf, dtype=torch.float64)
        s = _all_reduce(self._s_max.pop(name, unseen), "max")
        eta_q, eta_k = site.factors(s, self.qk_clip, strict_rtol(self._eps.get(name, 0.0)))
        if name in self._last_clip:  # the walk's later measurements: S on the stepped weights
            first_s, gamma = self._last_clip[name]
            self._last_clip[name] = (torch.maximum(first_s, s / gamma), gamma * eta_q)
        else:
            self._last_clip[name] = (s, eta_q)
        again = name in self._done
        self._done.add(name)
        if not bool((eta_q < 1).any()):
            self._peak_after(name, s)
            return None
        site.apply(eta_q, eta_k, self.alpha)
        if again or _holds_cache(kwargs):
            self._stale = True
            return None
        self._rerun = True
        try:
            output = module(*args, **kwargs)
        finally:
            self._rerun = False
        self._peak_after(name, _all_reduce(self._s_max.pop(name, unseen), "max"))
        return output

    def _peak_after(self, name: str, peaks: Tensor) -> None:
        old = self.strict_peaks.get(name)
        self.strict_peaks[name] = peaks if old is None else torch.maximum(old, peaks)

    def _clip(self) -> bool:
        """One all-reduced S_max vector for every layer, then each layer's factors; whether any
        head was over τ."""
        sites = list(self.sites.items())
        if not sites or (not self._s_max and _world() == 1):
            return False
        s = torch.cat([self._s_max.get(name, torch.full((site.n_heads,), -math.inf,
                                                        dtype=torch.float64))
                       for name, site in sites])
        s = _all_reduce(s, "max")
        offset = 0
        for name, site in sites:
            s_site = s[offset:offset + site.n_heads]
            offset += site.n_heads
            eta_q, eta_k = site.factors(s_site, self.qk_clip)
            site.apply(eta_q, eta_k, self.alpha)
            if name in self._last_clip:  # strict passes: the factors compose
                first_s, first_eta = self._last_clip[name]
                self._last_clip[name] = (first_s, first_eta * eta_q)
            else:
                self._last_clip[name] = (s_site, eta_q)
        self._s_max.clear()
        return bool((s > self.qk_clip).any())

    # -- the training loop's call ------------------------------------------------------------
    def step(self, step: int) -> list[dict]:
        """Call after each optimizer step with its label ``step``; returns this step's records
        (empty on a step not recorded).  Without an optimizer, the clip runs here."""
        step = check_int("step", step, minimum=0)
        if not self.active:
            raise RuntimeError("guard.step() outside the guard's with block")
        if self.qk_clip is not None and self.optimizer is None:
            self._after_step()
        rows = self._emit(step) if self._recording else []
        self._recording = (step + 1) % self.every == 0
        self._last_step = step
        if self.optimizer is None or self.qk_clip is None:
            self._batches.clear()
        return rows

    def record_next(self) -> None:
        """Record the next step whatever its label (a loop's last step, say)."""
        self._recording = True

    def _emit(self, step: int) -> list[dict]:
        totals, keys = self._totals.take(), self._keys
        self._keys = {}
        if _world() > 1:
            totals, keys = _all_reduce_stats(totals, keys, step)
        if totals and self.resume is not None and not self._restored and not self._first:
            warnings.warn(f"attnscale.guard resumed after step {self.resume} without its "
                          f"references (no records in the log, no load_state_dict()): "
                          f"logit_std_ratio and the entropy-collapse baseline start again at "
                          f"step {step}.", RuntimeWarning, stacklevel=3)
        rows, alarms = [], []
        for site, stats in totals.items():
            module = site.split("#")[0]
            layer = self._layers.setdefault(site, len(self._layers))
            means = stats.means()
            clip = self._last_clip.get(module)
            for head in range(len(means["queries"])):
                row = {"step": step, "layer": layer, "head": head, "module": site,
                       "queries": int(means["queries"][head]), "n_keys": keys[site],
                       **{key: means[key][head] for key in GUARD_STATS}}
                first = self._first.setdefault((site, head), {
                    "logit_std": row["logit_std"], "entropy_mean": row["entropy_mean"]})
                std0 = first["logit_std"]
                row["logit_std_ratio"] = row["logit_std"] / std0 if std0 > 0 else math.nan
                row["s_max"] = float(clip[0][head]) if clip is not None else None
                row["clip_gamma"] = float(clip[1][head]) if clip is not None else None
                fired = self._alarms(row, first)
                row["alarm"] = ",".join(fired)
                alarms += [self._alarm(name, row) for name in fired
                           if (name, site, head) not in self._active]
                self._active -= {(n, site, head) for n in ALARMS if n not in fired}
                self._active |= {(n, site, head) for n in fired}
                rows.append(row)
        self._last_clip.clear()
        self.records += rows
        self.latest = _latest(rows)
        if self._writes:
            self._write(step, rows)
        for alarm in alarms:
            self._act(alarm)
        return rows

    def _alarms(self, row: dict, first: dict) -> list[str]:
        fired = []
        if self.alarm_logit is not None and row["logit_max"] > self.alarm_logit:
            fired.append("max_logit")
        ent = row["entropy_mean"]
        if self.alarm_entropy_floor is not None and ent < self.alarm_entropy_floor:
            fired.append("entropy_floor")
        if (self.alarm_entropy_fraction is not None
                and ent < self.alarm_entropy_fraction * first["entropy_mean"]):
            fired.append("entropy_collapse")
        return fired

    def _alarm(self, name: str, row: dict) -> dict:
        if name == "max_logit":
            what = f"max logit {row['logit_max']:.4g} > alarm_logit {self.alarm_logit:g}"
        elif name == "entropy_floor":
            what = (f"mean entropy {row['entropy_mean']:.4g} nats < alarm_entropy_floor "
                    f"{self.alarm_entropy_floor:g}")
        else:
            first = self._first[(row["module"], row["head"])]["entropy_mean"]
            what = (f"mean entropy {row['entropy_mean']:.4g} nats < alarm_entropy_fraction "
                    f"{self.alarm_entropy_fraction:g} x its first {first:.4g}")
        message = (f"attnscale.guard: {name} in layer {row['layer']} ({row['module']}) head "
                   f"{row['head']} at step {row['step']}: {what}")
        return {"alarm": name, "step": row["step"], "layer": row["layer"], "head": row["head"],
                "module": row["module"], "value": row["logit_max" if name == "max_logit"
                                                     else "entropy_mean"],
                "message": message}

    def _act(self, alarm: dict) -> None:
        if self.on_alarm == "warn":
            warnings.warn(alarm["message"], RuntimeWarning, stacklevel=4)
        elif self.on_alarm == "raise":
            raise GuardAlarm(alarm["message"], alarm)
        elif self.on_alarm == "stop":
            self.should_stop = True
        else:
            self.on_alarm(alarm)

    def _write(self, step: int, rows: list[dict]) -> None:
        if self._file is not None:
            self._file.writelines(json.dumps(json_safe(r)) + "\n" for r in rows)
            self._file.flush()
        if self.writer is not None:
            for r in rows:
                for key in WRITER_KEYS:
                    self.writer.add_scalar(f"attnscale/{key}/layer{r['layer']}/head{r['head']}",
                                           r[key], step)
            for tag, value in self.latest.items():
                self.writer.add_scalar(tag, value, step)

    # -- results -----------------------------------------------------------------------------
    def to_frame(self):
        """The records as a pandas DataFrame, columns in :data:`GUARD_KEYS` order."""
        return to_frame(self.records)


def _latest(rows: list[dict]) -> dict[str, float]:
    """Per-layer scalars of one step's rows, keyed ``attnscale/<stat>/layer<L>``."""
    out = {}
    for r in layer_rows(rows):
        for key in LATEST_KEYS:
            out[f"attnscale/{key}/layer{r['layer']}"] = r[key]
    return out


def worst(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two steps' :attr:`Guard.latest` scalars as one: per key the worse value (the larger logit
    and spread, the lower entropy, the larger drift; NaN, a diverged head, wins)."""
    out = dict(a)
    for tag, value in b.items():
        if tag not in out or math.isnan(value):
            out[tag] = value
        elif not math.isnan(out[tag]):
            out[tag] = LATEST_KEYS[tag.split("/")[1]](out[tag], value)
    return out


def layer_rows(records: list[dict]) -> list[dict]:
    """One row per (step, layer): the spread over heads.  ``logit_max`` (largest over heads) and
    ``logit_max_spread`` (largest - smallest), ``entropy_mean_min`` (the lowest head's mean
    entropy) and ``entropy_mean_spread``, ``logit_std_ratio_max``, ``alarms`` (heads alarmed)."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["step"], r["layer"]), []).append(r)
    out = []
    for (step, layer), heads in sorted(groups.items()):
        def col(key: str) -> list[float]:
            return [h[key] for h in heads]
        out.append({"step": step, "layer": layer, "module": heads[0]["module"],
                    "heads": len(heads),
                    "logit_max": max(col("logit_max")),
                    "logit_max_spread": max(col("logit_max")) - min(col("logit_max")),
                    "entropy_mean_min": min(col("entropy_mean")),
                    "entropy_mean_spread": max(col("entropy_mean")) - min(col("entropy_mean")),
                    "logit_std_ratio_max": max(col("logit_std_ratio")),
                    "alarms": sum(1 for h in heads if h["alarm"])})
    return out


def to_frame(records: list[dict] | str | os.PathLike):
    """Records (a list, or the path of a JSONL log) as a pandas DataFrame in GUARD_KEYS order."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("to_frame() needs pandas (pip install pandas); the records are plain "
                          "dicts as well.") from None
    if not isinstance(records, list):
        records = read_log(records)
    return pd.DataFrame(records, columns=list(GUARD_KEYS))


def guard(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None, every: int = 10,
          log: str | os.PathLike | None = None, writer=None, qk_clip: float | None = None,
          alpha: float = K2_ALPHA, strict: bool = False,
          alarm_logit: float | None = DEFAULT_ALARM_LOGIT,
          alarm_entropy_floor: float | None = None,
          alarm_entropy_fraction: float | None = DEFAULT_ALARM_ENTROPY_FRACTION,
          on_alarm: str | Callable[[dict], None] = "warn", block: int = DEFAULT_BLOCK,
          resume: int | None = None, force: bool = False) -> Guard:
    """Watch (and with ``qk_clip`` hold) the attention temperature of ``model`` while it trains.

    Args:
        model: any ``nn.Module`` the monitor sees (attnscale's attention, HF on ``"sdpa"`` or
            ``"attnscale"``, anything calling SDPA).
        optimizer: the optimizer; with ``qk_clip`` the clip runs as its step post-hook.
        every: record one step in ``every`` (the first always), >= 1.
        log: JSONL file of the records (``.jsonl``; the io rules: a file attnscale did not
            write is refused unless ``force``).
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar``).
        qk_clip: τ of QK-Clip (K2: 100), or None for no clip; finite and > 0.
        alpha: the query side's share of the factor, in [0, 1] (K2: 0.5).
        strict: after each step, run the step's forward passes again and clip layer by layer
            on the stepped weights, to τ within :func:`strict_rtol` (see the module doc).
        alarm_logit, alarm_entropy_floor, alarm_entropy_fraction: alarm thresholds (None: off).
        on_alarm: ``"warn"``, ``"raise"``, ``"stop"`` or a callable given the alarm dict.
        block: queries per statistics block (the monitor's).
        resume: the step this run resumes from (the label of the last step its checkpoint
            holds), or None for a new run: the log is appended to and the references are read
            back from it (see the module doc and :meth:`Guard.load_state_dict`).
        force: overwrite a ``log`` attnscale did not write.
    Returns:
        a :class:`Guard`, to use as a context manager; call ``g.step(step)`` after each
        optimizer step.
    """
    return Guard(model, optimizer=optimizer, every=every, log=log, writer=writer,
                 qk_clip=qk_clip, alpha=alpha, strict=strict, alarm_logit=alarm_logit,
                 alarm_entropy_floor=alarm_entropy_floor,
                 alarm_entropy_fraction=alarm_entropy_fraction, on_alarm=on_alarm, block=block,
                 resume=resume, force=force)


class GuardCallback:
    """What every training-loop callback over :func:`guard` shares: the options (those of
    :func:`guard`, checked when the callback is built with the guard's own errors; the loop
    supplies the model, the optimizer and the step it resumes from, so passing any of them, or an
    option :func:`guard` lacks, is a TypeError), entering the guard when training starts and
    leaving it when training ends."""

    # How errors and the refusal of a second clipping guard name this callback.
    name = "attnscale.GuardCallback"

    def __init__(self, **options):
        for option in ("model", "optimizer", "resume"):
            if option in options:
                raise TypeError(f"{type(self).__name__} finds the {option} itself; do not pass "
                                f"{option}=.")
        known = [p for p in inspect.signature(guard).parameters
                 if p not in ("model", "optimizer", "resume")]
        for option in options:
            if option not in known:
                raise TypeError(f"{type(self).__name__} got an unexpected option {option!r}."
                                f"{did_you_mean(option, known)} Its options are those of "
                                f"attnscale.guard: {', '.join(known)}.")
        # Checked now, as the guard checks them, rather than when training starts.
        defaults = {p.name: p.default for p in inspect.signature(guard).parameters.values()
                    if p.name in known}
        _check_options(**{**defaults, **options})
        self.options = options
        self.guard: Guard | None = None

    def _enter(self, model: nn.Module, optimizer, resume: int | None = None,
               state: dict | None = None) -> None:
        """Enter a guard on ``model``; ``optimizer`` may be a trainer's wrapper (accelerate's,
        Lightning's), whose step calls the torch optimizer's, where the clip hook runs.  A run
        resumed from a checkpoint after step ``resume`` continues the log and the references
        (``state``: the guard's :meth:`Guard.state_dict` saved with that checkpoint)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        g = guard(model, optimizer=inner, resume=resume, **self.options)
        g.owner = self.name
        if state:
            g.load_state_dict(state)
        self.guard = g.__enter__()

    def _leave(self) -> None:
        """Leave the guard, if one is active (idempotent: training's end and an exception may
        both call it)."""
        if self.guard is not None and self.guard.active:
            self.guard.__exit__(None, None, None)

    def close(self) -> None:
        """Detach the guard from the model and the optimizer now (its hooks, the clip's step
        hook) and close its log.  Training's end does this; call it after a training run that
        raised, since a trainer does not tell its callbacks about an exception (the next
        training start also detaches a guard left on)."""
        self._leave()


# ---------------------------------------------------------------------------------------------
# Helpers


def _float(value) -> float:
    """A JSON number of a state dict (null: NaN)."""
    return math.nan if value is None else float(value)


def _is_guard_log(log) -> bool:
    """Whether ``log`` is an existing guard log (every complete line a record or a mark)."""
    try:
        return bool(str(os.fspath(log)).strip()) and os.path.isfile(log) and (
            owned(log) or scan_log(log) is not None)
    except (ConfigError, OSError):
        return False


def _tensors(args: tuple, kwargs: dict):
    """The tensors among a call's arguments, one level into lists, tuples and dicts."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, Tensor))


def strict_rtol(eps: float) -> float:
    """Strict mode's relative tolerance on "over τ" for a layer whose q and k reach its attention
    in a dtype of machine epsilon ``eps`` (:data:`STRICT_RTOL_FLOAT32` + :data:`STRICT_EPS` ·
    ``eps``; float32: 1.6e-5, a bfloat16 autocast: 3.1e-2).  A head counts as over τ when its
    largest logit exceeds τ · (1 + strict_rtol), and the strict bound holds to the same
    tolerance."""
    return STRICT_RTOL_FLOAT32 + STRICT_EPS * eps


# The keyword arguments under which Hugging Face attention layers receive their KV cache.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _holds_cache(kwargs: dict) -> bool:
    """Whether an attention layer's call was handed a KV cache (which running it twice would
    extend twice)."""
    return any(kwargs.get(key) is not None for key in _CACHE_KWARGS)


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """The autocast in effect now, per device type, to run a kept forward pass under it again."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


def _world() -> int:
    """The number of processes of ``torch.distributed`` (1 when it is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _world() > 1 else 0


def _all_reduce(values: Tensor, op: str) -> Tensor:
    """``values`` all-reduced over the ranks with ``op`` ("sum" or "max"); unchanged with one
    process.  NCCL reduces on the current CUDA device, gloo on the CPU."""
    import torch.distributed as dist

    if _world() == 1:
        return values
    device = (torch.device("cuda", torch.cuda.current_device())
              if "nccl" in str(dist.get_backend()) else values.device)
    out = values.to(device).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return out.to(values.device)


def _all_reduce_stats(totals: dict[str, HeadStats], keys: dict[str, int],
                      step: int) -> tuple[dict[str, HeadStats], dict[str, int]]:
    """A recorded step's statistics over every rank's rows: the sums summed, the minima and
    maxima reduced, the most keys maximised.  The ranks must have observed the same attention
    layers (the same model); a ConfigError on every rank otherwise."""
    sites = sorted(totals)
    heads = [len(totals[s].queries) for s in sites]
    sign = zlib.crc32("\n".join(f"{s}:{h}" for s, h in zip(sites, heads)).encode())
    check = _all_reduce(torch.tensor([sign, -sign], dtype=torch.float64), "max")
    if check[0] != -check[1]:
        raise ConfigError(f"attnscale.guard: the ranks observed different attention layers at "
                          f"step {step}; guard the same model on every rank.")
    if not sites:
        return totals, keys
    sums, peaks = [], []
    for s in sites:
        stats = totals[s]
        sums.append(stats.queries)
        for summary in MONITOR_SUMMARIES:
            t = stats.totals[summary.field]
            (sums if summary.reduce == "mean" else peaks).append(
                -t if summary.reduce == "min" else t)
    peaks.append(torch.tensor([float(keys[s]) for s in sites], dtype=torch.float64))
    sums = _all_reduce(torch.cat(sums), "sum")
    peaks = _all_reduce(torch.cat(peaks), "max")
    out, i, j = {}, 0, 0
    for s, h in zip(sites, heads):
        queries, i = sums[i:i + h], i + h
        reduced = {}
        for summary in MONITOR_SUMMARIES:
            if summary.reduce == "mean":
                reduced[summary.field], i = sums[i:i + h], i + h
            else:
                t, j = peaks[j:j + h], j + h
                reduced[summary.field] = -t if summary.reduce == "min" else t
        out[s] = HeadStats(queries, reduced)
    most = peaks[j:]
    return ({s: out[s] for s in totals},
            {**keys, **{s: int(most[n]) for n, s in enumerate(sites)}})
