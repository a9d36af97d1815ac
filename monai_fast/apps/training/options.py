"""The checks a training run's options share: the error that names an option, the device, output folders, the recipe."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from monai_fast.apps.recipes import RecipeConfig

__all__ = ["OptionError", "check_writable_dir", "recipe_config", "resolve_device"]


class OptionError(ValueError):
    """An option of a run is invalid; ``option`` names it (a field name, dotted for nested ones; the CLI's flag).

    Example:
        >>> str(OptionError("target", "must be in (0, 1], got 2"))
        'target: must be in (0, 1], got 2'
    """

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.message = message


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` or ``"cpu"``; a bad name, or a CUDA name on a build without CUDA, raises
    `OptionError` naming ``device``."""
    import torch

    from monai_fast.telemetry import cuda_available

    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    try:
        torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise OptionError("device", f"{name!r} is not a device name ({e}); use auto, cpu, cuda or cuda:N") from None
    if name.startswith("cuda") and not cuda_available():
        raise OptionError("device", f"{name}: this torch build sees no CUDA device (use cpu)")
    return name


def check_writable_dir(path: str | os.PathLike, option: str) -> Path:
    """Create ``path`` (and parents) and write a scratch file there; if either fails, `OptionError` names ``option``."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OptionError(option, f"cannot write into {path}: {e.strerror or e}") from e
    return path


def recipe_config(overrides: Mapping[str, Any], seed: int) -> RecipeConfig:
    """The `RecipeConfig` of ``overrides`` with ``seed``; a bad or unknown field raises `OptionError` (overrides)."""
    known = {f.name for f in fields(RecipeConfig)} - {"seed"}
    if unknown := sorted(set(overrides) - known):
        raise OptionError(
            "overrides",
            f"unknown recipe option(s) {unknown} (the seed is set by seed/train_seed); known: {sorted(known)}",
        )
    try:
        return RecipeConfig(**{**overrides, "seed": seed})
    except (TypeError, ValueError) as e:
        raise OptionError("overrides", str(e)) from e


def check_run_numbers(target: float, time_budget_s: float | None, val_fraction: float) -> None:
    """The target Dice in (0, 1], a time budget > 0 (or ``None``), the validation share in (0, 1); else `OptionError`
    naming the first bad one."""
    if not 0.0 < target <= 1.0:
        raise OptionError("target", f"must be in (0, 1], got {target}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise OptionError("time_budget_s", f"must be > 0 (or None for no limit), got {time_budget_s}")
    if not 0.0 < val_fraction < 1.0:
        raise OptionError("val_fraction", f"must be in (0, 1), got {val_fraction}")


def check_synthetic(kind: str, cases: int, shape: tuple[int, ...]) -> None:
    """A synthetic set that can be generated: a known kind, at least one case, three sizes of at least 8; else
    `OptionError` naming ``synthetic.kind``, ``synthetic.cases`` or ``synthetic.shape``."""
    from monai_fast.apps.sources.synthetic import KINDS

    if kind not in KINDS:
        raise OptionError("synthetic.kind", f"must be one of {KINDS}, got {kind!r}")
    if cases < 1:
        raise OptionError("synthetic.cases", f"must be >= 1, got {cases}")
    if len(shape) != 3 or min(shape) < 8:
        raise OptionError("synthetic.shape", f"must be three sizes >= 8, got {tuple(shape)}")


def check_precision(config: RecipeConfig, device: str) -> None:
    """fp16 only on a CUDA device (bf16, fp32 and the automatic choice run anywhere); else `OptionError` naming
    ``precision``."""
    if config.precision == "fp16" and not str(device).startswith("cuda"):
        raise OptionError("precision", f"'fp16' runs on a CUDA device only, not on {device}: use auto, bf16 or fp32")
