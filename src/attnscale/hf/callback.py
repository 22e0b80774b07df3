"""``attnscale.hf.TemperatureCallback``: :func:`attnscale.guard` inside ``transformers.Trainer``.

::

    from attnscale.hf import TemperatureCallback
    trainer = Trainer(model, args, train_dataset=ds)
    TemperatureCallback(qk_clip=100, every=10).add_to(trainer)
    trainer.train()
    trainer.state.log_history     # ... {"loss": ..., "attnscale/logit_max/layer0": ..., "step": 10}

The callback finds the model and the optimizer in the callback arguments when training begins,
enters a guard with the given options (those of :func:`attnscale.guard`, checked when the callback
is built, with the guard's errors) and calls ``g.step`` with ``state.global_step`` after every
optimizer step (once per step under gradient accumulation).

**Logging.**  The Trainer's own log events are left exactly as they are (the callback never asks
for one: the Trainer's ``loss`` keeps its ``logging_steps`` windows).  The guard's per-layer
scalars (:attr:`attnscale.guard.Guard.latest`) join each log event as it comes, so they reach
``state.log_history`` and every reporter in ``report_to`` (TensorBoard, W&B, MLflow...), carrying
the worst value over the steps recorded since the previous log event (:func:`attnscale.guard.
core.worst`: the largest logit, the lowest entropy), so a step recorded between two log events
is not lost.  Every recorded step, per head, goes to ``callback.guard.records``, to the JSONL
``log`` and to the guard's ``writer`` at its own step.

**Why it goes first.**  The Trainer hands one ``logs`` dict to its callbacks in the order of its
callback list, and its reporters are callbacks too, placed before any passed to
``Trainer(callbacks=...)``; the scalars reach a reporter only if this callback adds them to
``logs`` before that reporter reads it.  :meth:`TemperatureCallback.add_to` adds the callback
through the Trainer's own callback handler (``add_callback``, ``remove_callback``) ahead of the
callbacks already there, and puts it back in front when training begins (a callback the Trainer
rebuilt from a checkpoint included).  Passed in ``callbacks=[...]`` instead, it works as long as
``report_to`` is empty (``state.log_history`` gets the scalars either way); with reporters it is
refused with a one-line error when training begins, rather than leaving them without the scalars.
``on_alarm="stop"`` ends training through ``control.should_training_stop``.

**Resuming** (``trainer.train(resume_from_checkpoint=...)``): the callback is an
``ExportableState``, so the guard's references (:meth:`attnscale.guard.Guard.state_dict`) are
saved in each checkpoint's ``trainer_state.json``; a resumed run continues the log after a resume
mark (the records a stopped run wrote past the checkpoint are superseded) with those references.
With ``restore_callback_states_from_checkpoint=True`` the Trainer rebuilds the callback from the
checkpoint and runs the rebuilt one instead of the object passed in (find its guard in
``trainer.callback_handler.callbacks``); an option a checkpoint cannot hold (``writer``, a
callable ``on_alarm``) is then refused with a one-line error, since the rebuilt callback would
silently run without it.

The Trainer tells its callbacks when training ends, but not when it raises: after a
``trainer.train()`` that raised, call ``callback.close()`` to detach the guard (the next
``train()`` also detaches it before attaching a new one).
"""

from __future__ import annotations

import os
import weakref

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from attnscale.errors import ConfigError
from attnscale.guard.core import GuardCallback, worst


