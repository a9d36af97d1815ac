"""Tune a sliding-window evaluator on its own: windows per forward pass and where the output is stitched.

`FastTraining` uses it for ``evaluator="tune"``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace

import torch

from monai_fast.tune.result import TuneResult
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore, default_store_path
from monai_fast.tune.tuner import Tuner

__all__ = ["tune_validation"]

logger = logging.getLogger("monai_fast.tune")


def tune_validation(
    network: torch.nn.Module,
    roi_size: Sequence[int],
    val_shape: Sequence[int],
    device: str | torch.device,
    precision: str,
    overlap: float = 0.25,
    in_channels: int = 1,
    sw_batch_range: tuple[int, int] = (1, 32),
    store: TuneStore | str | os.PathLike | None = "default",
    force: bool = False,
    progress: bool = False,
    **timing: float,
) -> TuneResult:
    """The fastest ``sw_batch_size`` and stitching device for ``network`` on ``val_shape`` volumes, timed with
    MONAI's ``sliding_window_inference`` and kept in the tuning store.

    Args:
        network: the evaluator's network (a private copy is timed; DDP wrappers looked through).
        roi_size: the sliding window's ROI.
        val_shape: spatial size of a typical validation volume (as the evaluator sees it).
        device: where the network runs.
        precision: the evaluator's precision (``"fp32"``, ``"bf16"``, ``"fp16"``).
        overlap: the window overlap.
        in_channels: image channels.
        sw_batch_range: inclusive range of windows per forward pass to search.
        store: a `TuneStore`, a path to one, ``"default"`` (`default_store_path()`) or ``None`` (no caching).
        force: tune again even when the store holds a result.
        progress: a progress bar over trials.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` per trial (default 1, 2, 0.3 s).

    Returns:
        A `TuneResult` whose ``sw_batch_size``, ``val_device`` and ``val_volumes_per_s`` are measured.

    Raises:
        TuningError: a trial failed for a reason other than memory, or not even one window fits.
    """
    timing = {"warmup": 1, "min_iters": 2, "min_time_s": 0.3, **timing}
    tuner = Tuner(
        getattr(network, "module", network),
        None,
        None,
        patch_size=roi_size,
        val_shape=val_shape,
        device=device,
        in_channels=in_channels,
        space=SearchSpace(precisions=[precision], sw_batch_range=sw_batch_range),
        overlap=overlap,
        **timing,
    )
    if store == "default":
        store = default_store_path()
    if store is not None and not isinstance(store, TuneStore):
        store = TuneStore(store)
    key = tuner.key() + f"|overlap={overlap:g}|validation-only"
    if store is not None and not force:
        cached = store.get(key)
        if cached is not None:
            logger.info("validation tuning: using the cached result from %s", store.path)
            return cached
    result = replace(tuner.run_validation(precision, progress=progress), key=key)
    if store is not None:
        store.put(result)
    return result
