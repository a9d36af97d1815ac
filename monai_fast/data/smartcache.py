"""A ``SmartCacheDataset`` that owns a safe rotation: bounded waits, named errors, resumable state (docs/data.md)."""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import ThreadPool
from typing import Any

import numpy as np
from monai.data import SmartCacheDataset

from monai_fast.data.crop_cache import CropCacheDataset
from monai_fast.data.items import DataItemError, describe_item, error_text, item_bytes
from monai_fast.openmp import serial_openmp_here
from monai_fast.telemetry.cuda import cuda_available
from monai_fast.threads import forget_at_exit, stop_at_exit

__all__ = ["SafeSmartCacheDataset", "replace_count", "window_bytes"]

logger = logging.getLogger("monai_fast.data")

#: each adopted user's data set and the safe data set rotating in its place (see `SafeSmartCacheDataset.adopt()`)
_ADOPTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replace_count(dataset: SmartCacheDataset) -> int:
    """Items a ``SmartCacheDataset`` replaces at each update (the one read of MONAI's private ``_replace_num``)."""
    if isinstance(dataset, SafeSmartCacheDataset):
        return dataset.replace_num
    return int(dataset._replace_num)


def window_bytes(dataset: SmartCacheDataset) -> int:
    """Bytes of the arrays and tensors a ``SmartCacheDataset``'s window (MONAI's private ``_cache``) holds in RAM."""
    return sum(item_bytes(x.item if isinstance(x, _InMemory) else x) for x in (dataset._cache or []) if x is not None)


@dataclass
class _Rotation:
    """The rotation's state, guarded by ``cond``; one attribute on the dataset, no MONAI names."""

    rate: float
    timeout_s: float
    replace_num: int = 0
    position: int = 0  # index into ``data`` of the first cached item
    updates: int = 0  # swaps done since construction (or as restored from a checkpoint)
    ready: list | None = None  # replacements prepared for ``position``
    error: tuple[int, BaseException] | None = None  # (item index, exception) of a failed replacement
    failed: bool = False  # the last update raised: shutdown() does not wait for the thread
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)


