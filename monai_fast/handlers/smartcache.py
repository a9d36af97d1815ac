"""SmartCache replacement per epoch that fails loudly, agrees across ranks and resumes in place."""

from __future__ import annotations

import logging
import time
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import SmartCacheDataset

from monai_fast.data.loaders import describe_item, error_text
from monai_fast.handlers.lifecycle import on_run_end

__all__ = ["SmartCacheUpdater"]

logger = logging.getLogger("monai_fast.handlers")


class SmartCacheUpdater:
    """Drives a ``SmartCacheDataset``'s replacement like MONAI's ``SmartCacheHandler``, made safe.

    Each epoch's end swaps ``replace_rate`` of the cache for items prepared in the background.
    With MONAI's handler, a transform that raises while preparing replacements kills the
    background thread, and ``update_cache()`` then waits forever. A resumed run also starts the
    rotation over, because ``shutdown()`` resets it. This handler:

    * captures errors of the replacement workers and raises them in the training thread, naming
      the item's files; a replacement thread that stops without an error is an error too;
    * waits at most ``timeout_s`` for a replacement, then raises instead of spinning;
    * under ``ignite.distributed`` agrees on failure: if one rank fails, every rank raises, so
      none blocks in a later collective (each rank drives its own partition's cache);
    * has ``state_dict`` / ``load_state_dict`` (pass it to ignite's ``Checkpoint``): a resumed run
      continues the same rotation, and the cache is rebuilt for the saved position.

    With 5 items, ``cache_num=4`` and ``replace_rate=0.25`` (the fast-training guide's example)
    the epochs see items 1-4, 2-5, 3-5+1, 4-5+1-2, ...

    Args:
        dataset: the ``SmartCacheDataset`` to rotate.
        timeout_s: longest wait for one epoch's replacement, in seconds.

    Example:
        >>> from monai_fast.handlers import SmartCacheUpdater
        >>> updater = SmartCacheUpdater(train_ds, timeout_s=120)
        >>> updater.attach(trainer)  # doctest: +SKIP
        >>> to_save = {"trainer": trainer, "model": net, "smartcache": updater}  # for ignite's Checkpoint
    """

    def __init__(self, dataset: SmartCacheDataset, timeout_s: float = 300.0) -> None:
        if not isinstance(dataset, SmartCacheDataset):
            raise TypeError(f"dataset must be a monai.data.SmartCacheDataset, got {type(dataset).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.dataset = dataset
        self.timeout_s = float(timeout_s)
        self.updates = 0
        self._failed = False
        self._error: BaseException | None = None
        self._engine: Engine | None = None
        self._wrap_replacement_worker()

    def _wrap_replacement_worker(self) -> None:
        # MONAI computes replacements in a ThreadPool inside a daemon thread; an exception there kills
        # that thread and never reaches training. Capture it instead, with the item that failed, so the
        # training thread raises it at the next swap (which _try_swap refuses while an error is held).
        ds, original = self.dataset, self.dataset._replace_cache_thread

        def guarded(index: int) -> None:
            try:
                original(index)
            except Exception as e:  # noqa: BLE001 - kept and raised in the training thread
                pos = ds._replace_data_idx[index]
                error = RuntimeError(
                    f"SmartCache replacement of {describe_item(ds, pos)} failed on rank {idist.get_rank()}: {error_text(e)}"
                )
                error.__cause__ = e
                if self._error is None:  # the first failure is the one to report
                    self._error = error

        ds._replace_cache_thread = guarded

    def attach(self, engine: Engine) -> None:
        """Start replacing when ``engine`` starts, swap at each epoch's end, stop when the run ends.

        Raises:
            RuntimeError: if already attached.
        """
        if self._engine is not None:
            raise RuntimeError("SmartCacheUpdater is already attached; make one per engine")
        self._engine = engine
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        on_run_end(engine, self._stop)

    def _started(self, engine: Engine) -> None:
        self._error = None
        self._failed = False
        self.dataset.start()

    def _epoch_completed(self, engine: Engine) -> None:
        failure = self._update()
        if idist.get_world_size() > 1:  # one rank's failure is every rank's failure
            flag = idist.all_reduce(torch.tensor([1.0 if failure else 0.0]))
            if float(flag.item()) > 0 and failure is None:
                failure = RuntimeError("SmartCache replacement failed on another rank; stopping this one too")
        if failure is not None:
            self._failed = True
            raise failure

    def _update(self) -> BaseException | None:
        ds = self.dataset
        ds.start()  # restarts the background thread if it is not running
        deadline = time.monotonic() + self.timeout_s
        while not self._try_swap(0.05):
            if self._error is not None:
                return self._error
            if not ds.is_started():
                return self._error or RuntimeError("SmartCache's replacement thread stopped without finishing a replacement")
            if time.monotonic() > deadline:
                return TimeoutError(
                    f"SmartCache replacement took longer than {self.timeout_s:.0f} s on rank {idist.get_rank()} "
                    f"({ds._replace_num} items); raise timeout_s or replace_rate, or use more replace workers"
                )
            time.sleep(0.01)
        self.updates += 1
        return None

    def _try_swap(self, wait_s: float) -> bool:
        # MONAI's _try_update_cache() blocks on a lock that its thread holds while it computes the
        # replacements, which no timeout could interrupt; take the lock with a timeout instead and
        # do the same swap under it
        ds = self.dataset
        if not ds._update_lock.acquire(timeout=wait_s):
            return False
        try:
            if not ds._replace_done or self._error is not None:  # never swap in a failed replacement
                return False
            del ds._cache[: ds._replace_num]
            ds._cache.extend(ds._replacements)
            ds._start_pos = (ds._start_pos + ds._replace_num) % ds._total_num
            ds._compute_data_idx()
            ds._round += 1
            ds._replace_done = False
            return True
        finally:
            ds._update_lock.release()

    def _stop(self, engine: Engine) -> None:
        ds = self.dataset
        if not ds.is_started():
            return
        if self._failed or self._error is not None:
            # MONAI's shutdown() would wait for a replacement that may never finish: ask the
            # thread to stop at its next check instead, and do not wait for it (it is a daemon)
            if ds._update_lock.acquire(timeout=0.1):
                ds._round = 0
                ds._update_lock.release()
            return
        pos = ds._start_pos
        ds.shutdown()  # resets the rotation to 0; keep it where the run left it, matching the cache
        ds._start_pos = pos
        ds._compute_data_idx()

    def window(self) -> list[int]:
        """Indices (into the dataset's data list) of the items cached now, in cache order."""
        ds = self.dataset
        return [(ds._start_pos + i) % ds._total_num for i in range(ds.cache_num)]

    def state_dict(self) -> dict[str, Any]:
        """The rotation's position: enough to rebuild the same cache window on resume."""
        return {"start_pos": int(self.dataset._start_pos), "updates": self.updates, "total": self.dataset._total_num}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move the rotation to a saved position and rebuild the cache there (before the run starts).

        Raises:
            ValueError: if the state does not fit this dataset (another data list).
        """
        ds = self.dataset
        if state.get("total") != ds._total_num:
            raise ValueError(f"SmartCache state is for {state.get('total')} items, this dataset has {ds._total_num}")
        if ds.is_started():
            ds.shutdown()
        ds._start_pos = int(state["start_pos"]) % ds._total_num
        ds._compute_data_idx()
        ds._cache = [ds._load_cache_item(i) for i in self.window()]
        self.updates = int(state.get("updates", 0))
