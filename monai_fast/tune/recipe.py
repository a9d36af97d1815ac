"""Tuning for the recipes' network, loss and optimizer, with the result cached on disk."""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from monai.losses import DiceCELoss
from monai.transforms import Compose

from monai_fast.handlers.amp import choose_precision
from monai_fast.recipes.common import build_network, build_optimizer
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.fast import DEFAULTS as FAST_DEFAULTS
from monai_fast.recipes.transforms import deterministic_transforms
from monai_fast.tune.store import TuneStore
from monai_fast.tune.tuner import SearchSpace, Tuner, TuneResult

__all__ = ["default_space", "default_store_path", "tune_recipe"]

logger = logging.getLogger("monai_fast.tune")


def default_store_path() -> Path:
    """``$MONAI_FAST_CACHE/tuning.json``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get("MONAI_FAST_CACHE")
    if root:
        return Path(root) / "tuning.json"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "monai-fast" / "tuning.json"


def default_space(device: torch.device | str, search_amp: bool = False, amp: bool | None = None, **kwargs) -> SearchSpace:
    """The recipes' search space: ``fast``'s automatic precision, plus fp32 when ``search_amp``.

    ``amp=False`` (the recipe's fp32 switch) searches fp32 only.
    """
    if amp is False:
        return SearchSpace(precisions=["fp32"], **kwargs)
    first = choose_precision("auto", device)
    precisions = [first, "fp32"] if search_amp else [first]
    return SearchSpace(precisions=precisions, **kwargs)


def typical_val_shape(val_files: Sequence[dict], config: RecipeConfig, n: int = 3) -> tuple[int, int, int]:
    """Median spatial size of up to ``n`` validation volumes after the recipes' cached transforms."""
    if not val_files:
        raise ValueError("no validation files to take a volume size from")
    chain = Compose(deterministic_transforms(config))
    shapes = [tuple(chain(dict(item))["image"].shape[1:]) for item in list(val_files)[:n]]
    return tuple(int(statistics.median(s[i] for s in shapes)) for i in range(3))  # type: ignore[return-value]


def tune_recipe(
    config: RecipeConfig,
    val_shape: tuple[int, int, int],
    device: str | torch.device = "cpu",
    space: SearchSpace | None = None,
    memory_cap_mib: float | None = None,
    store: TuneStore | str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = False,
    **timing,
) -> TuneResult:
    """Tune the ``fast`` recipe's UNet, DiceCE loss and optimizer for ``config``; cached by key.

    Args:
        config: the recipe options (network size, patch size, crops per volume, overlap).
        val_shape: spatial size of a typical validation volume after the cached transforms.
        device: where training runs.
        space: what to search; default :func:`default_space`.
        memory_cap_mib: memory a candidate may use (see :class:`~monai_fast.tune.Tuner`).
        store: the cache file (or a :class:`TuneStore`); default :func:`default_store_path`.
        force: tune again even when the cache holds a result.
        progress: a progress bar over trials.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` passed to the tuner (default 1, 2,
            0.3 s: one untimed step, then the median of at least two timed ones).

    Example:
        >>> from monai_fast.recipes import RecipeConfig
        >>> from monai_fast.tune import tune_recipe
        >>> result = tune_recipe(RecipeConfig(), val_shape=(160, 160, 96))  # doctest: +SKIP
        >>> config = result.apply(RecipeConfig())  # doctest: +SKIP
    """
    device = torch.device(device)
    config = config.with_defaults(**FAST_DEFAULTS)
    timing = {"warmup": 1, "min_iters": 2, "min_time_s": 0.3, **timing}
    network = build_network(config, torch.device("cpu"))
    loss = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)
    tuner = Tuner(
        network,
        loss,
        lambda params: build_optimizer(config, params),
        patch_size=config.patch_size,
        val_shape=val_shape,
        device=device,
        num_samples=config.num_samples,
        space=space or default_space(device),
        memory_cap_mib=memory_cap_mib,
        overlap=config.sw_overlap,
        **timing,
    )
    if not isinstance(store, TuneStore):
        store = TuneStore(store or default_store_path())
    if not force:
        cached = store.get(tuner.key())
        if cached is not None:
            logger.info("tuning: using the cached result from %s", store.path)
            return cached
    result = tuner.run(progress=progress)
    store.put(result)
    return result
