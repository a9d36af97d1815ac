"""A fast check of a data list (volumes, or a whole-slide patch list) before training: every bad file named at
once, with its reason (docs/data.md, docs/pathology.md)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging.handlers import BufferingHandler
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from monai_fast.extras import MissingExtraError, require
from monai_fast.files import write_json
from monai_fast.folders import cache_root

__all__ = [
    "PreflightError",
    "PreflightReport",
    "patch_padding",
    "preflight",
    "preflight_wsi",
    "scan_file",
    "scan_slide",
]

logger = logging.getLogger(__name__)

#: stored scans carry this version; a change in what a scan holds makes old entries unused
SCAN_VERSION = 1
_MAX_VALUES = 64  # distinct values kept for a label; more than this is not a label map
SCANS_LOCK = threading.Lock()  #: one check at a time reads and writes the store in this process
_LOCATIONS_NAMED = 5  # bad patch locations named per slide; the rest of that slide's are counted


def shape_mismatch(image: str, image_shape: tuple[int, ...], label: str, label_shape: tuple[int, ...]) -> str | None:
    """Why ``image`` and ``label`` do not fit together by their spatial (first three) sizes; ``None`` if they do."""
    if tuple(image_shape[:3]) == tuple(label_shape[:3]):
        return None
    return (
        f"image {image} has spatial shape {tuple(image_shape[:3])} but its label {label} has {tuple(label_shape[:3])}"
    )


class PreflightError(ValueError):
    """The data list has bad files; the message lists every one with its reason (``problems`` too)."""

    def __init__(
        self, problems: Sequence[tuple[str, str]], checked: int, skip: str = "--no-preflight skips this check"
    ) -> None:
        self.problems = list(problems)
        lines = [f"  {path}: {reason}" for path, reason in self.problems]
        super().__init__(
            f"preflight found {len(self.problems)} problem(s) in {checked} item(s) "
            f"(fix or remove them; {skip}):\n" + "\n".join(lines)
        )


@dataclass
class PreflightReport:
    """What `preflight()` found: items ``checked``, files ``read`` now or taken ``from_cache``, the wall time in
    ``seconds``, and ``(path, reason)`` for every file at fault in ``problems``."""

    checked: int
    from_cache: int
    read: int
    seconds: float
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def scan_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read one volume once and summarise it: shape, finite, integer-valued, value range, distinct values.

    An unreadable file gives ``{"error": "EOFError: ..."}``.
    """
    try:
        arr = np.asanyarray(nib.load(str(path)).dataobj)
    except Exception as e:  # nibabel, gzip and numpy raise many types for a damaged file
        return {"error": f"{type(e).__name__}: {e}"}
    scan: dict[str, Any] = {"shape": [int(s) for s in arr.shape]}
    if arr.size == 0:
        return {**scan, "finite": True, "integer": True, "values": []}
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool:
        finite, integer = True, True
    else:
        finite = bool(np.isfinite(arr).all())
        integer = finite and bool(np.all(arr == np.round(arr)))
    scan.update(finite=finite, integer=integer)
    if finite:
        lo, hi = arr.min(), arr.max()
        scan.update(min=float(lo), max=float(hi))
        if integer and hi - lo < 4096:
            counts = np.bincount((arr.ravel() - lo).astype(np.int64), minlength=1)
            values = (np.flatnonzero(counts) + lo).tolist()
            scan["values"] = [int(v) for v in values[: _MAX_VALUES + 1]]
    return scan


def _problems(image: str, label: str, img: dict, lab: dict, num_classes: int) -> list[tuple[str, str]]:
    out = []
    for path, scan, what in ((image, img, "image"), (label, lab, "label")):
        if "error" in scan:
            out.append((path, f"cannot read the {what}: {scan['error']}"))
        elif len(scan["shape"]) < 3 or min(scan["shape"][:3]) < 2:
            out.append((path, f"{what} is not a 3D volume (shape {tuple(scan['shape'])})"))
    if out:
        return out
    if not img["finite"]:
        out.append((image, "image has NaN or Inf values"))
    if not lab["integer"]:
        out.append((label, "label has non-integer or non-finite values; a label map holds class numbers"))
    else:
        values, classes = lab.get("values"), f"the {num_classes} classes 0..{num_classes - 1}"
        bad = [v for v in values if not 0 <= v < num_classes] if values is not None else None
        if bad is None or len(values) > _MAX_VALUES:
            out.append((label, f"label values span {lab['min']:g}..{lab['max']:g}, not {classes}"))
        elif bad:
            out.append((label, f"label values {sorted(values)} outside {classes}"))
    mismatch = shape_mismatch(image, tuple(img["shape"]), label, tuple(lab["shape"]))
    if mismatch:
        out.append((image, mismatch))
    return out


class ScanStore:
    """The stored scans of one check, by file identity; ``came`` counts ``"missing"``, ``"stored"``, ``"read"``."""

    def __init__(self, scans: dict[str, dict]) -> None:
        self.scans, self.came = scans, Counter[str]()

    def scan(self, path: str, scan: Callable[[str], dict], prefix: str = "", keep_failed: bool = True) -> dict:
        """``path``'s stored scan, else ``scan(path)``, stored unless it failed and not ``keep_failed``."""
        if not os.path.isfile(path):
            self.came["missing"] += 1
            return {"error": "no such file"}
        st = os.stat(path)
        key = f"{prefix}{SCAN_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
        if key in self.scans:
            self.came["stored"] += 1
            return self.scans[key]
        found = scan(path)
        if keep_failed or "error" not in found:
            self.scans[key] = found
        self.came["read"] += 1
        return found


