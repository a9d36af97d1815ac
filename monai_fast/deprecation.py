"""One warning for an old name, naming the name that replaces it.

Examples:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     deprecated("AMPToggle(dtype=...)", "AMPToggle(precision=...)")
    >>> str(caught[0].message)
    'AMPToggle(dtype=...) is deprecated and will be removed in the next release; use AMPToggle(precision=...)'
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["UNSET", "deprecated", "deprecated_flag"]


class _Unset:
    """The default of a deprecated keyword: tells "not given" from every real value, ``None`` included."""

    def __repr__(self) -> str:
        return "UNSET"


#: default of deprecated keywords
UNSET = _Unset()
_REMOVAL = "deprecated and will be removed in the next release"


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """One ``DeprecationWarning``: ``old`` is deprecated, use ``new``.

    ``stacklevel`` 3 points at the caller of the function that calls this one.
    """
    warnings.warn(f"{old} is {_REMOVAL}; use {new}", DeprecationWarning, stacklevel)


def deprecated_flag(new: str, **const: Any) -> type[argparse.Action]:
    """An ``argparse`` action for an old flag: one line on stderr naming ``new``, then ``const`` set as ``new`` sets it.

    Examples:
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--precision", default="auto")
        >>> _ = p.add_argument("--fp32", action=deprecated_flag("--precision fp32", precision="fp32"))
        >>> p.parse_args(["--fp32"]).precision
        'fp32'
    """

    class DeprecatedFlag(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
            kwargs.pop("nargs", None)
            super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, **kwargs)

        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *_: Any) -> None:
            print(f"{parser.prog}: {self.option_strings[0]} is {_REMOVAL}; use {new}", file=sys.stderr)
            for name, value in const.items():
                setattr(namespace, name, value)

    return DeprecatedFlag
