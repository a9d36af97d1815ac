"""An epoch that ends short is an error, not a smaller epoch: `EpochLengthGuard` (docs/handlers.md)."""

from __future__ import annotations

from ignite.engine import Engine, Events

from monai_fast.handlers.lifecycle import EngineHandler

__all__ = ["EpochLengthGuard", "ShortEpochError"]


class ShortEpochError(RuntimeError):
    """A data pass or an epoch ended before its length; the message names the engine and the counts."""


class EpochLengthGuard(EngineHandler):
    """Raises `ShortEpochError` when a loader's pass or an epoch ends short, before any ``EPOCH_COMPLETED`` handler.

    Args:
        name: what the engine does, for the message (``"training"``, ``"validation"``).

    Examples:
        >>> EpochLengthGuard("training").attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, name: str = "engine") -> None:
        super().__init__()
        self.name = name
        self._taken = 0  # batches from the loader's current pass
        self._first_epoch = True  # the first epoch of a run may resume in its middle
        self._offset = 0  # iterations of this epoch done before the run started (a resume)
        self._start = 0  # engine.state.iteration when this epoch started
        self._ended_on_purpose = False

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started)
        self.on(engine, Events.GET_BATCH_COMPLETED, self._batch)
        self.on(engine, Events.DATALOADER_STOP_ITERATION, self._pass_ended, first=True)
        self.on(engine, Events.TERMINATE_SINGLE_EPOCH, self._epoch_terminated)
        self.on(engine, Events.TERMINATE, self._on_purpose)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed, first=True)

    def _started(self, engine: Engine) -> None:
        self._taken, self._first_epoch = 0, True  # ignite starts a fresh iterator for every run

    def _epoch_started(self, engine: Engine) -> None:
        length = engine.state.epoch_length
        self._offset = engine.state.iteration % length if self._first_epoch and length else 0
        self._first_epoch = False
        self._start = engine.state.iteration
        self._ended_on_purpose = False

    def _batch(self, engine: Engine) -> None:
        self._taken += 1

    def _on_purpose(self, engine: Engine) -> None:
        self._ended_on_purpose = True

    def _epoch_terminated(self, engine: Engine, iter_counter: int = 0) -> None:  # ignite passes iter_counter
        self._ended_on_purpose = True
        self._taken = 0  # ignite starts a new pass after a terminated epoch

    def _pass_ended(self, engine: Engine) -> None:
        loader = engine.state.dataloader
        try:
            # MONAI's ThreadDataLoader(repeats=n) yields each of its len() batches n times
            expected = len(loader) * int(getattr(loader, "repeats", 1))  # type: ignore[arg-type]
        except TypeError:  # no len(): nothing to compare with
            expected = None
        taken, self._taken = self._taken, 0
        if expected is not None and taken != expected:
            raise ShortEpochError(
                f"the {self.name} data loader ended a pass after {taken} of its {expected} batches (epoch "
                f"{engine.state.epoch}, iteration {engine.state.iteration}): the pass lost items, so the epoch is not "
                "used. A loader whose thread stops on an error ends its pass this way (MONAI's ThreadDataLoader); "
                "monai_fast.data.loaders.SafeThreadDataLoader raises the failing item's error instead"
            )

    def _epoch_completed(self, engine: Engine) -> None:
        length = engine.state.epoch_length
        if self._ended_on_purpose or not length:
            return
        done, expected = engine.state.iteration - self._start, length - self._offset
        if done != expected:
            raise ShortEpochError(
                f"{self.name} epoch {engine.state.epoch} ended after {done} of its {expected} iterations: the data "
                "loader gave no more batches, so the epoch's results are not used"
            )
