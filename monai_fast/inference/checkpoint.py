"""The inference checkpoint: a recipe network's weights with the :class:`RecipeConfig` that rebuilds it.

The format is one ``torch.save`` dict, readable with ``torch.load(..., weights_only=True)``::

    {"format": "monai-fast/model", "version": 1, "config": RecipeConfig.to_dict(), "out_channels": 2, "model": state_dict}

:func:`load_checkpoint` also takes a :class:`~monai_fast.handlers.checkpoint_folder.CheckpointFolder` /
``Preemption`` checkpoint (its ``"model"`` or ``"network"`` entry) when the caller passes the
config the run was built from. Whatever is wrong with the file (missing, damaged, no weights,
weights of another network) is one :class:`CheckpointError` naming the file, raised before any
volume is read.

Example:
    >>> import tempfile, torch
    >>> from monai_fast.recipes import RecipeConfig
    >>> from monai_fast.recipes.common import build_network
    >>> config = RecipeConfig(channels=(4, 8), strides=(2,), patch_size=(16, 16, 16))
    >>> path = save_checkpoint(tempfile.mkdtemp() + "/model.pt", build_network(config, torch.device("cpu")), config)
    >>> net, loaded = load_checkpoint(path)
    >>> loaded.channels
    (4, 8)
"""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from monai_fast.files import atomic_write
from monai_fast.recipes.common import build_network
from monai_fast.recipes.config import RecipeConfig

__all__ = ["FORMAT", "CheckpointError", "InferenceError", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT = "monai-fast/model"
_VERSION = 1
#: the entries of a training checkpoint that may hold the network's weights, in the order tried
_WEIGHT_KEYS = ("model", "network", "net")


class InferenceError(ValueError):
    """Inference cannot start: the message names the file, option or backend at fault."""


class CheckpointError(InferenceError):
    """A checkpoint cannot be used; the message names the file and what is wrong with it."""


def save_checkpoint(path: str | os.PathLike, network: torch.nn.Module, config: RecipeConfig) -> Path:
    """Write ``network``'s weights and ``config`` as an inference checkpoint (atomically); returns ``path``.

    Args:
        path: the file to write (``.pt``).
        network: the trained network (a recipe's ``network``; DDP / ``DataParallel`` unwrapped).
        config: the :class:`RecipeConfig` it was built from (``recipe.config``).

    Example:
        >>> save_checkpoint("model.pt", recipe.network, recipe.config)  # doctest: +SKIP
    """
    bare = getattr(network, "module", network)
    state = {k: v.detach().cpu() for k, v in bare.state_dict().items()}
    payload = {"format": FORMAT, "version": _VERSION, "config": config.to_dict(),
               "out_channels": int(getattr(bare, "out_channels", 2)), "model": state}
    with atomic_write(path, "wb", fsync=True) as f:
        torch.save(payload, f)
    return Path(path)


def _why(path: Path, e: Exception) -> str:
    """One line on why ``torch.load`` failed (torch's own text runs to several paragraphs)."""
    if not zipfile.is_zipfile(path):
        return "not a zip archive (damaged, truncated, or another format)"
    if "Weights only load failed" in str(e):
        return ("it holds pickled Python objects, not only tensors and plain values (a whole model saved with "
                "torch.save(model)?); save the weights with monai_fast.inference.save_checkpoint")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch/pickle/zipfile raise many types for a damaged or foreign file
        raise CheckpointError(f"checkpoint {path} cannot be read as a torch.save file: {_why(path, e)}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a dict of weights and config")
    return obj


def _weights(path: Path, obj: dict[str, Any]) -> dict[str, torch.Tensor]:
    state = next((obj[k] for k in _WEIGHT_KEYS if isinstance(obj.get(k), dict)), None)
    if state is None and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state = obj  # a bare state_dict
    if not state:
        raise CheckpointError(f"checkpoint {path} has no network weights (looked for {', '.join(map(repr, _WEIGHT_KEYS))} "
                              f"or a bare state_dict; found {sorted(obj)[:8]})")
    state = dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")  # saved from a DDP module
    return state


def _config(path: Path, obj: dict[str, Any], config: RecipeConfig | None) -> RecipeConfig:
    if config is not None:
        return config
    if "config" not in obj:
        raise CheckpointError(f"checkpoint {path} has no 'config' to rebuild the network from: write it with "
                              "monai_fast.inference.save_checkpoint, or pass config=RecipeConfig(...) of the run")
    try:
        return RecipeConfig.from_dict(dict(obj["config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its 'config' is not a RecipeConfig: {e}") from e


def load_checkpoint(
    path: str | os.PathLike, config: RecipeConfig | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, RecipeConfig]:
    """The network of an inference checkpoint, weights loaded, in eval mode on ``device``, and its config.

    Args:
        path: a file written by :func:`save_checkpoint`, or a training checkpoint holding the
            weights under ``"model"``/``"network"`` (then ``config`` is needed).
        config: the config to build the network from; default the checkpoint's own.
        device: where the network goes.

    Raises:
        CheckpointError: naming ``path``: missing, unreadable, no weights, no config, or weights
            that do not fit the network the config describes.
    """
    path = Path(path)
    obj = _read(path)
    state = _weights(path, obj)
    cfg = _config(path, obj, config)
    out_channels = obj.get("out_channels", 2)  # a training checkpoint: the recipes' two classes
    network = build_network(cfg, torch.device(device), out_channels=out_channels)
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"checkpoint {path}: its weights do not fit the UNet its config describes "
                              f"(channels {cfg.channels}, strides {cfg.strides}): {' '.join(first[:3])}") from e
    logger.info("loaded %s: UNet channels %s, %d output channels", path, cfg.channels, out_channels)
    return network.eval(), cfg
