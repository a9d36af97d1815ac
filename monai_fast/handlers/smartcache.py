"""Drive a :class:`~monai_fast.data.smartcache.SafeSmartCacheDataset`'s rotation from an ignite engine."""

from __future__ import annotations

import logging
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from monai_fast.data.smartcache import SafeSmartCacheDataset
from monai_fast.handlers.lifecycle import EngineHandler

__all__ = ["SmartCacheUpdater"]

logger = logging.getLogger("monai_fast.handlers")


class SmartCacheUpdater(EngineHandler):
    """MONAI's ``SmartCacheHandler`` for a :class:`SafeSmartCacheDataset`, with one attach discipline.

    Starts the dataset's replacement thread when the run starts, calls its
    ``update_cache(timeout_s)`` at each epoch's end, and shuts it down when the run ends (also when
    it raises). The safety (bounded waits, errors naming the item, resumable position) lives in
    the dataset; this handler touches none of its internals. On top, under ``ignite.distributed``
    one rank's failed update makes every rank raise, so none waits alone in a later collective.

    Only a :class:`SafeSmartCacheDataset` is accepted (``TypeError`` otherwise): a plain MONAI
    ``SmartCacheDataset`` cannot time out or report a failed replacement without rewriting its
    private state. Build the safe one with the same arguments, or use MONAI's ``SmartCacheHandler``.

    As every monai-fast handler (:mod:`monai_fast.handlers.lifecycle`), attaching a new instance
    to an engine that has one (a re-run notebook cell) replaces the old one, so the cache rotates
    once per epoch. ``state_dict`` / ``load_state_dict`` forward to the dataset: pass the updater
    to ignite's ``Checkpoint``, attached *after* the updater so an epoch-end save sees the rotated
    position.

    Args:
        dataset: the dataset to rotate.
        timeout_s: longest wait for one epoch's replacement, in seconds.

    Example:
        >>> from monai_fast.data.smartcache import SafeSmartCacheDataset
        >>> from monai_fast.handlers import SmartCacheUpdater
        >>> train_ds = SafeSmartCacheDataset(files, transform, cache_num=4, replace_rate=0.25)  # doctest: +SKIP
        >>> updater = SmartCacheUpdater(train_ds, timeout_s=120)  # doctest: +SKIP
        >>> updater.attach(trainer)  # doctest: +SKIP
        >>> to_save = {"trainer": trainer, "model": net, "smartcache": updater}  # doctest: +SKIP
    """

    def __init__(self, dataset: SafeSmartCacheDataset, timeout_s: float = 300.0) -> None:
        super().__init__()
        if not isinstance(dataset, SafeSmartCacheDataset):
            raise TypeError(
                f"SmartCacheUpdater needs a monai_fast.data.smartcache.SafeSmartCacheDataset (same arguments as "
                f"monai.data.SmartCacheDataset), got {type(dataset).__name__}; for a plain SmartCacheDataset use "
                "MONAI's SmartCacheHandler"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.dataset = dataset
        self.timeout_s = float(timeout_s)

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        self.on_run_end(engine, self._stop)

    def _detached(self, engine: Engine) -> None:
        self.dataset.shutdown()

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
        self.dataset.shutdown()

    def state_dict(self) -> dict[str, Any]:
        """The dataset's :meth:`SafeSmartCacheDataset.state_dict` (the rotation's position)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The dataset's :meth:`SafeSmartCacheDataset.load_state_dict`: rebuild the cache at the saved position."""
        self.dataset.load_state_dict(state)
