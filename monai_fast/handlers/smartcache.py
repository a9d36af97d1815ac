"""Drive a SmartCache rotation from an ignite engine: MONAI's ``SmartCacheDataset`` or the safe one.

``SmartCacheUpdater().attach(trainer)`` finds the ``SmartCacheDataset`` in the trainer's
``data_loader``. MONAI's own is adopted into a
`SafeSmartCacheDataset` (its items, window, rotation settings
and random state; the loader rebuilt as `adopt_loader()` rebuilds it);
where it cannot be adopted, MONAI's rotation is driven through its public methods with the same
timeout, named errors, rank agreement and resumable position.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import SmartCacheDataset
from monai.handlers import SmartCacheHandler

from monai_fast.data.adopt import adopt_loader, unknown_item_path, why_not_adoptable
from monai_fast.data.items import DataItemError, describe_item, error_text
from monai_fast.data.smartcache import SafeSmartCacheDataset, replace_count
from monai_fast.handlers.lifecycle import EngineHandler, callbacks_on, is_running

__all__ = ["SmartCacheUpdater"]

logger = logging.getLogger("monai_fast.handlers")


class SmartCacheUpdater(EngineHandler):
    """MONAI's ``SmartCacheHandler`` that never hangs, names failures, agrees across ranks and resumes.

    Starts the rotation when the run starts, calls ``update_cache`` at each epoch's end with a
    bounded wait, and shuts it down when the run ends (also when it raises). Under
    ``ignite.distributed`` one rank's failed update makes every rank raise, so none waits alone in
    a later collective. It runs in one of three modes, named in one log line at attach and in
    `mode`:

    * ``"safe"``: the data set is a `SafeSmartCacheDataset`; its own rotation has the
      bounded waits, named errors and position (this handler touches none of its internals).
    * ``"adopted"``: the engine's ``data_loader`` holds MONAI's ``SmartCacheDataset``. It becomes a
      `SafeSmartCacheDataset` with the same items, window, transform, rotation settings,
      ``copy_cache``, ``as_contiguous`` and random state (its cached window handed over), and the
      engine's ``data_loader`` is rebuilt over it as ``FastTraining`` rebuilds one (batch size,
      shuffling, ``drop_last``, collate function kept; a ``DistributedSampler`` becomes a per-rank
      partition rotated by that rank). Then as ``"safe"``.
    * ``"monai"``: MONAI's data set cannot be adopted (a subclass with its own item path or
      rotation, a loader that cannot be rebuilt, an engine without ``data_loader``). It is left as
      it is and driven through its public ``start``, ``update_cache`` and ``shutdown``, each call
      bounded by ``timeout_s``. A replacement that raises in MONAI's background thread is caught
      from that thread and raised at the epoch's end as `DataItemError`
      naming the item and its files; a wait past ``timeout_s`` is a ``TimeoutError``. MONAI's
      ``update_cache`` keeps polling in a daemon thread after such a failure (it has no way to
      stop): rebuild the data set before the next run. The position is counted here, and
      ``load_state_dict`` moves MONAI's rotation there through ``set_data`` (the same window, the
      data list rotated to start at it).

    MONAI's ``SmartCacheHandler`` for the same data set (in a script's ``train_handlers``) is
    removed from the engine at attach, with a log line: the rotation runs once per epoch, and never
    on a data set the loader no longer reads.

    ``state_dict()`` is ``{"start_pos", "updates", "total"}`` in every mode, so a checkpoint taken
    in one mode resumes in another. Pass the updater to ignite's ``Checkpoint``, attached *after*
    the updater so an epoch-end save sees the rotated position. As every monai-fast handler
    (`monai_fast.handlers.lifecycle`), attaching a new instance to an engine that has one (a
    re-run notebook cell) replaces the old one, so the cache rotates once per epoch.

    Args:
        dataset: the data set to rotate; ``None`` (the usual): the one in the engine's
            ``data_loader``, found at attach.
        timeout_s: longest wait for one epoch's replacement, in seconds.

    Raises:
        TypeError: ``dataset`` is not a ``SmartCacheDataset``; at attach, without ``dataset``, the
            engine's ``data_loader`` holds none.
        ValueError: ``timeout_s`` is not positive.
        RuntimeError: at attach, the engine is inside ``run()``.

    Examples:
        >>> from monai.data import SmartCacheDataset
        >>> from monai_fast.handlers import SmartCacheUpdater
        >>> train_ds = SmartCacheDataset(files, transform, cache_num=4, replace_rate=0.25)  # doctest: +SKIP
        >>> trainer = SupervisedTrainer(..., train_data_loader=DataLoader(train_ds, batch_size=2))  # doctest: +SKIP
        >>> updater = SmartCacheUpdater(timeout_s=120)
        >>> updater.attach(trainer)  # doctest: +SKIP
        >>> to_save = {"trainer": trainer, "model": net, "smartcache": updater}  # doctest: +SKIP
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
        self.dataset: SmartCacheDataset | None = dataset
        self.timeout_s = float(timeout_s)
        #: "safe", "adopted" or "monai" once attached (see the class docstring); ``None`` before
        self.mode: str | None = None
        #: why MONAI's rotation is driven as it is (mode "monai"), else ``None``
        self.reason: str | None = None
        self._pending: dict[str, Any] | None = None  # a state loaded before attach
        self._drive: _MonaiRotation | None = None

    @property
    def updates(self) -> int:
        """Rotations done so far (one ``update_cache`` per epoch), as in `state_dict()`; 0 before attach."""
        if self.dataset is None:
            return 0
        return int(self.state_dict()["updates"])

    # ---- attach ---------------------------------------------------------------------------------

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
        _take_over_from_monais_handler(engine, ds)
        self.mode, self.reason, self._drive = self._choose(engine, loader, ds)
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        self.on_run_end(engine, self._stop)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.load_state_dict(state)

    def _choose(
        self, engine: Engine, loader: Any, ds: SmartCacheDataset
    ) -> tuple[str, str | None, _MonaiRotation | None]:
        """Adopt MONAI's data set where the rules allow, else drive it; log which mode and why."""
        if isinstance(ds, SafeSmartCacheDataset):
            self.dataset = ds
            logger.info("SmartCacheUpdater: rotates the SafeSmartCacheDataset (timeout_s=%g)", self.timeout_s)
            return "safe", None, None
        if loader is None or getattr(loader, "dataset", None) is not ds:
            why = (
                "the engine has no data_loader to rebuild (a plain ignite Engine gets its data at run())"
                if loader is None
                else "the engine's data_loader does not hold this data set"
            )
        else:
            why = why_not_adoptable(loader) or unknown_item_path(ds, rotation=True)
        if why is None:
            adopted = adopt_loader(loader)
            engine.data_loader = adopted.loader
            self.dataset = adopted.dataset
            logger.info("SmartCacheUpdater: %s; the engine's data_loader rebuilt: %s", *adopted.notes[:2])
            return "adopted", None, None
        self.dataset = ds
        logger.info(
            "SmartCacheUpdater: drives MONAI's own rotation (start, update_cache, shutdown) with timeout_s=%g "
            "and named errors, not adopted: %s",
            self.timeout_s,
            why,
        )
        return "monai", why, _MonaiRotation.of(ds)

    def _detached(self, engine: Engine) -> None:
        self._stop(engine)

    # ---- events ---------------------------------------------------------------------------------

    def _started(self, engine: Engine) -> None:
        if self._drive is not None:
            self._drive.start(self.timeout_s)
        else:
            self.dataset.start()

    def _epoch_completed(self, engine: Engine) -> None:
        failure: Exception | None = None
        try:
            if self._drive is not None:
                self._drive.update(self.timeout_s)
            else:
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
        if self._drive is not None:
            self._drive.shutdown(self.timeout_s)
        elif self.dataset is not None:
            self.dataset.shutdown()

    # ---- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The rotation's position, ``{"start_pos", "updates", "total"}``: enough to rebuild the same window."""
        if self._drive is not None:
            return self._drive.state_dict()
        if self.dataset is None:
            raise RuntimeError("SmartCacheUpdater.state_dict: attach the updater first (it finds its data set then)")
        if not isinstance(self.dataset, SafeSmartCacheDataset):  # given MONAI's, not attached yet
            return _MonaiRotation.of(self.dataset).state_dict()
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move the rotation to a saved position and rebuild the cache there (held until attach when not attached)."""
        if self.mode is None:
            self._pending = dict(state)
        elif self._drive is not None:
            self._drive.load_state_dict(state, self.timeout_s)
        else:
            self.dataset.load_state_dict(state)


def _take_over_from_monais_handler(engine: Engine, dataset: SmartCacheDataset) -> None:
    """Remove MONAI's ``SmartCacheHandler`` for ``dataset`` (or the data set it was adopted from) from ``engine``.

    A script written for MONAI's ``SmartCacheDataset`` has MONAI's handler in its
    ``train_handlers``: left there, it would rotate the data set a second time each epoch (or, once
    adopted, the data set the loader no longer reads, and wait forever on its failed replacement).
    The handlers are listed through `callbacks_on()` (ignite has no
    public way to list them); the removal goes through the public ``remove_event_handler``.
    """
    sources = [dataset]
    if isinstance(dataset, SafeSmartCacheDataset) and dataset.adopted_from is not None:
        sources.append(dataset.adopted_from)
    found: list[SmartCacheHandler] = []
    for fn in callbacks_on(engine, Events.EPOCH_COMPLETED):
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, SmartCacheHandler) and any(owner.smartcacher is s for s in sources) and owner not in found:
            found.append(owner)
    for handler in found:
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


class _MonaiRotation:
    """MONAI's ``SmartCacheDataset`` driven through ``start`` / ``update_cache`` / ``shutdown`` with bounded waits.

    The position is counted here, relative to the data list as MONAI shuffled it at construction:
    ``origin`` (where the list starts after `_move_to()` rotated it) plus the replacement count
    for each update since. MONAI's ``shutdown`` resets its own position but not its cache, so a
    rotation that moved since it was last placed is placed again (``set_data``) before it
    restarts. A replacement error in MONAI's background thread is caught by `_ThreadErrors`.
    One object per data set (`of()`), so an updater that replaces another (a re-run cell)
    continues the count.
    """

    _by_dataset: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, dataset: SmartCacheDataset) -> _MonaiRotation:
        """The rotation state of ``dataset``, made at first use."""
        rotation = cls._by_dataset.get(dataset)
        if rotation is None:
            rotation = cls._by_dataset[dataset] = cls(dataset)
        return rotation

    def __init__(self, dataset: SmartCacheDataset) -> None:
        self.dataset = dataset
        self.updates = 0
        self.based_at = 0  # ``updates`` when MONAI's position was last 0 at ``origin``
        self.origin = 0  # the original position of ``data[0]``
        self.failed = False
        self.error: tuple[BaseException, int | None] | None = None

    def start(self, timeout_s: float) -> None:
        self.error, self.failed = None, False
        if self.updates != self.based_at:  # a finished run moved it: MONAI's shutdown reset its position only
            self._move_to(self.state_dict()["start_pos"])
        _ThreadErrors.watch(self)
        self.dataset.start()

    def update(self, timeout_s: float) -> None:
        if self.error is None:  # a thread that already died is not waited for (update_cache would poll forever)
            self._bounded(self.dataset.update_cache, timeout_s, "update_cache")
        if self.error is not None:
            self.failed = True
            raise self._named_error()
        self.updates += 1

    def shutdown(self, timeout_s: float) -> None:
        try:
            self._bounded(self.dataset.shutdown, 0.0 if self.failed else timeout_s, "shutdown", raise_errors=False)
        finally:
            _ThreadErrors.unwatch(self)

    def state_dict(self) -> dict[str, Any]:
        total = len(self.dataset.data)
        position = (self.origin + (self.updates - self.based_at) * replace_count(self.dataset)) % max(1, total)
        return {"start_pos": position, "updates": self.updates, "total": total}

    def load_state_dict(self, state: dict[str, Any], timeout_s: float) -> None:
        total = len(self.dataset.data)
        if state.get("total") != total:
            raise ValueError(f"SmartCache state is for {state.get('total')} items, this dataset has {total}")
        self.shutdown(timeout_s)
        self._move_to(int(state["start_pos"]) % total)
        self.updates = self.based_at = int(state.get("updates", 0))

    def _move_to(self, position: int) -> None:
        """Rotate the data list to start at ``position`` and re-cache its window (MONAI's ``set_data``, unshuffled)."""
        data = list(self.dataset.data)
        shift = (position - self.origin) % len(data)
        shuffle, self.dataset.shuffle = self.dataset.shuffle, False  # the list is in MONAI's order already
        try:
            self.dataset.set_data(data[shift:] + data[:shift])
        finally:
            self.dataset.shuffle = shuffle
        self.origin, self.based_at = position, self.updates

    def _named_error(self) -> DataItemError:
        error, index = self.error  # type: ignore[misc]
        where = describe_item(self.dataset, index) if index is not None else "a replacement item"
        failure = DataItemError(f"SmartCache replacement of {where} failed: {error_text(error)}")
        failure.__cause__ = error
        return failure

    def thread_failed(self, error: BaseException, index: int | None) -> None:
        if self.error is None:
            self.error = (error, index)

    def _bounded(self, call: Callable[[], None], timeout_s: float, name: str, raise_errors: bool = True) -> None:
        """Run ``call`` in a daemon thread; wait at most ``timeout_s``, raising a caught replacement error first."""
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                call()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=run, name=f"monai-fast-smartcache-{name}", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.05)
            if self.error is not None and thread.is_alive():
                self.failed = True
                if raise_errors:
                    logger.warning(
                        "MONAI's SmartCacheDataset.%s keeps waiting in a daemon thread after its "
                        "replacement thread died; rebuild the data set before another run",
                        name,
                    )
                return
            if thread.is_alive() and time.monotonic() >= deadline:
                self.failed = True
                if not raise_errors:
                    logger.warning(
                        "MONAI's SmartCacheDataset.%s did not return within %.1f s; left behind (daemon)",
                        name,
                        timeout_s,
                    )
                    return
                raise TimeoutError(
                    f"MONAI's SmartCacheDataset.{name} took longer than {timeout_s:g} s (its replacement thread is "
                    "stuck or slow); raise timeout_s, lower replace_rate or add num_replace_workers"
                )
        if "error" in box and raise_errors:
            raise box["error"]


