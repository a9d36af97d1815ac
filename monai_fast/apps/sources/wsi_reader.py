"""Whole-slide image readers: the backend chosen by what is installed, and a tile-aware tifffile reader.

A backend whose package or hardware is missing is one `WSIBackendError` naming what to install.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from monai.data.wsi_reader import BaseWSIReader, TiffFileWSIReader, WSIReader

from monai_fast.extras import available
from monai_fast.telemetry import cuda_available

__all__ = ["BACKENDS", "TiledTiffWSIReader", "WSIBackend", "WSIBackendError", "choose_wsi_backend"]

logger = logging.getLogger(__name__)

#: what ``choose_wsi_backend`` accepts
BACKENDS = ("auto", "cucim", "openslide", "tifffile", "tifffile-monai")
_PACKAGES = {
    "cucim": ("cucim", "pip install cucim-cu12 on a CUDA 12 machine"),
    "openslide": ("openslide", "pip install openslide-python openslide-bin"),
    "tifffile": ("tifffile", 'pip install "monai-fast[wsi]"'),
}


class WSIBackendError(RuntimeError):
    """A WSI backend that cannot run here: the message names the missing package or hardware."""


class TiledTiffWSIReader(TiffFileWSIReader):
    """MONAI's ``TiffFileWSIReader`` that reads and decodes only the tiles a patch overlaps.

    Strip-stored levels fall back to MONAI's whole-level read; reads of one slide take turns across
    threads. A patch outside the level or a tile cut short by the end of the file is a `ValueError`
    naming the slide: a patch is never zero-padded.

    Examples:
        >>> patch, meta = TiledTiffWSIReader().get_data(wsi, location=(1024, 2048), size=(224, 224))  # doctest: +SKIP
    """

    backend = "tifffile"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._locks: dict[int, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, wsi: Any) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(id(wsi), threading.Lock())

    def _region(self, wsi: Any, level: int, top: int, left: int, size: tuple[int, int]) -> np.ndarray:
        """Rows ``top..top+size[0]``, columns ``left..left+size[1]`` of ``level``; outside or short: `ValueError`."""
        page = wsi.pages[level]
        th, tw = page.tilelength, page.tilewidth
        h, w = page.imagelength, page.imagewidth
        fh = wsi.filehandle
        if top < 0 or left < 0 or top + size[0] > h or left + size[1] > w:
            raise ValueError(
                f"{fh.path}: the {size[0]} x {size[1]} patch at row {top}, column {left} of level "
                f"{level} reaches outside the level's {h} x {w} pixels"
            )
        across = -(-w // tw)
        out = np.empty((size[0], size[1], page.samplesperpixel), dtype=page.dtype)
        bottom, right = top + size[0], left + size[1]
        for tr in range(top // th, -(-bottom // th)):
            for tc in range(left // tw, -(-right // tw)):
                index = tr * across + tc
                with self._lock(wsi):
                    fh.seek(page.dataoffsets[index])
                    data = fh.read(page.databytecounts[index])
                if len(data) != page.databytecounts[index]:
                    raise ValueError(
                        f"{fh.path}: tile {index} of level {level} has {len(data)} of its "
                        f"{page.databytecounts[index]} bytes: the file is truncated"
                    )
                tile = page.decode(data, index, jpegtables=page.jpegtables)[0].reshape(th, tw, -1)
                r0, c0 = tr * th, tc * tw
                rs, cs = max(top, r0), max(left, c0)
                re, ce = min(bottom, r0 + th), min(right, c0 + tw)
                out[rs - top : re - top, cs - left : ce - left] = tile[rs - r0 : re - r0, cs - c0 : ce - c0]
        return out

    def _get_patch(
        self, wsi: Any, location: tuple[int, int], size: tuple[int, int], level: int, dtype: Any, mode: str
    ) -> np.ndarray:
        page = wsi.pages[level]
        if not page.is_tiled:
            return super()._get_patch(wsi, location, size, level, dtype, mode)
        ratio = self.get_downsample_ratio(wsi=wsi, level=level)
        top, left = (round(location[i] / ratio) for i in range(2))
        patch = self._region(wsi, level, top, left, tuple(size)).astype(dtype, copy=False)
        if mode in "RGB":
            if patch.shape[-1] not in (3, 4):
                raise ValueError(
                    f"The image is expected to have three or four color channels in '{mode}' mode "
                    f"but has {patch.shape[-1]}."
                )
            patch = patch[..., :3]
        return np.moveaxis(patch, -1, self.channel_dim)


@dataclass(frozen=True)
class WSIBackend:
    """A chosen WSI backend: its ``name``, ``why`` it was chosen, and ``make(**kwargs)`` for a MONAI reader."""

    name: str
    why: str
    make: Callable[..., BaseWSIReader]


def _missing(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (the package or hardware missing), or None."""
    module, how = _PACKAGES["tifffile" if name.startswith("tifffile") else name]
    if not available(module):
        return f"{module} not installed ({how})"
    if name == "cucim" and (device.type != "cuda" or not cuda_available()):
        return f"cuCIM needs a CUDA GPU and this run is on {device}"
    return None


def _make(name: str) -> Callable[..., BaseWSIReader]:
    if name == "tifffile":
        return TiledTiffWSIReader
    return partial(WSIReader, backend="tifffile" if name == "tifffile-monai" else name)


def choose_wsi_backend(requested: str = "auto", device: torch.device | str = "cpu", quiet: bool = False) -> WSIBackend:
    """The WSI backend for ``device``: ``requested`` if it can run; ``"auto"``: cuCIM on CUDA, OpenSlide, tifffile.

    ``"tifffile"`` is `TiledTiffWSIReader`; ``"tifffile-monai"`` is MONAI's own ``TiffFileWSIReader``.
    ``quiet`` logs the choice at DEBUG level only.

    Raises:
        ValueError: for a name not in `BACKENDS`.
        WSIBackendError: when ``requested`` needs a package or a GPU that is missing (named).
    """
    if requested not in BACKENDS:
        raise ValueError(f"WSI backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested != "auto":
        why = _missing(requested, device)
        if why is not None:
            raise WSIBackendError(f"WSI backend {requested!r} cannot run here: {why}")
        return WSIBackend(requested, "requested", _make(requested))
    skipped = []
    for name in ("cucim", "openslide", "tifffile"):
        why = _missing(name, device)
        if why is None:
            reason = f"chosen for {device}" + (f" ({'; '.join(skipped)})" if skipped else "")
            logger.log(logging.DEBUG if quiet else logging.INFO, "WSI backend: %s, %s", name, reason)
            return WSIBackend(name, reason, _make(name))
        skipped.append(f"not {name}: {why}")
    raise WSIBackendError("no WSI backend can run here: " + "; ".join(skipped))
