"""A fast check of a whole-slide patch list before training: every bad slide and patch named at once.

Slide scans share the store of `monai_fast.data.preflight`; see docs/pathology.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from logging.handlers import BufferingHandler
from typing import Any

from monai_fast.data.preflight import PreflightError, PreflightReport, scan_store
from monai_fast.extras import MissingExtraError, require

__all__ = ["preflight_wsi", "scan_slide"]

logger = logging.getLogger(__name__)

_LOCATIONS_NAMED = 5  # bad patch locations named per slide; the rest of that slide's are counted


def scan_slide(path: str | os.PathLike, reader: Any = None) -> dict[str, Any]:
    """The level sizes of a whole-slide image, after checking that every level can be read to its end.

    A TIFF slide is checked with ``tifffile`` (every tile inside the file, each page's last tile decodes);
    another format is opened with ``reader`` (a MONAI WSI reader).

    Returns:
        ``{"levels": [[rows, columns], ...]}`` (level 0 first), or ``{"error": "..."}``.

    Raises:
        MissingExtraError: a TIFF slide without ``tifffile`` (the ``wsi`` extra).
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            tiff = f.read(4) in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")
        if not tiff:
            if reader is None:
                return {"error": "not a TIFF file, and no WSI reader was given to open it"}
            wsi = reader.read(path)
            levels = range(reader.get_level_count(wsi))
            return {"levels": [[int(v) for v in reader.get_size(wsi, level)] for level in levels]}
        tifffile = require("tifffile", extra="wsi", feature=f"reading the slide {path}")
        # tifffile reports damage by logging it: what it logs at WARNING or above, kept (never flushed)
        capture, tiff_logger = BufferingHandler(sys.maxsize), logging.getLogger("tifffile")
        capture.setLevel(logging.WARNING)
        tiff_logger.addHandler(capture)
        try:
            with tifffile.TiffFile(path) as tif:
                end = os.path.getsize(path)
                levels = []
                for level, page in enumerate(tif.pages):
                    offsets, counts = page.dataoffsets, page.databytecounts
                    for i, (offset, count) in enumerate(zip(offsets, counts)):
                        if count == 0 or offset + count > end:
                            return {
                                "error": f"level {level} is cut short: its part {i} of {len(offsets)} lies at "
                                f"bytes {offset}..{offset + count} of a {end}-byte file (truncated?)"
                            }
                    if offsets:
                        tif.filehandle.seek(offsets[-1])
                        page.decode(tif.filehandle.read(counts[-1]), len(offsets) - 1, jpegtables=page.jpegtables)
                    levels.append([int(page.imagelength), int(page.imagewidth)])
        finally:
            tiff_logger.removeHandler(capture)
        if capture.buffer:
            return {"error": f"tifffile reports a damaged file: {capture.buffer[0].getMessage()}"}
        if not levels:
            return {"error": "the file holds no image"}
        return {"levels": levels}
    except MissingExtraError:
        raise  # not a damaged slide: the one line that installs the reader
    except Exception as e:  # tifffile, the codecs and the WSI backends raise many types for a damaged file
        return {"error": f"{type(e).__name__}: {e}"}


def _patch_problem(
    levels: list[list[int]], location: Sequence[int], size: tuple[int, int], level: int, center: bool
) -> str | None:
    """Why the patch, located as ``PatchWSIDataset`` does, cannot be read whole from the slide; else ``None``."""
    if not 0 <= level < len(levels):
        return f"patch level {level}, but the slide has {len(levels)} level(s)"
    h0, w0 = levels[0]
    h, w = levels[level]
    if h < size[0] or w < size[1]:
        return (
            f"the slide is {h} x {w} pixels at level {level}, smaller than the {size[0]} x {size[1]} patch "
            "(it would be padded)"
        )
    start = [int(location[i]) - (size[i] // 2 if center else 0) for i in range(2)]
    top, left = (round(start[i] / (levels[0][i] / levels[level][i])) for i in range(2))
    if top < 0 or left < 0 or top + size[0] > h or left + size[1] > w:
        where = tuple(int(v) for v in location)
        return (
            f"the {size[0]} x {size[1]} patch at location {where} (rows {top}..{top + size[0]}, "
            f"columns {left}..{left + size[1]} at level {level}) reaches outside the slide's {h} x {w} pixels"
            + (f" (level 0: {h0} x {w0})" if level else "")
        )
    return None


def preflight_wsi(
    files: Sequence[dict] | dict[str, Sequence[dict]],
    patch_size: int | Sequence[int],
    level: int = 0,
    center_location: bool = True,
    reader: Any = None,
    cache: bool = True,
    cache_path: str | os.PathLike | None = None,
    raise_error: bool = True,
) -> PreflightReport:
    """Check a whole-slide patch list before training: every slide readable, every patch inside its slide.

    Patches are located as MONAI's ``PatchWSIDataset`` locates them; slide scans are cached like `preflight()`'s.
    The report counts items in ``checked``, slides in ``read`` and ``from_cache``.

    Args:
        files: ``{"image", "location"}`` items (an item's ``"patch_size"`` / ``"patch_level"`` override the
            defaults), or a mapping of list names to such lists, so problems name the list.
        patch_size: patch side, or (rows, columns), at ``level``.
        level: the pyramid level patches are read at.
        center_location: ``location`` is the patch's centre (MONAI's default) rather than its top-left.
        reader: a MONAI WSI reader for slides that are not TIFF files.
        cache: reuse and store slide scans by file identity (path, size, modification time).
        cache_path: the scans' JSON file; default ``cache_root()/preflight.json``.
        raise_error: raise `PreflightError` when anything is at fault (else only report it).

    Raises:
        PreflightError: every slide at fault, and up to five bad locations per slide with a count of the rest.
        ValueError: an item without ``"image"`` or ``"location"``.
        MissingExtraError: a TIFF slide without ``tifffile`` (the ``wsi`` extra).

    Examples:
        >>> preflight_wsi({"training": train, "validation": val}, patch_size=96).ok  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    lists = dict(files) if isinstance(files, dict) else {"items": files}
    default_size = tuple(int(v) for v in (patch_size if isinstance(patch_size, Sequence) else (patch_size, patch_size)))
    for name, items in lists.items():
        for i, item in enumerate(items):
            if not isinstance(item, dict) or "image" not in item or "location" not in item:
                raise ValueError(f"{name}[{i}] must have 'image' and 'location', got {item!r}")
    problems: list[tuple[str, str]] = []
    with scan_store(cache, cache_path) as store:
        scans: dict[str, dict] = {}
        bad: dict[str, list[str]] = {}
        for name, items in lists.items():
            for i, item in enumerate(items):
                path = str(item["image"])
                if path not in scans:  # a damaged slide is not stored: it may be rewritten
                    scans[path] = store.scan(path, lambda p: scan_slide(p, reader), "wsi|", keep_failed=False)
                    if "error" in scans[path]:
                        problems.append((path, f"cannot read the slide: {scans[path]['error']}"))
                if "error" in scans[path]:
                    continue
                size = item.get("patch_size", default_size)
                size = tuple(int(v) for v in (size if isinstance(size, Sequence) else (size, size)))
                why = _patch_problem(
                    scans[path]["levels"], item["location"], size, int(item.get("patch_level", level)), center_location
                )
                if why is not None:
                    bad.setdefault(path, []).append(f"{name}[{i}]: {why}")
    for path, reasons in bad.items():
        problems += [(path, r) for r in reasons[:_LOCATIONS_NAMED]]
        if len(reasons) > _LOCATIONS_NAMED:
            more = len(reasons) - _LOCATIONS_NAMED
            problems.append((path, f"... and {more} more patch(es) of this slide at fault"))
    read, hits = store.came["read"], store.came["stored"]
    checked = sum(len(items) for items in lists.values())
    report = PreflightReport(checked, hits, read, time.perf_counter() - t0, problems)
    logger.info(
        "preflight (WSI): %d patches on %d slide(s), %d read, %d from the cache, %d problem(s) in %.1f s",
        checked,
        len(scans),
        read,
        hits,
        len(problems),
        report.seconds,
    )
    if problems and raise_error:
        raise PreflightError(problems, checked, skip="preflight=False skips this check")
    return report
