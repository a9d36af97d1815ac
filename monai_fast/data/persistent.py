"""A disk cache you can trust: ``PersistentDataset`` keyed on what the result depends on (docs/data.md)."""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any, Literal

import torch
from monai.data import PersistentDataset
from monai.data.utils import SUPPORTED_PICKLE_MOD
from monai.utils import convert_to_tensor, look_up_option

from monai_fast.data.fingerprint import ItemKeys, chain_key, first_random
from monai_fast.files import NoSpaceError, atomic_write, clean_stale_tmp

__all__ = ["TrustedPersistentDataset"]

logger = logging.getLogger("monai_fast.data")


class TrustedPersistentDataset(PersistentDataset):
    """``PersistentDataset`` keyed on file identity and transform parameters, with atomic writes.

    Damaged files are rebuilt; a full disk is named once, the remaining items then computed in memory.

    Args:
        data: items, e.g. ``{"image": path, "label": path}``.
        transform: the chain; everything before the first random transform is cached.
        cache_dir: the cache folder (created).
        identity: ``"stat"`` (size + mtime, default) or ``"content"`` (SHA-1 of the bytes).
        kwargs: passed to ``PersistentDataset`` (not ``hash_func`` / ``hash_transform``).

    Attributes:
        disk_full: the `NoSpaceError` naming the folder once it filled up (items no longer written), else ``None``.

    Examples:
        >>> ds = TrustedPersistentDataset(train_files, transforms, cache_dir="/scratch/cache")  # doctest: +SKIP
    """

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable,
        cache_dir: str | os.PathLike,
        identity: Literal["stat", "content"] = "stat",
        **kwargs: Any,
    ) -> None:
        self._item_key = ItemKeys(identity)  # refuses an unknown identity
        for bad in ("hash_func", "hash_transform"):
            if bad in kwargs:
                raise ValueError(f"{bad} is set by TrustedPersistentDataset; do not pass it")
        if cache_dir is None:
            raise ValueError("cache_dir is required (use CacheDataset for an in-memory cache)")
        self.identity = identity
        self.disk_full: NoSpaceError | None = None
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(cache_dir)  # leftovers of killed writers, once per data set
        super().__init__(data=data, transform=transform, cache_dir=cache_dir, hash_func=self._item_key, **kwargs)
        flat = self.transform.flatten().transforms
        deterministic = flat[: first_random(flat)]
        self.transform_hash, self.trusted = chain_key(
            deterministic, "TrustedPersistentDataset", "cache files", cache_dir
        )

    def _cachecheck(self, item_transformed: Any) -> Any:
        key = self.hash_func(item_transformed).decode("utf-8") + self.transform_hash
        hashfile = Path(self.cache_dir) / f"{key}.pt"
        if hashfile.is_file():
            try:
                return torch.load(hashfile, weights_only=self.weights_only)
            except PermissionError:
                raise
            except Exception as e:  # any damage: rebuilt, never trained on
                warnings.warn(
                    f"cache file {hashfile} is damaged ({type(e).__name__}: {e}); rebuilding it", stacklevel=2
                )
                hashfile.unlink(missing_ok=True)
        result = self._pre_transform(deepcopy(item_transformed))
        if self.disk_full is not None:
            return result
        try:
            with atomic_write(hashfile, "wb", clean=False) as f:  # the folder was cleaned once, in __init__
                self._save(result, f)
        except NoSpaceError as err:  # no file under the item's name; go on without the disk
            self._stop_writing(err, result)
        return result

    def _save(self, result: Any, f: Any) -> None:
        torch.save(
            convert_to_tensor(result, convert_numeric=False, track_meta=self.track_meta),
            f,
            pickle_module=look_up_option(self.pickle_module, SUPPORTED_PICKLE_MOD),  # as MONAI does
            pickle_protocol=self.pickle_protocol,
        )

    def _stop_writing(self, err: NoSpaceError, result: Any) -> None:
        """Stop writing to the full cache folder, with one warning naming it and the space one item misses."""
        size = io.BytesIO()
        try:
            self._save(result, size)
            needed: int | None = size.getbuffer().nbytes
        except Exception:  # noqa: BLE001 - the size is for the message only
            needed = None
        finally:
            size.close()
        self.disk_full = NoSpaceError(
            self.cache_dir,
            needed=needed,
            free=err.free,
            what="disk cache folder",
            code=err.errno,
            detail="items are no longer written there (those already cached are still read) and the rest are "
            "computed in memory each time they are loaded; free space there or use another cache folder",
        )
        logger.warning("TrustedPersistentDataset: %s", self.disk_full)
