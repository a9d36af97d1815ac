"""The inference checkpoint: a recipe network's weights, the `RecipeConfig` that rebuilds it, and its chain: the
validation chain as a plain-data record (never code) that inference rebuilds.

One ``torch.save`` dict, readable with ``torch.load(..., weights_only=True)`` (docs/inference.md);
whatever is wrong with the file is one `CheckpointError` naming it, before any volume is read.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from monai.transforms import Compose, MapTransform
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.parts import build_network
from monai_fast.apps.recipes.transforms import recipe_chain, transform_of
from monai_fast.files import atomic_write

__all__ = [
    "ALLOWED",
    "FORMAT",
    "ChainError",
    "CheckpointError",
    "InferenceError",
    "LoadedModel",
    "build_chain",
    "check_chain",
    "load_checkpoint",
    "load_model",
    "read_recipe_config",
    "recipe_chain",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT = "monai-fast/model"
_VERSION = 2
#: the entries of a training checkpoint that may hold the network's weights, in the order tried
_WEIGHT_KEYS = ("model", "network", "net")


class InferenceError(ValueError):
    """Inference cannot start: the message names the file, option or backend at fault."""


class CheckpointError(InferenceError):
    """A checkpoint cannot be used; the message names the file and what is wrong with it."""


@dataclass
class LoadedModel:
    """A checkpoint's network, weights loaded, with what inference needs to run it as it was validated.

    Attributes:
        network: the network in eval mode.
        config: its `RecipeConfig` (patch size, sliding-window settings).
        chain: the validation chain record (`check_chain()`).
        chain_recorded: whether ``chain`` is the checkpoint's own record (else derived from ``config``).
    """

    network: torch.nn.Module
    config: RecipeConfig
    chain: list[dict[str, Any]]
    chain_recorded: bool


def save_checkpoint(
    path: str | os.PathLike,
    network: torch.nn.Module,
    config: RecipeConfig,
    chain: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Write ``network``'s weights, ``config`` and its validation chain as an inference checkpoint (atomically).

    Args:
        path: the file to write (``.pt``); returned.
        network: the trained network (DDP / ``DataParallel`` unwrapped).
        config: the `RecipeConfig` it was built from (``recipe.config``).
        chain: the chain record it was validated with; default `recipe_chain()` of ``config``.

    Raises:
        ChainError: ``chain`` names a transform inference cannot rebuild, before anything is written.

    Example:
        >>> save_checkpoint("model.pt", recipe.network, recipe.config)  # doctest: +SKIP
    """
    record = check_chain(list(chain) if chain is not None else recipe_chain(config))
    bare = getattr(network, "module", network)
    state = {k: v.detach().cpu() for k, v in bare.state_dict().items()}
    out_channels = int(getattr(bare, "out_channels", 2))
    payload = {"format": FORMAT, "version": _VERSION, "config": config.to_dict(), "out_channels": out_channels}
    with atomic_write(path, "wb", fsync=True) as f:
        torch.save({**payload, "chain": record, "model": state}, f)
    return Path(path)


def _why(path: Path, e: Exception) -> str:
    """One line on why ``torch.load`` failed (torch's own text runs to several paragraphs)."""
    if not zipfile.is_zipfile(path):
        return "not a zip archive (damaged, truncated, or another format)"
    if "Weights only load failed" in str(e):
        return (
            "it holds pickled Python objects, not only tensors and plain values (a whole model saved with "
            "torch.save(model)?); save the weights with monai_fast.apps.inference.save_checkpoint"
        )
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
        looked = ", ".join(map(repr, _WEIGHT_KEYS))
        raise CheckpointError(
            f"checkpoint {path} has no network weights (looked for {looked} or a bare state_dict; "
            f"found {sorted(obj)[:8]})"
        )
    state = dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")  # saved from a DDP module
    return state


