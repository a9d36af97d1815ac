"""Measure whether a loader thread should make the next batch during the step, and keep the faster way.

On a CPU a batch made beside the step can slow the step by more than the batch costs, yet a costly
random chain can be worth hiding behind it: `PrefetchChoice` times both on the run itself. Both
ways give the same batches in the same order, so the choice changes timing only.

Examples:
    >>> from monai_fast.handlers import PrefetchChoice
    >>> choice = PrefetchChoice(trainer.data_loader, pairs=4)  # doctest: +SKIP
    >>> choice.attach(trainer)  # doctest: +SKIP
    >>> trainer.run()  # doctest: +SKIP
    >>> choice.prefetch, choice.reason  # doctest: +SKIP
    (False, 'on demand: 0.431 s per iteration against 0.507 s with prefetch (medians of 4 and 4 timed iterations)')
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ignite.engine import Engine, Events

from monai_fast.data.loaders import prefetch_pays
from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.tune.rounds import MIN_GAIN

__all__ = ["PrefetchChoice", "prefetch_for"]


class PrefetchChoice(EngineHandler):
    """Alternates a loader's ``prefetch`` over the first iterations and keeps the faster setting.

    The settings take turns in blocks of `BLOCK` iterations (a block's first, the engine's first and an epoch's
    first and last untimed); the other setting replaces the loader's own only when `MIN_GAIN` faster. A run that
    ends before ``pairs`` timed iterations each way, or epochs shorter than a block, keep the loader's setting.

    Args:
        loader: the engine's loader, with a boolean ``prefetch`` read at each batch (`SafeThreadDataLoader`).
        pairs: iterations timed each way before choosing (>= 1).
        on_choice: called once with ``(prefetch, reason)`` when the choice is made.
        ready: asked at each batch; while ``False`` (a cache filling, another lever measuring) nothing is timed.
            ``None``: always ready.
        conclude_at_run_end: `conclude()` when a run of the engine ends.

    Raises:
        TypeError: ``loader`` has no boolean ``prefetch``; ValueError: ``pairs`` < 1.

    Examples:
        >>> from ignite.engine import Engine
        >>> from monai_fast.data.loaders import SafeThreadDataLoader
        >>> loader = SafeThreadDataLoader(list(range(8)), batch_size=1, prefetch=False)
        >>> choice, engine = PrefetchChoice(loader, pairs=2), Engine(lambda e, b: b)
        >>> choice.attach(engine); _ = engine.run(loader, max_epochs=1)
    """

    #: iterations per block of one setting
    BLOCK = 3

    def __init__(
        self,
        loader: Any,
        pairs: int = 4,
        on_choice: Callable[[bool, str], None] | None = None,
        ready: Callable[[], bool] | None = None,
        conclude_at_run_end: bool = True,
    ) -> None:
        if not isinstance(getattr(loader, "prefetch", None), bool):
            raise TypeError(
                f"PrefetchChoice needs a loader with a boolean 'prefetch' (a SafeThreadDataLoader), "
                f"got {type(loader).__name__}"
            )
        if not isinstance(pairs, int) or pairs < 1:
            raise ValueError(f"PrefetchChoice: pairs must be an integer >= 1, got {pairs!r}")
        super().__init__()
        self.loader, self.pairs, self.on_choice, self.ready = loader, pairs, on_choice, ready
        self.conclude_at_run_end = conclude_at_run_end
        self._initial: bool = loader.prefetch  # kept when no iteration can be timed
        #: seconds per timed iteration, by setting
        self.times: dict[bool, list[float]] = {True: [], False: []}
        #: the setting kept (``None`` until chosen) and why
        self.prefetch: bool | None = None
        self.reason = ""
        self._setting = False  # the setting of the current block
        self._in_block = 0
        self._previous: bool | None = None  # the setting of the iteration before, in this epoch
        self._open: tuple[bool, float, int, bool] | None = None  # (setting, batch arrival, epoch, timed)
        self._waiting = False  # ``ready`` said no at this batch

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.GET_BATCH_STARTED, self._set)
        self.on(engine, Events.GET_BATCH_COMPLETED, self._arrived)
        self.on(engine, Events.EPOCH_STARTED, self._new_epoch)
        if self.conclude_at_run_end:
            self.on_run_end(engine, self.conclude)

    @property
    def measured(self) -> bool:
        """Whether the setting kept was measured (``pairs`` timed iterations each way), not kept for want of them."""
        return self.prefetch is not None and all(len(t) >= self.pairs for t in self.times.values())

    def conclude(self, engine: Engine | None = None) -> None:
        """Stop measuring: keep the loader's setting from before the attach when nothing was chosen yet, and say why.

        Called at the end of each run of the engine (unless ``conclude_at_run_end=False``: an
        evaluator whose short runs add up to a measurement, concluded by its trainer's run end).
        """
        if self.prefetch is not None:
            return
        kept = "prefetch" if self._initial else "on demand"
        if self._waiting:
            why = "the run ended while its caches filled or another lever measured (the layout's rounds): nothing timed"
        else:
            why = (
                f"the run ended after {len(self.times[True])} timed iteration(s) with prefetch and "
                f"{len(self.times[False])} on demand, short of the {self.pairs} each way needed to choose"
            )
        self._settle(self._initial, f"{kept} kept: {why}")

    def _new_epoch(self, engine: Engine) -> None:
        self._open = None  # an iteration is timed only up to the next batch of the same epoch
        self._previous = None
        length = engine.state.epoch_length
        if self.prefetch is None and length is not None and length < self.BLOCK:
            self._settle(
                self._initial,
                f"{'prefetch' if self._initial else 'on demand'} kept: epochs of {length} "
                f"iteration(s) are too short to time both ways",
            )

    def _set(self, engine: Engine) -> None:
        if self.prefetch is not None:
            return
        self._waiting = self.ready is not None and not self.ready()
        if self._waiting:  # not ready to time: the loader keeps its own setting, nothing alternates
            self.loader.prefetch = self._initial
            return
        # settings alternate in blocks of BLOCK iterations; a block's first iteration is not timed, since
        # what the loader thread did in the iteration before it still disturbs it
        if self._in_block >= self.BLOCK and len(self.times[not self._setting]) < self.pairs:
            self._setting, self._in_block = not self._setting, 0
        self.loader.prefetch = self._setting  # read by the loader when this batch arrives, for the batch after it

    def _arrived(self, engine: Engine) -> None:
        if self.prefetch is not None:
            return
        now = time.perf_counter()
        opened = self._open
        if opened is not None and opened[2] == engine.state.epoch and opened[3]:
            self.times[opened[0]].append(now - opened[1])
        if all(len(t) >= self.pairs for t in self.times.values()):
            self._choose()
            return
        if self._waiting:  # an iteration begun before the run was ready to time is not timed, nor counted in a block
            self._open = self._previous = None
            return
        iteration = engine.state.iteration + 1  # the one starting now; ignite counts it after this event
        setting = self.loader.prefetch
        timed = iteration > 1 and self._previous == setting
        self._open = (setting, now, engine.state.epoch, timed)
        self._previous = setting
        self._in_block += 1

    def _choose(self) -> None:
        """The other setting replaces the loader's own only when it was `MIN_GAIN` faster: a near-tie keeps it."""
        ahead, asked = statistics.median(self.times[True]), statistics.median(self.times[False])
        own = self._initial
        gain = (asked / ahead if not own else ahead / asked) if min(ahead, asked) > 0 else 1.0
        prefetch = (not own) if gain >= MIN_GAIN else own
        won, lost = (ahead, asked) if prefetch else (asked, ahead)
        counts = f"medians of {len(self.times[prefetch])} and {len(self.times[not prefetch])} timed iterations"
        tie = (
            ""
            if gain >= MIN_GAIN or won <= lost
            else f"; a near-tie keeps the loader's own setting ({MIN_GAIN}x needed)"
        )
        self._settle(
            prefetch,
            f"{'prefetch' if prefetch else 'on demand'}: {won:.3f} s per iteration against "
            f"{lost:.3f} s {'on demand' if prefetch else 'with prefetch'} ({counts}){tie}",
        )

    def _settle(self, prefetch: bool, reason: str) -> None:
        self.prefetch, self.reason = prefetch, reason
        self.loader.prefetch = prefetch
        if self.on_choice is not None:
            self.on_choice(prefetch, reason)


def prefetch_for(
    loader: Any,
    device: Any,
    requested: str | bool = "auto",
    on_choice: Callable[[bool, str], None] | None = None,
    ready: Callable[[], bool] | None = None,
    conclude_at_run_end: bool = True,
) -> tuple[str, str, PrefetchChoice | None]:
    """Set ``loader.prefetch`` for ``requested`` and say why; on a CPU with ``"auto"``, a `PrefetchChoice`
    to attach.

    ``True`` / ``False`` are kept as requested. ``"auto"``: ahead where worker processes make the
    batches (they work ahead in any case) and where `prefetch_pays()`
    says it surely pays (a GPU); otherwise on demand until the returned choice has measured both
    (``on_choice``, ``ready`` and ``conclude_at_run_end`` go to it).

    Returns:
        the setting (``"ahead"``, ``"on demand"`` or ``"measuring"``), the reason, and the
        `PrefetchChoice` for the caller to attach to the loader's engine (or ``None``).

    Examples:
        >>> from monai_fast.data.loaders import SafeThreadDataLoader
        >>> loader = SafeThreadDataLoader(list(range(4)))
        >>> prefetch_for(loader, "cuda")[:2], loader.prefetch
        (('ahead', 'the step runs on cuda: the next batch is made while it computes'), True)
        >>> prefetch_for(loader, "cpu")[0], loader.prefetch
        ('measuring', False)
    """
    if requested != "auto":
        loader.prefetch = bool(requested)
        return ("ahead" if requested else "on demand"), f"requested prefetch={requested}", None
    if loader.num_workers > 0:
        loader.prefetch = True
        return "ahead", f"{loader.num_workers} worker processes make the batches ahead", None
    pays, why = prefetch_pays(device)
    loader.prefetch = pays
    if pays:
        return "ahead", why, None
    return (
        "measuring",
        f"{why}; the first iterations time it against prefetch",
        PrefetchChoice(loader, on_choice=on_choice, ready=ready, conclude_at_run_end=conclude_at_run_end),
    )
