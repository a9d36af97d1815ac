"""A user's mistake met while a bundle builds or trains, found in MONAI's chain of errors and told in one line."""

from __future__ import annotations

import difflib
import errno
import os
import re
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from monai_fast.bundle.checks import BundleError, config_ids
from monai_fast.bundle.records import read_only_line

__all__ = ["named_user_errors", "raised_by_logging_config", "user_error_line"]


def raised_by_logging_config(e: BaseException) -> bool:
    """Whether ``e`` came from applying a logging file (``logging.config.fileConfig`` or MONAI's check of it)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(Path(f.filename).match("logging/config.py") for f in frames) or "logging config file" in str(e)


_MISSING_REF = re.compile(r"the referring item `@([^`]+)` is not defined|can not find expected ID '([^']+)'")
_COMPONENT = re.compile(r"Failed to instantiate component '([^']+)'")
_TRANSFORM = re.compile(r"applying transform <([\w.]+)")
_ERROR_LINE = re.compile(r"^\w+(?:Error|Exception): .+$", re.MULTILINE)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the errors it was raised from, outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not c for c in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def user_error_line(e: BaseException, parser: Any, root: Path, files: Sequence[Path]) -> str | None:
    """The one line for a bundle that fails on the user's side (an undefined reference, a bad argument, an empty
    data set, a missing file, a bad data item, a read-only folder), found in ``e``'s chain; else ``None``."""
    from monai_fast.data.items import DataItemError, item_line

    chain = _chain(e)
    texts = [str(c) for c in chain]
    component = next((m.group(1).rsplit(".", 1)[-1] for t in texts if (m := _COMPONENT.search(t))), None)
    built = f" (building {component})" if component else ""
    if ref := next(filter(None, map(_MISSING_REF.search, texts)), None):
        name = (ref.group(1) or ref.group(2)).replace("::", "#")
        near = difflib.get_close_matches(name, config_ids(parser.get()), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('@' + n for n in near)}?" if near else ""
        return f"the config ({', '.join(f.name for f in files)}) refers to @{name}, which it does not define{hint}"
    for cur in chain:
        if isinstance(cur, TypeError) and "unexpected keyword argument" in str(cur):
            return f"a component of the config takes no such argument{built}: {cur}"
    for cur in chain:
        if isinstance(cur, DataItemError):
            return f"bad data: {item_line(cur)}"
    for cur in chain:
        if isinstance(cur, ValueError) and "num_samples=0" in str(cur):
            data = parser.get("dataset_dir")
            read = f": dataset_dir {data} holds no items it lists" if isinstance(data, str) else ""
            return f"a data set of the config is empty{built}{read} (or too few for its validation split)"
    for cur in chain:
        if isinstance(cur, OSError) and cur.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            target = os.fsdecode(cur.filename) if cur.filename is not None else str(cur)
            return read_only_line(target, os.strerror(cur.errno), parser.get("bundle_root", str(root)))
    missing = [c for c in chain if isinstance(c, FileNotFoundError)]
    if missing:
        named = next((c for c in missing if c.filename is not None), None)
        return (f"{os.fsdecode(named.filename)}: no such file" if named else str(missing[0])) + built
    transform = next((m.group(1).rsplit(".", 1)[-1] for t in texts if (m := _TRANSFORM.search(t))), None)
    if transform is not None:  # MONAI's own loader: the first error in the chain's text is the cause
        causes = [m.group(0) for t in reversed(texts) for m in _ERROR_LINE.finditer(t)]
        cause = causes[0] if causes else f"{type(chain[-1]).__name__}: {chain[-1]}"
        return f"bad data: {transform} failed: {cause}"
    return None


@contextmanager
def named_user_errors(parser: Any, root: Path, files: Sequence[Path]) -> Iterator[None]:
    """Turn a user's mistake raised while the bundle builds or trains into a one-line `BundleError`."""
    try:
        yield
    except BundleError:
        raise
    except Exception as e:
        line = user_error_line(e, parser, root, files)
        if line is None:
            raise
        raise BundleError(line) from e
