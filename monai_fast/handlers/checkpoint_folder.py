"""Preemption's second half: a folder of whole checkpoints ``ckpt-<iteration>.pt``, the newest valid ones kept.

How it differs from ignite's ``Checkpoint``: docs/preemption.md.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import zipfile
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from ignite import distributed as idist
from ignite.engine import Engine
from ignite.handlers import Checkpoint, DiskSaver

from monai_fast.files import NoSpaceError, atomic_write, clean_stale_tmp, no_space_in
from monai_fast.handlers.record import record_of
from monai_fast.telemetry.record import Category, Source

__all__ = ["CheckpointFolder", "CheckpointFolderError", "checkpoints_in"]

logger = logging.getLogger("monai_fast.handlers")

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoints_in(folder: str | os.PathLike) -> list[Path]:
    """The ``ckpt-<iteration>.pt`` files a `CheckpointFolder` wrote in ``folder``, highest iteration first (none
    where the folder cannot be read)."""
    try:
        found = [p for p in Path(folder).expanduser().iterdir() if _NAME.match(p.name) and p.is_file()]
    except OSError:
        return []
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)  # type: ignore[union-attr]


class CheckpointFolderError(OSError):
    """A checkpoint cannot be written because its folder is no longer a folder (``errno.ENOTDIR``, naming it)."""

    def __init__(self, folder: str | os.PathLike, message: str) -> None:
        super().__init__(errno.ENOTDIR, message, str(folder))

    def __str__(self) -> str:
        return str(self.args[1])

    def __reduce__(self):
        return (type(self), (self.filename, self.args[1]))


class _SyncedDiskSaver(DiskSaver):
    """ignite's ``DiskSaver`` (its rank writes), writing through `monai_fast.files.atomic_write()`."""

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        if idist.has_xla_support:  # every TPU process takes part in xm.save: ignite's own write
            super().__call__(checkpoint, filename, metadata)
        elif self.save_on_rank == idist.get_rank():
            with atomic_write(self.dirname / filename, "wb", fsync=True) as f:
                torch.save(checkpoint, f, **self.kwargs)


def _as_rank_failure(said: str, path: Path) -> Exception:
    """Another rank's failure to write ``path`` (``"<type>\\t<message>"``), raised here too: same type where ours."""
    kind, _, message = said.partition("\t")
    if kind == "NoSpaceError":
        err: Exception = NoSpaceError(path)
        err.args = (errno.ENOSPC, message)
        return err
    if kind == "CheckpointFolderError":
        return CheckpointFolderError(path.parent, message)
    return RuntimeError(f"checkpoint {path} was not written ({kind} on another rank): {message}")


def _span(engine: Engine) -> AbstractContextManager[None]:  # a ``checkpoint`` span of the run record
    record = record_of(engine)
    return nullcontext() if record is None else record.span(Category.CHECKPOINT, source=Source.CHECKPOINT)


def _iteration_of(engine: Engine, event: Any) -> int:
    return engine.state.iteration


