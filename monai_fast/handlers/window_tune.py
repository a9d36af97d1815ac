"""Measure a MONAI evaluator's sliding-window batch at its first run and set it on its ``SlidingWindowInferer``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.inferers import SlidingWindowInferer
from monai.utils import CommonKeys

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.tune.tuner import tune_validation  # the tuner core, below handlers (docs/design.md)

__all__ = ["SlidingWindowTune", "sliding_window_of"]


def sliding_window_of(inferer: Any) -> SlidingWindowInferer | None:
    """The ``SlidingWindowInferer`` inside ``inferer`` (through wrappers with an ``inner``), or ``None``."""
    while not isinstance(inferer, SlidingWindowInferer) and "inner" in getattr(inferer, "__dict__", {}):
        inferer = inferer.inner
    return inferer if isinstance(inferer, SlidingWindowInferer) else None


class SlidingWindowTune(EngineHandler):
    """At the evaluator's first run, times its sliding window on a volume of its first item's size and sets the batch.

    The measure is kept in the tuning store; the stitching device and the global random state are kept.
    A `TypeError` at attach when the engine's inferer holds no ``SlidingWindowInferer``.

    Args:
        precision: called at the first run: the evaluator's precision (``"bf16"``, ``"fp16"``, ``"fp32"``).
        device: where the network runs (the stitching device, when the window has none).
        store: the tuning store: ``"default"``, a JSON file, or ``None`` (measure every run).
        on_result: called once with ``(applied, setting, reason)``.

    Examples:
        >>> SlidingWindowTune(lambda: "bf16", "cpu", store=None).attach(evaluator)  # doctest: +SKIP
    """

    def __init__(
        self,
        precision: Callable[[], str],
        device: str | torch.device,
        store: str | os.PathLike | None = "default",
        on_result: Callable[[bool, str | None, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.precision, self.device, self.store, self.on_result = precision, torch.device(device), store, on_result
        self.reason = ""
        self._window: SlidingWindowInferer | None = None
        self._done = False

    def _attach(self, engine: Engine) -> None:
        self._window = sliding_window_of(getattr(engine, "inferer", None))
        if self._window is None:
            raise TypeError(
                f"SlidingWindowTune: the engine's inferer ({type(getattr(engine, 'inferer', None)).__name__}) "
                "is not a SlidingWindowInferer"
            )
        self._done = False
        self.on(engine, Events.STARTED, self._tune)  # Events.STARTED has no once= filter (its count stays 0)

    def _tune(self, engine: Engine) -> None:
        if self._done:
            return
        self._done = True
        window, item = self._window, engine.data_loader.dataset[0]
        if isinstance(item, (list, tuple)) and item:  # a list of crops: the first one
            item = item[0]
        image = item.get(CommonKeys.IMAGE) if isinstance(item, dict) else None
        image = torch.as_tensor(image) if image is not None else None
        if image is None or image.dim() != 4:
            self._result(False, None, "the first validation item has no 4-D image (C, D, H, W): nothing to tune")
            return
        precision, before = self.precision(), window.sw_batch_size
        overlap = float(min(window.overlap)) if isinstance(window.overlap, Sequence) else float(window.overlap)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            pick = tune_validation(
                engine.network,
                window.roi_size,
                tuple(image.shape[1:]),
                window.sw_device or self.device,
                precision,
                overlap=overlap,
                in_channels=image.shape[0],
                sw_batch_range=(1, 32),
                store=self.store,
            )
        window.sw_batch_size = pick.sw_batch_size
        self._result(
            pick.sw_batch_size != before,
            f"sw_batch_size={pick.sw_batch_size}",
            f"measured {pick.val_volumes_per_s:.2f} volumes/s on {tuple(image.shape[1:])} volumes at {precision} "
            f"(was sw_batch_size={before}){' (cached)' if pick.from_cache else ''}",
        )

    def _result(self, applied: bool, setting: str | None, reason: str) -> None:
        self.reason = reason
        if self.on_result is not None:
            self.on_result(applied, setting, reason)
