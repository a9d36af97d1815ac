"""The decision "show a progress bar?" and the bar factory every bar of the package uses.

Bars show only on a terminal or in a notebook; in a captured log (``monai-fast demo > log 2>&1``) their
redraws are noise, and callers log one line per step instead. Ground floor: imports nothing of ours.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

__all__ = ["in_notebook", "progress_bar", "show_progress"]


def in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython) kernel, where tqdm draws widgets instead of redraws."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)  # only where IPython is loaded already
    ip = get_ipython() if get_ipython is not None else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def show_progress(requested: bool, stream: IO[str] | None = None) -> bool:
    """Show bars? Only when ``requested`` and ``stream`` (default ``sys.stderr``) is a terminal, or in a notebook.

    Args:
        requested: the caller's wish (``progress=True``, no ``--no-progress``).
        stream: where the bars would be drawn; default ``sys.stderr``, read at call time.
    """
    if not requested:
        return False
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    return tty or in_notebook()


def progress_bar(iterable: Iterable[Any] | None = None, enabled: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar (a widget in a notebook), disabled unless `show_progress()` says yes for ``enabled``.

    Args:
        iterable: what to iterate over (``None``: update the bar by hand).
        enabled: the caller's wish; the bar is shown only where `show_progress()` allows.
        kwargs: passed to tqdm (``desc``, ``unit``, ``leave``...).

    Examples:
        >>> with progress_bar(total=2, enabled=False, desc="tune") as bar:
        ...     bar.update(2)
    """
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not show_progress(enabled), **kwargs)