class TemperatureCallback(GuardCallback, TrainerCallback, ExportableState):
    """A ``transformers.TrainerCallback`` running :func:`attnscale.guard` over the training loop;
    keyword options as :func:`attnscale.guard` (``every``, ``log``, ``writer``, ``qk_clip``,
    ``alpha``, ``strict``, the alarms, ``on_alarm``...)."""

    name = "attnscale.hf.TemperatureCallback"
    # Set by the Trainer on a callback it rebuilt from a checkpoint (ExportableState): the
    # references saved there, and the options the checkpoint could not hold.
    guard_state: dict | None = None
    options_not_saved: list[str] | None = None
    # The Trainers' callback handlers add_to() added a callback of this class to: where a callback
    # (or the one the Trainer rebuilt from it) finds the list it must run first in.
    _handlers: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, **options):
        super().__init__(**options)
        self._pending: dict[str, float] = {}

    # -- ExportableState: what the Trainer saves in trainer_state.json ------------------------
    def state(self) -> dict:
        saved, unsaved = {}, []
        for key, value in self.options.items():
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            if value is None or isinstance(value, (bool, int, float, str)):
                saved[key] = value
            else:
                unsaved.append(key)
        current = self.guard.state_dict() if self.guard is not None else self.guard_state
        return {"args": saved,
                "attributes": {"guard_state": current, "options_not_saved": unsaved}}

    def _saved_state(self, state) -> dict | None:
        """The guard's references in the checkpoint the Trainer resumed from: this callback's
        entry of ``state.stateful_callbacks`` (the one with its options, if several)."""
        if self.guard_state is not None:  # the Trainer rebuilt this callback from it
            return self.guard_state
        entries = (state.stateful_callbacks or {}).get(type(self).__name__)
        entries = entries if isinstance(entries, list) else [entries] if entries else []
        mine = self.state()["args"]
        matching = [e for e in entries if e.get("args") == mine] or entries[-1:]
        return matching[0].get("attributes", {}).get("guard_state") if matching else None

    # -- the Trainer's events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.options_not_saved:
            raise ConfigError(
                f"restore_callback_states_from_checkpoint=True rebuilt {self.name} from the "
                f"checkpoint without its {', '.join(self.options_not_saved)} option(s), which a "
                f"checkpoint cannot hold; leave it False (the callback restores its own state "
                f"from the checkpoint either way).")
        handler = next((h for h in self._handlers if self in h.callbacks), None)
        if handler is not None:
            self._run_first(handler)
        elif args.report_to:
            raise ConfigError(
                f"{self.name} must run before the Trainer's reporters (report_to="
                f"{list(args.report_to)}) to hand them its scalars, and Trainer(callbacks=[...]) "
                f"puts it after them; add it with TemperatureCallback(...).add_to(trainer) "
                f"instead.")
        self._leave()  # a run that raised earlier left its guard on
        self._pending = {}
        resume = state.global_step if state.global_step > 0 else None
        self._enter(model, optimizer, resume=resume,
                    state=self._saved_state(state) if resume is not None else None)

    def add_to(self, trainer) -> TemperatureCallback:
        """Add this callback to ``trainer`` (a ``transformers.Trainer``) ahead of the callbacks
        it has, its reporters among them (see the module doc); returns the callback."""
        handler = trainer.callback_handler
        if self not in handler.callbacks:
            handler.add_callback(self)
        type(self)._handlers.add(handler)
        self._run_first(handler)
        return self

    def _run_first(self, handler) -> None:
        """This callback first in ``handler``'s list, the others after it in their order, moved
        with the handler's own remove_callback and add_callback.  (Called in the middle of the
        handler's loop over its list at on_train_begin, it leaves that loop's next callback
        where it was.)"""
        if handler.callbacks[0] is self:
            return
        for other in [c for c in handler.callbacks if c is not self]:
            handler.remove_callback(other)
            handler.add_callback(other)

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is None or not self.guard.active:
            return control
        try:
            recorded = self.guard.step(state.global_step)
        except BaseException:  # on_alarm="raise": detach before the Trainer unwinds
            self.on_train_end(args, state, control)
            raise
        if recorded:
            self._pending = worst(self._pending, self.guard.latest)
        if self.guard.should_stop:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None:
            logs.update(self._pending)
            # The Trainer appended its copy of logs to log_history before calling back.
            if state.log_history and state.log_history[-1] is not logs:
                state.log_history[-1].update(self._pending)
            self._pending = {}
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._leave()
        return control