class _ThreadErrors:
    """Catches the exceptions that kill MONAI's replacement threads, for the `_MonaiRotation` they belong to.

    MONAI's replacement thread lets a transform error end it, and Python hands that error to
    ``threading.excepthook``. While a rotation is watched, a hook chained in front of the one
    installed finds the data set among the failing thread's frames (``self`` of MONAI's
    methods) and the item's index (``pos`` of ``_replace_cache_thread``); other errors go on to the
    previous hook unchanged. The hook is removed when no rotation is watched.
    """

    _lock = threading.Lock()
    _watched: dict[int, _MonaiRotation] = {}
    _previous: Callable[[Any], Any] | None = None

    @classmethod
    def watch(cls, rotation: _MonaiRotation) -> None:
        with cls._lock:
            cls._watched[id(rotation.dataset)] = rotation
            if cls._previous is None:
                cls._previous = threading.excepthook
                threading.excepthook = cls._hook

    @classmethod
    def unwatch(cls, rotation: _MonaiRotation) -> None:
        with cls._lock:
            if cls._watched.get(id(rotation.dataset)) is rotation:
                del cls._watched[id(rotation.dataset)]
            if not cls._watched and cls._previous is not None:
                if threading.excepthook is cls._hook:
                    threading.excepthook = cls._previous
                cls._previous = None

    @classmethod
    def _hook(cls, args: Any) -> None:
        rotation, index = None, None
        tb = args.exc_traceback
        while tb is not None:
            frame = tb.tb_frame
            owner = cls._watched.get(id(frame.f_locals.get("self")))
            if owner is not None and frame.f_locals.get("self") is owner.dataset:
                rotation = owner
                if frame.f_code.co_name == "_replace_cache_thread":
                    index = frame.f_locals.get("pos")
            tb = tb.tb_next
        if rotation is not None and args.exc_value is not None:
            logger.debug("SmartCache replacement thread failed: %s", error_text(args.exc_value))
            rotation.thread_failed(args.exc_value, index)
            return
        previous = cls._previous or threading.__excepthook__
        previous(args)
