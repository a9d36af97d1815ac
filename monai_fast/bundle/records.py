"""Where a bundle run's record goes: one folder per run (``<output_dir>/monai_fast/<variant>-<time>``), never
another run's, on a writable disk."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from monai_fast.bundle.checks import BundleError

__all__ = [
    "FAST",
    "PUBLISHED",
    "RECORDS",
    "check_writable",
    "new_run_folder",
    "read_only_line",
    "records_parent",
    "refuse_foreign_record",
]

logger = logging.getLogger("monai_fast.bundle")

RECORDS = "monai_fast"  #: the folder under the bundle's output folder that holds one record folder per run
FAST, PUBLISHED = "fast", "published"  #: the variants, as a run's record folder names them


def new_run_folder(parent: str | os.PathLike, variant: str) -> Path:
    """Make this run's own record folder under ``parent``: ``<variant>-<YYYYmmdd-HHMMSS>`` (``-2``, ... when taken);
    every rank gets rank 0's."""
    from ignite import distributed as idist  # here: writing the fragment loads no torch

    folder = Path(parent)
    if idist.get_rank() == 0:
        stamp = f"{variant}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            candidate = folder / (stamp if n == 1 else f"{stamp}-{n}")
            with contextlib.suppress(FileExistsError):
                candidate.mkdir()
                break
        folder = candidate
    if idist.get_world_size() > 1:
        folder = Path(idist.broadcast(str(folder), src=0))
    return folder


def refuse_foreign_record(run_dir: str | os.PathLike, resume: bool) -> None:
    """Refuse (`BundleError`) a record folder that holds another run's record, unless this run resumes it."""
    held = sorted(Path(run_dir).glob("record.rank*.jsonl"))
    if held and not resume:
        raise BundleError(
            f"run folder {run_dir} holds another run's record ({held[0].name}); "
            "name a new folder, leave --run-dir out for a folder of this run's own, or pass --resume to continue it"
        )


def read_only_line(target: str, why: str, bundle_root: str) -> str:
    """The line for a folder that cannot be written; the way on where it is under the bundle's ``bundle_root``."""
    if not Path(target).resolve().is_relative_to(Path(bundle_root).resolve()):
        return f"cannot write {target} ({why})"
    return (
        f"cannot write {target} ({why}): the bundle writes its outputs under its bundle_root ({bundle_root}); "
        "run with bundle_root=<a writable folder> (the configs are still read from the bundle folder)"
    )


def check_writable(folder: Path, bundle_root: str) -> None:
    """Refuse (`BundleError`) a record folder that cannot be made: its nearest existing folder is read-only."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise BundleError(read_only_line(str(existing), "not writable", bundle_root))


def records_parent(parser: Any, root: Path) -> Path:
    """The folder of the bundle's run records: ``<output_dir>/monai_fast``, else ``<bundle_dir>/eval/monai_fast``."""
    if "output_dir" in parser:
        try:
            out = parser.get_parsed_content("output_dir")
            if isinstance(out, (str, os.PathLike)):
                return Path(out) / RECORDS
        except Exception as err:  # noqa: BLE001 - an output_dir expression the parser cannot evaluate yet
            logger.info("bundle: output_dir could not be read (%s); the record goes to %s/eval", err, root)
    return root / "eval" / RECORDS
