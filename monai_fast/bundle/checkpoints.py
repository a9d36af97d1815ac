"""A bundle's checkpoints written atomically: a full disk leaves the previous file whole and is named in one line
(MONAI's ``CheckpointSaver`` writes in place, so a full disk would leave a truncated ``model.pt``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from ignite import distributed as idist
from ignite.handlers import Checkpoint, DiskSaver

from monai_fast.bundle.checks import config_targets
from monai_fast.files import atomic_path

__all__ = ["AtomicDiskSaver", "atomic_checkpoints", "config_checkpoint_savers"]

logger = logging.getLogger("monai_fast.bundle")


class AtomicDiskSaver(DiskSaver):
    """ignite's ``DiskSaver`` writing each checkpoint atomically, optionally always under one fixed file name.

    Args:
        dirname: the checkpoint folder.
        filename: a fixed name for every checkpoint (MONAI's ``final_filename``), or ``None`` for ignite's names.
        save_on_rank: the rank that writes (ignite's ``DiskSaver`` argument).
    """

    def __init__(self, dirname: str | os.PathLike, filename: str | None = None, save_on_rank: int = 0) -> None:
        super().__init__(dirname=dirname, atomic=True, require_empty=False, save_on_rank=save_on_rank)
        self.filename = filename

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        """Write ``checkpoint`` to a temporary file beside its final path, then rename it into place (a full file
        system raises `NoSpaceError` naming the final path)."""
        if self.save_on_rank != idist.get_rank():
            return
        with atomic_path(self.dirname / (self.filename or filename), fsync=True) as tmp:
            torch.save(checkpoint, tmp, **self.kwargs)

    def remove(self, filename: str) -> None:
        """Remove an older checkpoint; a fixed-name file stays, to be replaced whole by the save that follows."""
        if self.filename is None:
            super().remove(filename)


def atomic_checkpoints(savers: Iterable[Any]) -> int:
    """Make every MONAI ``CheckpointSaver`` among ``savers`` (a bundle's handlers) write its checkpoints atomically;
    returns how many ignite ``Checkpoint`` objects now do.

    Examples:
        >>> atomic_checkpoints(["not a saver"])
        0
    """
    from monai.handlers import CheckpointSaver

    changed = 0
    for saver in savers:
        if not isinstance(saver, CheckpointSaver):
            continue
        for checkpoint in vars(saver).values():
            handler = getattr(checkpoint, "save_handler", None)
            if not isinstance(checkpoint, Checkpoint) or not isinstance(handler, DiskSaver):
                continue
            if not isinstance(handler, AtomicDiskSaver):
                checkpoint.save_handler = AtomicDiskSaver(
                    handler.dirname, getattr(handler, "filename", None), handler.save_on_rank
                )
            changed += 1
    if changed:
        logger.info("bundle: %d checkpoint writer(s) made atomic (temporary file, then rename)", changed)
    return changed


def config_checkpoint_savers(parser: Any) -> list[Any]:
    """The ``CheckpointSaver`` objects of a parsed bundle config (a MONAI ``ConfigParser``), wherever they are, as
    the engines were built with them."""
    savers = [cid for cid, target in config_targets(parser.get()) if target.rsplit(".", 1)[-1] == "CheckpointSaver"]
    return [parser.get_parsed_content(cid) for cid in savers]
