"""``attnscale.hf.TemperatureCallback``: :func:`attnscale.guard` inside ``transformers.Trainer``.

::

    from attnscale.hf import TemperatureCallback
    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[TemperatureCallback(qk_clip=100, every=10)])
    trainer.train()
    trainer.state.log_history     # ... {"attnscale/logit_max/layer0": ..., "step": 10} ...

The callback finds the model and the optimizer in the callback arguments when training begins,
enters a guard with the given options (those of :func:`attnscale.guard`) and calls ``g.step`` with
``state.global_step`` after every optimizer step.  On a recorded step it asks the Trainer to log
(``control.should_log``) and adds the guard's per-layer scalars (:attr:`attnscale.guard.Guard.
latest`) to that log, so they reach ``state.log_history`` and every reporter the user configured
(``report_to``: TensorBoard, W&B, MLflow...).  For that it runs first among the Trainer's
callbacks: the Trainer hands one ``logs`` dict to its callbacks in order, reporters first, so the
callback moves itself to the front of the Trainer's list when training begins.  The per-head records
stay in ``callback.guard.records`` and the JSONL ``log``.  ``on_alarm="stop"`` ends training
through ``control.should_training_stop``.

The Trainer tells its callbacks when training ends, but not when it raises: after a
``trainer.train()`` that raised, call ``callback.close()`` to detach the guard (the next
``train()`` also detaches it before attaching a new one).
"""

from __future__ import annotations

import gc

from transformers import TrainerCallback

from attnscale.guard.core import GuardCallback


class TemperatureCallback(GuardCallback, TrainerCallback):
    """A ``transformers.TrainerCallback`` running :func:`attnscale.guard` over the training loop;
    keyword options as :func:`attnscale.guard` (``every``, ``log``, ``writer``, ``qk_clip``,
    ``alpha``, ``strict``, the alarms, ``on_alarm``...)."""

    def __init__(self, **options):
        super().__init__(**options)
        self._pending: dict[str, float] = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._leave()  # a run that raised earlier left its guard on
        self._enter(model, optimizer)
        self._run_first()

    def _run_first(self) -> None:
        """Move this callback to the front of the Trainer's callback list (see the module doc).
        The list is found as the one holding this callback and the Trainer's flow callback."""
        for holder in gc.get_referrers(self):
            if isinstance(holder, list) and any(type(c).__name__ == "DefaultFlowCallback"
                                                for c in holder):
                holder.remove(self)
                holder.insert(0, self)
                return

    def on_step_end(self, args, state, control, **kwargs):
        if self.guard is None:
            return control
        try:
            recorded = self.guard.step(state.global_step)
        except BaseException:  # on_alarm="raise": detach before the Trainer unwinds
            self.on_train_end(args, state, control)
            raise
        if recorded:
            self._pending.update(self.guard.latest)
            control.should_log = True
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