class SafeSmartCacheDataset(SmartCacheDataset):
    """MONAI's ``SmartCacheDataset`` whose rotation never hangs, names failures and resumes in place.

    ``update_cache`` waits at most ``timeout_s``, a failed replacement raises `DataItemError` naming
    the item, and ``state_dict()`` saves the position. Drive it with `SmartCacheUpdater`.

    Args:
        data: the data list, as for ``SmartCacheDataset``.
        transform: the transform chain, as for ``SmartCacheDataset``.
        replace_rate: fraction of the cache replaced at each update (> 0).
        *args: further positional arguments of ``SmartCacheDataset`` (``cache_num``, ...).
        timeout_s: default longest wait of ``update_cache`` for one replacement, in seconds.
        cache_dir: a folder for a `CropCacheDataset` tier: the window then holds item numbers, not items
            (``None``: the items in RAM, as MONAI's).
        **kwargs: further keyword arguments of ``SmartCacheDataset``.

    Attributes:
        tier: the `CropCacheDataset` under the window (with ``cache_dir``), else ``None``.

    Examples:
        >>> ds = SafeSmartCacheDataset(files, transform, cache_num=4, replace_rate=0.25)  # doctest: +SKIP
    """

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable | None = None,
        replace_rate: float = 0.1,
        *args: Any,
        timeout_s: float = 300.0,
        cache_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        if not replace_rate > 0:
            raise ValueError(f"replace_rate must be > 0, got {replace_rate}; use monai.data.CacheDataset to cache all")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        # before MONAI's constructor, which calls set_data() and is_started()
        self._rotation = _Rotation(rate=float(replace_rate), timeout_s=float(timeout_s))
        self.cache_dir, self.tier = cache_dir, None
        super().__init__(data, transform, replace_rate, *args, **kwargs)

    @classmethod
    def adopt(
        cls,
        dataset: SmartCacheDataset,
        data: Sequence | None = None,
        cache_num: int | None = None,
        timeout_s: float = 300.0,
        cache_dir: str | os.PathLike | None = None,
    ) -> SafeSmartCacheDataset:
        """A safe rotation over what a MONAI ``SmartCacheDataset`` (or one of this class) holds.

        Items, order, settings and random state carry over; a window never rotated is handed over, not
        transformed again (with ``cache_dir``, released and written to the tier afresh). Adopting the same
        data set again gives the same safe one.

        Args:
            dataset: the data set to adopt; its running rotation is shut down.
            data: other items to rotate over instead (a rank's share); then ``cache_num`` may differ.
            cache_num: items to cache; default ``dataset.cache_num`` (at most the number of items).
            timeout_s: as for the constructor.
            cache_dir: as for the constructor; default that of ``dataset`` (one of this class).

        Raises:
            TypeError: ``dataset`` is not a ``SmartCacheDataset``.
        """
        if not isinstance(dataset, SmartCacheDataset):
            raise TypeError(
                f"SafeSmartCacheDataset.adopt needs a monai.data.SmartCacheDataset, got {type(dataset).__name__}"
            )
        earlier = cls.adoption_of(dataset) if data is None and cache_num is None else None
        if earlier is not None:  # the same rotation goes on (a re-run attach cell, a second trainer)
            earlier._rotation.timeout_s = float(timeout_s)
            return earlier
        replace_num = replace_count(dataset)
        safe_already = isinstance(dataset, SafeSmartCacheDataset)
        rate = dataset._rotation.rate if safe_already else replace_num / max(1, dataset.cache_num)
        if dataset.is_started():
            dataset.shutdown()
        items = list(dataset.data if data is None else data)
        num = min(len(items), int(dataset.cache_num if cache_num is None else cache_num))
        if cache_dir is None and safe_already:
            cache_dir = dataset.cache_dir
        fresh = not safe_already and getattr(dataset, "_replace_mgr", True) is None
        handed = list(dataset._cache) if data is None and fresh and len(dataset._cache) == num else None
        if cache_dir is not None and dataset._cache is not None:  # the window's RAM goes: the tier holds it now
            handed, dataset._cache = None, [None] * len(dataset._cache)
        safe = cls.__new__(cls)
        safe._handed_over = handed
        safe.__init__(  # type: ignore[misc]
            items,
            dataset.transform,
            rate if rate > 0 else 1.0,
            cache_num=num,
            num_init_workers=dataset.num_workers,
            num_replace_workers=dataset.num_replace_workers,
            progress=dataset.progress,
            shuffle=False,
            copy_cache=dataset.copy_cache,
            as_contiguous=dataset.as_contiguous,
            timeout_s=timeout_s,
            cache_dir=cache_dir,
        )
        safe._handed_over = None
        safe._adopted_from = weakref.ref(dataset)
        if data is None and cache_num is None:
            _ADOPTIONS[dataset] = safe
        if data is None:  # exactly MONAI's count, whatever rounding the rate took
            safe._rotation.replace_num = max(0, min(replace_num, len(items) - num))
        if dataset.shuffle:
            state = np.random.RandomState()
            state.set_state(dataset.R.get_state())
            safe.set_random_state(state=state)
            safe.shuffle = True
        return safe

    def _fill_cache(self, indices: Any = None) -> list:
        """MONAI's fill, or the window a data set being adopted has cached already (see `adopt()`)."""
        if self.cache_dir is not None:  # over the items as ``set_data`` left them (shuffled, or a rank's share)
            self.tier = CropCacheDataset(self.data, self.transform, self.cache_dir)
        handed = getattr(self, "_handed_over", None)
        if handed is not None and (indices is None or list(indices) == list(range(len(handed)))):
            self._handed_over = None
            return handed
        return super()._fill_cache(indices)

    def set_data(self, data: Sequence) -> None:
        """MONAI's ``set_data`` (stop, shuffle, re-cache the first items); the rotation restarts at 0."""
        self.shutdown()
        super().set_data(data)
        rot = self._rotation
        with rot.cond:
            rot.position, rot.ready, rot.error, rot.failed = 0, None, None, False
            # the tolerance keeps a rate of replace_num / cache_num (an adopted data set's) at that count
            rot.replace_num = max(0, min(math.ceil(self.cache_num * rot.rate - 1e-9), len(self.data) - self.cache_num))

    def is_started(self) -> bool:
        """Whether a replacement thread runs and has not been asked to stop."""
        rot = self._rotation
        return rot.thread is not None and rot.thread.is_alive() and not rot.stop.is_set()

    def start(self) -> None:
        """Start preparing replacements in the background (no-op if running); clears a held error."""
        rot = self._rotation
        with rot.cond:
            if self.is_started():
                return
            rot.error, rot.failed, rot.ready = None, False, None
            rot.stop = threading.Event()
            rot.thread = threading.Thread(
                target=self.manage_replacement,
                args=(rot.stop, not cuda_available()),  # no CUDA here: the steps run on the CPU's cores
                name="monai-fast-smartcache",
                daemon=True,
            )
            rot.thread.start()
        stop_at_exit(self)  # a replacement still being made in torch code at interpreter exit aborts the process

    def update_cache(self, timeout_s: float | None = None) -> None:
        """Swap the oldest ``replace_num`` cached items for the prepared replacements (starting the thread).

        Args:
            timeout_s: longest wait for the replacement; default the dataset's ``timeout_s``.

        Raises:
            DataItemError: preparing a replacement failed; names the item and its files.
            TimeoutError: the replacement took longer than ``timeout_s``.
            RuntimeError: the background thread stopped without a replacement.
        """
        rot = self._rotation
        timeout = rot.timeout_s if timeout_s is None else float(timeout_s)
        if rot.replace_num == 0:  # everything is cached: nothing to rotate
            rot.updates += 1
            return
        with rot.cond:
            held = rot.error is not None
        if not held:
            self.start()
        deadline = time.monotonic() + timeout
        with rot.cond:
            while rot.ready is None:
                failure = self._failure(deadline, timeout)
                if failure is not None:
                    rot.failed = True
                    raise failure
                rot.cond.wait(min(max(deadline - time.monotonic(), 0.0), 0.1))
            self._cache = list(self._cache[rot.replace_num :]) + rot.ready
            rot.position = (rot.position + rot.replace_num) % len(self.data)
            rot.ready, rot.failed = None, False
            rot.updates += 1
            rot.cond.notify_all()  # the thread prepares the next replacement

    def shutdown(self, wait_s: float | None = None) -> None:
        """Stop the background thread, waiting at most ``wait_s`` for its item (default ``timeout_s``, none after a
        failed update); the position and the cache stay where they are."""
        rot = self._rotation
        with rot.cond:
            thread = rot.thread
            rot.stop.set()
            rot.ready = None
            rot.cond.notify_all()
            wait = (0.0 if rot.failed else rot.timeout_s) if wait_s is None else wait_s
        if thread is None or thread is threading.current_thread():
            return
        thread.join(wait)
        if thread.is_alive():
            logger.warning("SmartCache: the replacement thread is still busy after %.1f s; left behind (daemon)", wait)
        else:
            forget_at_exit(self)

    def stop_for_exit(self) -> None:
        """`shutdown()` at interpreter exit, waiting up to ``timeout_s`` even after a failed update."""
        self.shutdown(wait_s=self._rotation.timeout_s)

    def manage_replacement(self, stop: threading.Event | None = None, beside_cpu_steps: bool = False) -> None:
        """Body of the background thread: prepare the replacements for each new position until ``stop``.

        Args:
            stop: set to end the thread (default: the rotation's own event).
            beside_cpu_steps: training runs on the CPU: this thread and its workers run OpenMP serially.
        """
        rot = self._rotation
        stop = rot.stop if stop is None else stop
        if beside_cpu_steps:
            serial_openmp_here()
        while True:
            with rot.cond:
                while rot.ready is not None and not stop.is_set():
                    rot.cond.wait()
                if stop.is_set():
                    return
                position = rot.position
                indices = self._replacement_indices(position)
            try:
                items = self._load_items(indices, self.num_replace_workers, stop, serial=beside_cpu_steps)
            except _ItemFailure as f:
                with rot.cond:
                    if not stop.is_set():
                        rot.error = (f.index, f.error)
                        rot.cond.notify_all()
                return
            with rot.cond:
                if stop.is_set():
                    return
                if position == rot.position and rot.ready is None:
                    rot.ready = items
                    rot.cond.notify_all()

    @staticmethod
    def adoption_of(dataset: SmartCacheDataset) -> SafeSmartCacheDataset | None:
        """The data set that rotates in place of the user's ``dataset`` (`adopt()`) while it holds the same items."""
        safe = _ADOPTIONS.get(dataset)
        if safe is None or len(safe.data) != len(dataset.data):
            return None
        return safe if all(a is b for a, b in zip(safe.data, dataset.data)) else None

    @property
    def adopted_from(self) -> SmartCacheDataset | None:
        """The data set `adopt()` built this one from, while it exists; else ``None``."""
        ref = getattr(self, "_adopted_from", None)
        return None if ref is None else ref()

    @property
    def replace_num(self) -> int:
        """Items swapped at each update."""
        return self._rotation.replace_num

    @property
    def updates(self) -> int:
        """Swaps done so far (restored by `load_state_dict()`)."""
        return self._rotation.updates

    def window(self) -> list[int]:
        """Indices into ``data`` of the items cached now, in cache order."""
        pos, total = self._rotation.position, len(self.data)
        return [(pos + i) % total for i in range(self.cache_num)]

    def state_dict(self) -> dict[str, Any]:
        """The rotation's position: enough to rebuild the same cache window on resume."""
        rot = self._rotation
        return {"start_pos": rot.position, "updates": rot.updates, "total": len(self.data)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stop the thread, move the rotation to a saved position and rebuild the cache there.

        Raises:
            ValueError: the state is for another number of items.
        """
        total = len(self.data)
        if state.get("total") != total:
            raise ValueError(f"SmartCache state is for {state.get('total')} items, this dataset has {total}")
        self.shutdown()
        cached = dict(zip(self.window(), self._cache))
        rot = self._rotation
        with rot.cond:
            rot.position = int(state["start_pos"]) % total
            rot.updates = int(state.get("updates", 0))
            rot.ready, rot.error, rot.failed = None, None, False
        missing = [i for i in self.window() if i not in cached]
        try:
            loaded = dict(zip(missing, self._load_items(missing, self.num_workers)))
        except _ItemFailure as f:
            raise self._item_error(f.index, f.error) from f.error
        self._cache = [cached[i] if i in cached else loaded[i] for i in self.window()]

    def _load_cache_item(self, idx: int) -> Any:
        """Item ``idx``'s deterministic part; with a tier, its number once written there (the item once it is full)."""
        if self.tier is None:
            return super()._load_cache_item(idx)
        if self.tier.disk_full is None:
            self.tier.fill([idx])
        return _OnDisk(idx) if self.tier.item_dir(idx).is_dir() else _InMemory(self.tier.cached(idx))

    def _transform(self, index: int) -> Any:
        """A window item: from the tier, mapped afresh (random transforms never change the window), else MONAI's."""
        if self.tier is None or not self._cache:
            return super()._transform(index)
        cached = self._cache[index % len(self._cache)]
        if isinstance(cached, _OnDisk):
            return self.tier[cached.index]
        if isinstance(cached, _InMemory):  # computed after the disk filled up
            return self.tier.random_part(copy.deepcopy(cached.item) if self.copy_cache else cached.item)
        return super()._transform(index)

    def _replacement_indices(self, position: int) -> list[int]:
        total = len(self.data)
        return [(position + self.cache_num + i) % total for i in range(self._rotation.replace_num)]

    def _load_items(
        self, indices: list[int], workers: int | None, stop: threading.Event | None = None, serial: bool = False
    ) -> list:
        def load(index: int) -> Any:
            if stop is not None and stop.is_set():
                return None
            try:
                return self._load_cache_item(index)
            except Exception as e:
                raise _ItemFailure(index, e) from e

        workers = max(1, int(workers or os.cpu_count() or 1))
        if workers == 1 or len(indices) <= 1:
            return [load(i) for i in indices]
        with ThreadPool(min(workers, len(indices)), initializer=serial_openmp_here if serial else None) as pool:
            return pool.map(load, indices)

    def _item_error(self, index: int, error: BaseException) -> DataItemError:
        named = DataItemError(f"SmartCache replacement of {describe_item(self, index)} failed: {error_text(error)}")
        named.__cause__ = error
        return named

    def _failure(self, deadline: float, timeout: float) -> BaseException | None:
        """The error that ends a wait for a replacement, or ``None`` to keep waiting (``cond`` held)."""
        rot = self._rotation
        if rot.error is not None:
            return self._item_error(*rot.error)
        if not self.is_started():
            return RuntimeError("SmartCache's replacement thread stopped without finishing a replacement")
        if time.monotonic() >= deadline:
            pending = ", ".join(describe_item(self, i) for i in self._replacement_indices(rot.position)[:3])
            return TimeoutError(
                f"SmartCache replacement took longer than {timeout:g} s ({rot.replace_num} items: {pending}"
                f"{', ...' if rot.replace_num > 3 else ''}); raise timeout_s, lower replace_rate or add replace workers"
            )
        return None


@dataclass(frozen=True)
class _OnDisk:
    """A window slot whose item is in the tier: its index into ``data``."""

    index: int


@dataclass(frozen=True)
class _InMemory:
    """A window slot whose item the tier computed in memory (its disk was full), stored indices included."""

    item: dict


class _ItemFailure(Exception):
    """Loading item ``index`` raised ``error`` (carried out of the worker threads)."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error