def _config(path: Path, obj: dict[str, Any], config: RecipeConfig | None) -> RecipeConfig:
    if config is not None:
        return config
    if "config" not in obj:
        raise CheckpointError(
            f"checkpoint {path} holds network weights but no 'config' to rebuild the network from "
            "(a MONAI CheckpointSaver or training checkpoint?): give the RecipeConfig the network was trained with: "
            "on the command line --recipe-config FILE (the recipe.json that monai-fast train writes beside model.pth, "
            'or a JSON object of RecipeConfig options such as {"channels": [16, 32, 64, 128], "strides": [2, 2, 2], '
            '"patch_size": [96, 96, 96]}), from Python infer(..., config=RecipeConfig(...)) or '
            "load_model(path, config=RecipeConfig(...))"
        )
    try:
        return RecipeConfig.from_dict(dict(obj["config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its 'config' is not a RecipeConfig: {e}") from e


def _chain(path: Path, obj: dict[str, Any], cfg: RecipeConfig, given: bool) -> tuple[list[dict[str, Any]], bool]:
    """The checkpoint's validation chain record, or the recipes' chain for ``cfg`` when it has none."""
    if "chain" in obj:
        try:
            return check_chain(obj["chain"]), True
        except ChainError as e:
            raise CheckpointError(f"checkpoint {path}: its validation chain record cannot be rebuilt: {e}") from e
    chain = recipe_chain(cfg)
    if given:
        logger.info("checkpoint %s: preprocessing with the recipes' validation chain for the config given", path)
    else:
        logger.warning(
            "checkpoint %s holds no record of the chain its network was validated with; inference uses the "
            "recipes' validation chain for its config (%s). Write it with "
            "monai_fast.apps.inference.save_checkpoint to record the chain",
            path,
            ", ".join(t["_target_"] for t in chain),
        )
    return chain, False


def load_model(
    path: str | os.PathLike, config: RecipeConfig | None = None, device: torch.device | str = "cpu"
) -> LoadedModel:
    """The network of a checkpoint, weights loaded, in eval mode on ``device``, with its config and chain.

    Args:
        path: a file written by `save_checkpoint()`, or a training checkpoint holding the weights under
            ``"model"``/``"network"``/``"net"`` or as a bare ``state_dict`` (then ``config`` is needed).
        config: the config to build the network from; default the checkpoint's own.
        device: where the network goes.

    Raises:
        CheckpointError: naming ``path``: missing, unreadable, no weights, no config, weights that do
            not fit the network, or a chain record that cannot be rebuilt.
    """
    path = Path(path)
    obj = _read(path)
    state = _weights(path, obj)
    cfg = _config(path, obj, config)
    chain, recorded = _chain(path, obj, cfg, given=config is not None)
    out_channels = obj.get("out_channels", 2)  # a training checkpoint: the recipes' two classes
    network = build_network(cfg, torch.device(device), out_channels=out_channels)
    try:
        network.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {path}: its weights do not fit the UNet its config describes "
            f"(channels {cfg.channels}, strides {cfg.strides}): {' '.join(first[:3])}"
        ) from e
    logger.info("loaded %s: UNet channels %s, %d output channels", path, cfg.channels, out_channels)
    return LoadedModel(network.eval(), cfg, chain, recorded)


def load_checkpoint(
    path: str | os.PathLike, config: RecipeConfig | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, RecipeConfig]:
    """`load_model()`'s network and config, without the chain; the same arguments and errors."""
    model = load_model(path, config=config, device=device)
    return model.network, model.config


def read_recipe_config(path: str | os.PathLike) -> RecipeConfig:
    """The `RecipeConfig` in a JSON file: ``monai-fast train``'s ``recipe.json``, or a JSON object of options.

    Raises:
        InferenceError: naming ``path``: missing, not JSON, or options RecipeConfig rejects (named).
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise InferenceError(f"recipe config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InferenceError(f"recipe config {path} cannot be read as JSON: {e}") from e
    if isinstance(obj, dict) and isinstance(obj.get("config"), dict):
        obj = obj["config"]
    if not isinstance(obj, dict):
        raise InferenceError(
            f"recipe config {path} holds a {type(obj).__name__}, not a JSON object of RecipeConfig options"
        )
    try:
        return RecipeConfig.from_dict(obj)
    except (TypeError, ValueError) as e:
        raise InferenceError(f"recipe config {path}: {e}") from e


#: the MONAI dictionary transforms a chain record may name: deterministic preprocessing, invertible where it
#: changes the grid, so that ``Invertd`` takes a prediction back onto the input's grid
ALLOWED = frozenset(
    {
        "LoadImaged",
        "EnsureChannelFirstd",
        "Orientationd",
        "Spacingd",
        "ScaleIntensityRanged",
        "ScaleIntensityd",
        "NormalizeIntensityd",
        "ClipIntensityPercentilesd",
        "CropForegroundd",
        "SpatialPadd",
        "DivisiblePadd",
        "CenterSpatialCropd",
        "ResizeWithPadOrCropd",
        "Resized",
    }
)
_PLAIN = (str, int, float, bool, type(None))


class ChainError(ValueError):
    """A chain record that cannot be rebuilt; the message names the entry and what is wrong with it."""


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def check_chain(record: Any) -> list[dict[str, Any]]:
    """``record`` as a list of transform entries, each naming an `ALLOWED` transform with plain arguments.

    Raises:
        ChainError: naming the first entry at fault.
    """
    if not isinstance(record, (list, tuple)) or not record:
        raise ChainError(f"the chain record is not a list of transforms (got {type(record).__name__})")
    entries = []
    for i, entry in enumerate(record):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("_target_"), str):
            raise ChainError(f"chain entry {i} is not a mapping with a '_target_' transform name: {entry!r:.120}")
        name = entry["_target_"]
        if name not in ALLOWED:
            raise ChainError(
                f"chain entry {i} names {name!r}, which is not one of the deterministic MONAI transforms "
                f"inference rebuilds ({', '.join(sorted(ALLOWED))})"
            )
        bad = [k for k, v in entry.items() if not isinstance(k, str) or not _plain(v)]
        if bad:
            raise ChainError(f"chain entry {i} ({name}): argument(s) {bad} are not plain values (text, numbers, lists)")
        entries.append(dict(entry))
    return entries


def build_chain(record: Sequence[Mapping[str, Any]], image_key: str = "image") -> Compose:
    """The transforms of ``record``, each with ``allow_missing_keys=True`` (the label is missing at inference).

    Raises:
        ChainError: a record entry that is not allowed, not plain, or not accepted by its transform;
            or a record whose transforms never touch ``image_key``.
    """
    entries = check_chain(record)
    transforms: list[MapTransform] = []
    for i, entry in enumerate(entries):
        try:
            transforms.append(transform_of(entry, allow_missing_keys=True))
        except (TypeError, ValueError) as e:
            name, args = entry["_target_"], {k: v for k, v in entry.items() if k != "_target_"}
            raise ChainError(f"chain entry {i} ({name}) cannot be built from its arguments {args}: {e}") from e
    if not any(image_key in t.keys for t in transforms):
        raise ChainError(
            f"no transform of the chain record acts on {image_key!r} (keys: "
            f"{sorted({k for t in transforms for k in t.keys})})"
        )
    return Compose(transforms)
