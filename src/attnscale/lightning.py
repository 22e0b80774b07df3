"""``attnscale.lightning.TemperatureCallback``: :func:`attnscale.guard` inside a Lightning run.

Install with ``pip install 'attnscale[lightning]'``.

::

    from attnscale.lightning import TemperatureCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[TemperatureCallback(qk_clip=100)])
    trainer.fit(module, loader)

When training starts the callback enters a guard on the LightningModule with the trainer's first
optimizer (options as :func:`attnscale.guard`, checked when the callback is built) and calls
``g.step`` with ``trainer.global_step`` after every optimizer step (once per step under
``accumulate_grad_batches``).  The guard sees the forward passes of ``training_step`` wherever it
calls the model (``self(x)``, ``self.model(x)``, or submodules one by one); validation, sanity
checks and prediction run in eval mode without grad and are never recorded.

**Logging.**  On a recorded step the guard's per-layer scalars (:attr:`attnscale.guard.Guard.
latest`) go to every logger of the trainer (``logger.log_metrics``) at the step Lightning logs
that batch's own metrics at, whether or not it logs them there (``log_every_n_steps``), and to
``trainer.callback_metrics``
(``pl_module.log_dict(..., logger=False)``, so ``EarlyStopping`` or ``ModelCheckpoint`` may
monitor them).  Lightning's own logging is left as it is.  The per-head records stay in
``callback.guard.records`` and the JSONL ``log``.  ``on_alarm="stop"`` sets
``trainer.should_stop``.

**Resuming** (``trainer.fit(module, ckpt_path=...)``): the callback's ``state_dict`` (the guard's
:meth:`attnscale.guard.Guard.state_dict`) is saved in every checkpoint, and a resumed run continues
the log after a resume mark (records a stopped run wrote past the checkpoint are superseded) with
the references of the checkpoint.

**Strict mode** (``strict=True``) runs each training forward pass of the step again after the
step: ``training_step`` must call the model on its batch (``self(x)`` or ``self.model(x)``), not
feed one submodule's output to another, which is refused with a one-line error.
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("attnscale.lightning needs Lightning: pip install 'attnscale[lightning]'"
                      ) from err

from attnscale.guard.core import GuardCallback


class TemperatureCallback(GuardCallback, Callback):
    """A Lightning ``Callback`` running :func:`attnscale.guard` over ``trainer.fit``."""

    name = "attnscale.lightning.TemperatureCallback"

    def __init__(self, **options):
        super().__init__(**options)
        self._last_step: int | None = None
        self._loaded: dict | None = None  # the guard's state from the checkpoint resumed

    def state_dict(self) -> dict:
        return self.guard.state_dict() if self.guard is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        self._loaded = dict(state_dict) or None

    def on_train_start(self, trainer, pl_module) -> None:
        self._leave()  # a run that raised earlier left its guard on
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if optimizers else None
        resume = trainer.global_step if trainer.global_step > 0 else None
        self._enter(pl_module, optimizer, resume=resume,
                    state=self._loaded if resume is not None else None)
        self._loaded = None
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.guard is None or trainer.global_step == self._last_step:
            return  # no optimizer step since the last call (gradient accumulation)
        self._last_step = step = trainer.global_step
        if self.guard.step(step) and self.guard.latest:
            # At the step Lightning logs this batch's own metrics at (as its DeviceStatsMonitor
            # and LearningRateMonitor do): the batches stepped before this one.
            at = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", step - 1)
            for logger in trainer.loggers:
                logger.log_metrics(self.guard.latest, step=at)
            pl_module.log_dict(self.guard.latest, on_step=True, on_epoch=False, logger=False)
        if self.guard.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._leave()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)
