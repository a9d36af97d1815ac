"""The size a tutorial notebook runs at: ``SIZE = "auto"`` decided from the device, in one place.

Every notebook in ``tutorials/`` has a ``SIZE`` parameter: ``"test"`` runs in about a minute on a
CPU, ``"full"`` is sized for a GPU. ``"auto"`` (the default) resolves here, from what the device
can do: ``"full"`` where the notebook trains on a CUDA GPU, ``"test"`` on a CPU, where the full
sizes take many minutes. Each notebook then maps ``"test"`` / ``"full"`` to its own presets
(`monai_fast.apps.recipes.pathology_config.SIZES`, `monai_fast.apps.demo.lab.LAB_SIZES`).

Examples:
    >>> tutorial_size("auto", "cpu")
    'test'
    >>> tutorial_size("auto", "cuda")
    'full'
    >>> tutorial_size("full", "cpu")
    'full'
"""

from __future__ import annotations

import torch

from monai_fast.telemetry import cuda_available

__all__ = ["TUTORIAL_SIZES", "tutorial_device", "tutorial_size"]

#: what a notebook's ``SIZE`` parameter accepts
TUTORIAL_SIZES = ("test", "full", "auto")


def tutorial_device() -> torch.device:
    """The device the tutorials train on: the CUDA GPU when one is usable, else the CPU."""
    return torch.device("cuda" if cuda_available() else "cpu")


def tutorial_size(size: str = "auto", device: torch.device | str | None = None) -> str:
    """``"test"`` or ``"full"``: ``size`` itself, or for ``"auto"`` the size ``device`` runs in minutes.

    Args:
        size: a notebook's ``SIZE`` parameter, one of `TUTORIAL_SIZES`.
        device: where the notebook trains; default `tutorial_device()`.

    Raises:
        ValueError: ``size`` is not one of `TUTORIAL_SIZES` (named).
    """
    if size not in TUTORIAL_SIZES:
        raise ValueError(f"SIZE must be one of {TUTORIAL_SIZES}, got {size!r}")
    if size != "auto":
        return size
    device = torch.device(device) if device is not None else tutorial_device()
    return "full" if device.type == "cuda" else "test"