class CheckpointFolder(Checkpoint):
    """ignite's ``Checkpoint`` writing ``ckpt-<iteration>.pt`` into ``dirname`` (docs/preemption.md).

    Args:
        to_save: name -> object with ``state_dict``.
        dirname: the folder (shared by all ranks; created by rank 0).
        n_saved: valid checkpoints kept, the one just written included.

    Examples:
        >>> folder = CheckpointFolder({"trainer": trainer, "model": net}, "ckpt", n_saved=2)  # doctest: +SKIP
        >>> path, state = folder.newest_loadable()  # doctest: +SKIP
    """

    def __init__(self, to_save: Mapping[str, Any], dirname: str | os.PathLike, n_saved: int = 2) -> None:
        if n_saved < 1:
            raise ValueError(f"n_saved must be >= 1, got {n_saved}")
        saver = _SyncedDiskSaver(dirname, create_dir=True, require_empty=False)
        super().__init__(
            to_save,
            saver,
            filename_prefix="ckpt",
            n_saved=None,
            global_step_transform=_iteration_of,
            filename_pattern="{filename_prefix}-{global_step:09d}.{ext}",
        )
        self.dirname = saver.dirname  # where the saver writes: "~" expanded
        self.keep = n_saved
        self._valid: dict[tuple[str, int, int], bool] = {}
        self._reported: set[str] = set()
        self._last: Path | None = None  # the checkpoint this process wrote last

    def __call__(self, engine: Engine) -> None:
        with _span(engine):
            super().__call__(engine)

    def write(self, engine: Engine) -> Path:
        """Write ``ckpt-<engine.state.iteration>.pt`` (all ranks call it; a ``checkpoint`` span), then prune."""
        with _span(engine):
            self.reset()  # rotation is prune()'s: ignite would unlink a same-named file before rewriting it
            name = f"ckpt-{engine.state.iteration:09d}.pt"
            failure: BaseException | None = None
            path = self.dirname / name
            try:
                if idist.get_rank() == 0 and self.dirname.exists() and not self.dirname.is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(self.dirname))
                self(engine)
                path = Path(self.last_checkpoint)
                if idist.get_rank() == 0:
                    st = path.stat()  # written whole here: no need to read it
                    self._valid[(path.name, st.st_size, st.st_mtime_ns)] = True
                    self.prune(path)
            except Exception as err:  # noqa: BLE001 - explained, agreed across ranks, raised below
                failure = self._explain(err, name)
                if failure is not err:
                    failure.__cause__ = err
            if idist.get_world_size() > 1:  # also the barrier: the file is complete when write() returns
                mine = f"{type(failure).__name__}\t{failure}" if failure is not None else ""
                said = [m for m in idist.all_gather(mine) if m]
                if said and failure is None:
                    failure = _as_rank_failure(said[0], path)
            if failure is not None:
                raise failure
            self._last = path
            return path

    def _explain(self, err: BaseException, name: str) -> BaseException:
        """``err`` as one error naming the folder, the space missing and what is kept; else ``err``."""
        kept = [p.name for p in self.checkpoints() if self.is_valid(p)] if self.dirname.is_dir() else []
        kept_text = (
            f"the checkpoints in {self.dirname} are kept ({', '.join(kept)})"
            if kept
            else f"no earlier checkpoint is in {self.dirname}"
        )
        last = self._last
        if not self.dirname.is_dir() and isinstance(err, (FileExistsError, NotADirectoryError)):
            what = "a file" if self.dirname.exists() else "something"
            written = (
                f"the last checkpoint this run wrote there is {last.name}" if last else "this run wrote none there"
            )
            return CheckpointFolderError(
                self.dirname,
                f"checkpoint folder {self.dirname} is no longer a folder ({what} replaced it): {name} "
                f"was not written and the run stops; {written}; move the file away or give another folder, "
                f"then resume",
            )
        full = no_space_in(err)
        if full is None:
            return err
        return NoSpaceError(
            self.dirname / name,
            needed=self._size_of(last) or next((self._size_of(self.dirname / k) for k in kept), None),
            free=full.free,
            what="checkpoint",
            code=full.errno,
            written=full.written,
            detail=f"{kept_text}; the run stops",
        )

    @staticmethod
    def _size_of(path: Path | None) -> int | None:
        try:
            return path.stat().st_size if path is not None else None
        except OSError:
            return None

    def checkpoints(self) -> list[Path]:
        """The ``ckpt-<iteration>.pt`` files in the folder, highest iteration first."""
        return checkpoints_in(self.dirname)

    def is_valid(self, path: Path) -> bool:
        """Whether ``path`` is a whole ``torch.save`` archive (every member's CRC checked; cached per file version)."""
        try:
            st = path.stat()
        except OSError:
            return False
        key = (path.name, st.st_size, st.st_mtime_ns)
        if key not in self._valid:
            try:
                with zipfile.ZipFile(path) as z:
                    self._valid[key] = z.testzip() is None
            except (OSError, zipfile.BadZipFile, EOFError, ValueError):
                self._valid[key] = False
        return self._valid[key]

    def prune(self, just_written: Path) -> list[Path]:
        """Keep ``just_written`` and the newest valid others up to ``n_saved``; returns the files removed.

        Damaged files are not counted, not removed, and named in a warning (once each).
        """
        keep, removed, damaged = [just_written], [], []
        for path in self.checkpoints():
            if path == just_written:
                continue
            if not self.is_valid(path):
                damaged.append(path)
            elif len(keep) < self.keep:
                keep.append(path)
            else:
                path.unlink(missing_ok=True)
                removed.append(path)
        new = [p for p in damaged if p.name not in self._reported]
        if new:
            self._reported.update(p.name for p in new)
            logger.warning(
                "Preemption: damaged checkpoint(s) %s in %s are not counted among the %d kept, and left "
                "there for inspection; delete them",
                ", ".join(p.name for p in new),
                self.dirname,
                self.keep,
            )
        return removed

    def newest_loadable(self) -> tuple[Path, dict[str, Any]] | None:
        """``(path, checkpoint dict)`` of the newest checkpoint every rank can read, or ``None``.

        A collective; unreadable checkpoints are skipped with a warning.
        """
        if idist.get_rank() == 0:
            clean_stale_tmp(self.dirname)
            old = [p.name for p in self.dirname.glob("ckpt-*") if p.is_dir()] if self.dirname.is_dir() else []
            if old:
                logger.warning(
                    "Preemption: %s hold(s) checkpoints of the old folder format, which are not read",
                    ", ".join(sorted(old)),
                )
        candidates = self.checkpoints()
        if idist.get_world_size() > 1:  # the same list on every rank (rank 0's view)
            listing = idist.broadcast("\n".join(str(p) for p in candidates), src=0, safe_mode=True)
            candidates = [Path(p) for p in str(listing).split("\n") if p]
        for path in candidates:
            state = None
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as exc:  # noqa: BLE001 - any damage means: try the next one
                logger.warning("Preemption: checkpoint %s cannot be read (%s); trying an older one", path, exc)
            ok = isinstance(state, dict)
            if idist.get_world_size() > 1:
                ok = bool(idist.all_reduce(torch.tensor([int(ok)], device=idist.device()), op="MIN").item())
            if ok:
                return path, state  # type: ignore[return-value]
        return None
