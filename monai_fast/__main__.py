"""The ``monai-fast`` command's entry point (also ``python -m monai_fast``).

It bounds OpenMP's spin before torch loads (`monai_fast.openmp.bound_openmp_spin()`), then hands over to
`monai_fast.apps.cli.main()`, which pins OpenMP's worker threads for a command that computes here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from monai_fast.openmp import bound_openmp_spin, libgomp_mapped


def main(argv: Sequence[str] | None = None) -> int:
    """Bound OpenMP's spin (while torch is not loaded yet), then run the command line.

    A command that computes logs it once torch has loaded, if torch loaded GNU OpenMP (others ignore it).
    """
    note = bound_openmp_spin()
    from monai_fast.apps.cli import main as cli_main  # loads the command's module (and torch) when it parses

    return cli_main(argv, startup_notes=[note] if note else [], startup_check=libgomp_mapped, pin_openmp=True)


if __name__ == "__main__":
    sys.exit(main())
