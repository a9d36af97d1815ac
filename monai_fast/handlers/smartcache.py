"""Drive a SmartCache rotation from an ignite engine: bounded waits, named errors, rank agreement, resumable."""

from __future__ import annotations

import logging
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import SmartCacheDataset
from monai.handlers import SmartCacheHandler

from monai_fast.data.adopt import adopt_loader, unknown_item_path, why_not_adoptable
from monai_fast.data.smartcache import SafeSmartCacheDataset
from monai_fast.handlers.lifecycle import EngineHandler, callbacks_on, handlers_on, is_running

__all__ = ["SmartCacheUpdater", "rotated_on"]

logger = logging.getLogger("monai_fast.handlers")


class SmartCacheUpdater(EngineHandler):
    """MONAI's ``SmartCacheHandler`` that never hangs, names failures, agrees across ranks and resumes.

    A failed replacement raises `DataItemError` naming the item on every rank; MONAI's own data set
    is adopted into a `SafeSmartCacheDataset`; ``state_dict()`` resumes the rotation. See docs/data.md.

    Args:
        dataset: the data set to rotate; ``None`` (the usual): the one in the engine's ``data_loader``.
        timeout_s: longest wait for one epoch's replacement, in seconds.

    Raises:
        TypeError: ``dataset`` is not a ``SmartCacheDataset``, or (at attach) the loader holds none.
        ValueError: ``timeout_s`` <= 0, or (at attach) MONAI's data set cannot be adopted.
        RuntimeError: at attach, the engine is inside ``run()``.

    Examples:
        >>> SmartCacheUpdater(timeout_s=120).attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, dataset: SmartCacheDataset | None = None, timeout_s: float = 300.0) -> None:
        super().__init__()
        if dataset is not None and not isinstance(dataset, SmartCacheDataset):
            raise TypeError(
                f"SmartCacheUpdater needs a monai.data.SmartCacheDataset (or monai_fast's SafeSmartCacheDataset), "
                f"got {type(dataset).__name__}; or pass none and attach to a trainer whose data_loader holds one"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._given = dataset
        self.dataset: SafeSmartCacheDataset | None = dataset if isinstance(dataset, SafeSmartCacheDataset) else None
        self.timeout_s = float(timeout_s)
        self.mode: str | None = None  # "safe" or "adopted" once attached
        self._pending: dict[str, Any] | None = None  # a state loaded before attach

    @property
    def updates(self) -> int:
        """Rotations done so far (one per epoch), as in `state_dict()`; 0 before attach."""
        return 0 if self.dataset is None else self.dataset.updates

    def _attach(self, engine: Engine) -> None:
        if is_running(engine):  # its STARTED has passed and the run keeps the loader it started with
            raise RuntimeError(
                f"SmartCacheUpdater: attach it before run(): the engine is running (at {engine.last_event_name})"
            )
        loader = getattr(engine, "data_loader", None)
        held = getattr(loader, "dataset", None)
        ds = self._given if self._given is not None else held
        if not isinstance(ds, SmartCacheDataset):
            holds = type(held).__name__ if loader is not None else "no data"
            raise TypeError(
                f"SmartCacheUpdater: the engine's data_loader holds {holds}, not a SmartCacheDataset; pass the data "
                "set: SmartCacheUpdater(dataset)"
            )
        self.mode, self.dataset = self._choose(engine, loader, ds)
        _take_over_from_monais_handler(engine, self.dataset)
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        self.on_run_end(engine, self._stop)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.load_state_dict(state)

    def _choose(self, engine: Engine, loader: Any, ds: SmartCacheDataset) -> tuple[str, SafeSmartCacheDataset]:
        """The safe data set to rotate: ``ds``, or MONAI's adopted (its own rotation can hang)."""
        if isinstance(ds, SafeSmartCacheDataset):
            logger.info("SmartCacheUpdater: rotates the SafeSmartCacheDataset (timeout_s=%g)", self.timeout_s)
            return "safe", ds
        if loader is None or getattr(loader, "dataset", None) is not ds:
            why = (
                "the engine has no data_loader to rebuild (a plain ignite Engine gets its data at run())"
                if loader is None
                else "the engine's data_loader does not hold this data set"
            )
        else:
            why = why_not_adoptable(loader) or unknown_item_path(ds, rotation=True)
        if why is not None:
            raise ValueError(
                f"SmartCacheUpdater: MONAI's {type(ds).__name__} cannot be adopted ({why}); rotate a "
                "monai_fast.data.smartcache.SafeSmartCacheDataset instead (SafeSmartCacheDataset.adopt(ds) "
                "builds one from it) and load from it"
            )
        adopted = adopt_loader(loader)
        engine.data_loader = adopted.loader
        logger.info("SmartCacheUpdater: %s; the engine's data_loader rebuilt: %s", *adopted.notes[:2])
        return "adopted", adopted.dataset

    def _detached(self, engine: Engine) -> None:
        self._stop(engine)

    def _started(self, engine: Engine) -> None:
        self.dataset.start()

    def _epoch_completed(self, engine: Engine) -> None:
        failure: Exception | None = None
        try:
            self.dataset.update_cache(timeout_s=self.timeout_s)
        except Exception as e:  # raised below, after the ranks agree
            failure = e
        if idist.get_world_size() > 1:  # one rank's failure is every rank's failure
            flag = idist.all_reduce(torch.tensor([1.0 if failure is not None else 0.0]))
            if float(flag.item()) > 0 and failure is None:
                failure = RuntimeError("SmartCache replacement failed on another rank; stopping this one too")
        if failure is not None:
            logger.error("SmartCache update failed on rank %d: %s", idist.get_rank(), failure)
            raise failure

    def _stop(self, engine: Engine) -> None:
        if self.dataset is not None:
            self.dataset.shutdown()

    def state_dict(self) -> dict[str, Any]:
        """The rotation's position, ``{"start_pos", "updates", "total"}``: enough to rebuild the same window."""
        if self.dataset is None:
            raise RuntimeError("SmartCacheUpdater.state_dict: attach the updater first (it finds its data set then)")
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move the rotation to a saved position and rebuild the cache there (at attach, before it)."""
        if self.mode is None:
            self._pending = dict(state)
        else:
            self.dataset.load_state_dict(state)


def _monais_handlers(engine: Engine, dataset: SmartCacheDataset) -> list[SmartCacheHandler]:
    """MONAI's ``SmartCacheHandler``s on ``engine`` that rotate ``dataset`` (or the data set it was adopted from)."""
    sources = [dataset]
    if isinstance(dataset, SafeSmartCacheDataset) and dataset.adopted_from is not None:
        sources.append(dataset.adopted_from)
    owners = (getattr(fn, "__self__", None) for fn in callbacks_on(engine, Events.EPOCH_COMPLETED))
    found = [h for h in owners if isinstance(h, SmartCacheHandler) and any(h.smartcacher is s for s in sources)]
    return list(dict.fromkeys(found))


def rotated_on(engine: Engine, dataset: SmartCacheDataset) -> bool:
    """Whether ``engine`` rotates ``dataset``'s window: MONAI's ``SmartCacheHandler`` for it or a `SmartCacheUpdater`
    is attached, or an earlier adoption of it (`SafeSmartCacheDataset.adoption_of`) took that rotation over."""
    if SmartCacheUpdater in handlers_on(engine) or _monais_handlers(engine, dataset):
        return True
    return SafeSmartCacheDataset.adoption_of(dataset) is not None


def _take_over_from_monais_handler(engine: Engine, dataset: SmartCacheDataset) -> None:
    """Remove MONAI's ``SmartCacheHandler`` for ``dataset`` (or its source): it would rotate a second time."""
    for handler in _monais_handlers(engine, dataset):
        for event, fn in (
            (Events.STARTED, handler.started),
            (Events.EPOCH_COMPLETED, handler.epoch_completed),
            (Events.COMPLETED, handler.completed),
        ):
            if engine.has_event_handler(fn, event):
                engine.remove_event_handler(fn, event)
        logger.info(
            "SmartCacheUpdater: MONAI's SmartCacheHandler for this data set is removed from the engine; "
            "the updater rotates it (once per epoch)"
        )
