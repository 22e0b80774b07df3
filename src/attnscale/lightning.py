"""``attnscale.lightning.TemperatureCallback``: :func:`attnscale.guard` inside a Lightning run.

Install with ``pip install 'attnscale[lightning]'``.

::

    from attnscale.lightning import TemperatureCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[TemperatureCallback(qk_clip=100)])
    trainer.fit(module, loader)

When training starts the callback enters a guard on the LightningModule with the trainer's first
optimizer (options as :func:`attnscale.guard`) and calls ``g.step`` with ``trainer.global_step``
after every optimizer step (once per step under gradient accumulation).  On a recorded step the
guard's per-layer scalars (:attr:`attnscale.guard.Guard.latest`) go to the module's loggers through
``pl_module.log_dict``; the per-head records stay in ``callback.guard.records`` and the JSONL
``log``.  ``on_alarm="stop"`` sets ``trainer.should_stop``.
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

    def __init__(self, **options):
        super().__init__(**options)
        self._last_step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if optimizers else None
        self._enter(pl_module, optimizer)
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.guard is None or trainer.global_step == self._last_step:
            return  # no optimizer step since the last call (gradient accumulation)
        self._last_step = trainer.global_step
        if self.guard.step(trainer.global_step) and self.guard.latest:
            pl_module.log_dict(self.guard.latest, on_step=True, on_epoch=False)
        if self.guard.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._leave()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)