@contextmanager
def scan_store(cache: bool, cache_path: str | os.PathLike | None) -> Iterator[ScanStore]:
    """The scans stored at ``cache_path`` (default ``cache_root()/preflight.json``; none unless ``cache``), one
    check at a time, saved back when the check read a file; a missing, damaged or unwritable store costs re-reads."""
    path = Path(cache_path) if cache_path is not None else cache_root() / "preflight.json"
    with SCANS_LOCK:
        scans: Any = {}
        if cache:
            try:
                scans = json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        store = ScanStore(scans if isinstance(scans, dict) else {})
        yield store
        if cache and store.came["read"]:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(store.scans, path, indent=None)
            except OSError as err:
                logger.warning(
                    "preflight: the check cache %s could not be written (%s); the next run reads the files again",
                    path,
                    err,
                )


def preflight(
    files: Sequence[dict],
    num_classes: int = 2,
    keys: tuple[str, str] = ("image", "label"),
    cache: bool = True,
    cache_path: str | os.PathLike | None = None,
    raise_error: bool = True,
) -> PreflightReport:
    """Check every item of ``files`` before training; raise one error listing every bad file.

    Files are unreadable, 2D, NaN/Inf in an image, label values non-integer or outside
    ``num_classes``, or image and label shapes that differ.

    Args:
        files: ``{"image": path, "label": path}`` dicts (both lists of a race, joined).
        num_classes: classes of the task, background included; label values must be in ``0..num_classes-1``.
        keys: the image key and the label key of each item.
        cache: reuse and store scans by file identity (path, size, modification time).
        cache_path: the scans' JSON file; default ``cache_root()/preflight.json``.
        raise_error: raise `PreflightError` when a file is at fault (else only report it).

    Raises:
        PreflightError: listing every ``(path, reason)``, when ``raise_error`` and any file is at fault.
        ValueError: ``num_classes`` < 2 or an item without both keys.

    Examples:
        >>> preflight(train_files + val_files, num_classes=2).ok  # doctest: +SKIP
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2 (background and one class), got {num_classes}")
    t0 = time.perf_counter()
    image_key, label_key = keys
    for i, item in enumerate(files):
        if not isinstance(item, dict) or image_key not in item or label_key not in item:
            raise ValueError(f"files[{i}] must have {image_key!r} and {label_key!r}, got {item!r}")
    with scan_store(cache, cache_path) as store:
        scans: dict[str, dict] = {}
        problems: list[tuple[str, str]] = []
        for item in files:
            image, label = str(item[image_key]), str(item[label_key])
            for path in (image, label):
                if path not in scans:
                    scans[path] = store.scan(path, scan_file)
            problems += _problems(image, label, scans[image], scans[label], num_classes)
    report = PreflightReport(len(files), store.came["stored"], store.came["read"], time.perf_counter() - t0, problems)
    logger.info(
        "preflight: %d items, %d files read, %d from the cache, %d problem(s) in %.1f s",
        report.checked,
        report.read,
        report.from_cache,
        len(problems),
        report.seconds,
    )
    if problems and raise_error:
        raise PreflightError(problems, len(files))
    return report


def patch_padding(
    files: Sequence[dict], patch_size: Sequence[int], pixdim: Sequence[float], key: str = "image"
) -> str | None:
    """A warning when ``patch_size`` is larger than volumes after resampling to ``pixdim`` (RAS axes); else ``None``.

    Such items are padded up to the patch on every load. Reads headers only.
    """
    worst, where, n = [0, 0, 0], "", 0
    for item in files:
        try:
            header = nib.load(str(item[key])).header
            affine = header.get_best_affine()
        except Exception:  # an unreadable file is preflight's to report
            continue
        shape, zooms = header.get_data_shape()[:3], header.get_zooms()[:3]
        ras = nib.orientations.io_orientation(affine)  # input axis i -> RAS axis ras[i, 0]
        size = [0, 0, 0]
        for i in range(min(3, len(shape))):
            axis = int(ras[i, 0]) if not np.isnan(ras[i, 0]) else i
            size[axis] = int(round(shape[i] * float(zooms[i]) / float(pixdim[axis])))
        pad = [max(0, int(p) - s) for p, s in zip(patch_size, size)]
        if any(pad):
            n += 1
            if sum(pad) > sum(worst):
                worst, where = pad, f"{item[key]} is {tuple(size)}"
    if not n:
        return None
    return (
        f"patch_size {tuple(patch_size)} is larger than {n} of {len(files)} volumes after resampling to pixdim "
        f"{tuple(pixdim)} (e.g. {where}): each such item is padded on every load, by up to {tuple(worst)} voxels; "
        "use a smaller --patch-size"
    )


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
    checked = sum(len(items) for items in lists.values())
    report = PreflightReport(checked, store.came["stored"], store.came["read"], time.perf_counter() - t0, problems)
    logger.info(
        "preflight (WSI): %d patches on %d slide(s), %d read, %d from the cache, %d problem(s) in %.1f s",
        checked,
        len(scans),
        report.read,
        report.from_cache,
        len(problems),
        report.seconds,
    )
    if problems and raise_error:
        raise PreflightError(problems, checked, skip="preflight=False skips this check")
    return report
