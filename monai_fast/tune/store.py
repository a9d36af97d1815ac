"""A small JSON file of tuning results and measured times, keyed by device, memory, model and shapes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ignite import distributed as idist

from monai_fast.files import NoSpaceError, write_json
from monai_fast.folders import cache_root
from monai_fast.tune.result import TuneResult

__all__ = ["TuneStore", "default_store_path"]

logger = logging.getLogger("monai_fast.tune")


def default_store_path() -> Path:
    """``tuning.json`` in monai-fast's cache folder (`monai_fast.folders.cache_root()`)."""
    return cache_root() / "tuning.json"


class TuneStore:
    """Tuning results and measured times on disk, so a second run on the same machine and model tunes nothing.

    Rank 0 writes, atomically. A damaged file is set aside with a warning; a full file system keeps the
    file as it was, with a warning (the next run tunes again).

    Args:
        path: the JSON file (created on first ``put``).

    Examples:
        >>> TuneStore("/tmp/monai-fast-doctest-tune.json").get("no such key") is None
        True
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _load(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")  # noqa: TRY004 - handled just below
            return data
        except (OSError, ValueError) as exc:
            aside = self.path.with_suffix(self.path.suffix + ".damaged")
            logger.warning("tuning cache %s is unreadable (%s); moved to %s and ignored", self.path, exc, aside)
            if idist.get_rank() == 0:
                os.replace(self.path, aside)
            return {}

    def get(self, key: str) -> TuneResult | None:
        """The stored result for ``key``, or ``None``."""
        entry = self._load().get(key)
        if entry is None:
            return None
        try:
            result = TuneResult.from_dict(entry)
        except TypeError as exc:
            logger.warning("tuning cache %s: entry for this key has an old layout (%s); tuning again", self.path, exc)
            return None
        result.from_cache = True
        return result

    def put(self, result: TuneResult) -> None:
        """Store ``result`` under its key (rank 0 writes; other ranks return)."""
        self._write(result.key, result.to_dict())

    def seconds(self, key: str) -> float | None:
        """The seconds measured here for ``key`` (kept by `put_seconds`), or ``None``."""
        value = self._load().get(key)
        return float(value) if isinstance(value, (int, float)) and value >= 0 else None

    def put_seconds(self, key: str, seconds: float) -> None:
        """Keep ``seconds`` measured for ``key`` (a compile time) for later runs (rank 0 writes)."""
        self._write(key, round(seconds, 3))

    def _write(self, key: str, value: object) -> None:
        if idist.get_rank() != 0:
            return
        data = self._load()
        data[key] = value
        try:
            write_json(data, self.path, indent=1, fsync=True, sort_keys=True)
        except NoSpaceError as err:  # the result stands; only its reuse by a later run is lost
            logger.warning("tuning cache not updated: %s", err)
