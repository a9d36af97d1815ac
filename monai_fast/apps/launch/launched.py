"""The entry of every rank that ``monai-fast launch`` starts: the user's script, kept from spawning again.

``ignite.distributed.spawn`` is replaced by one that stops the rank with one line saying to drop
``nproc_per_node`` (exit status 2): a launched rank that spawned more would race for the rendezvous port.
"""

from __future__ import annotations

import functools
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["STOPPED_DIR", "NestedSpawnError", "guard_ignite_spawn", "main"]

#: where a rank that exits with `STOPPED_EXIT` (stopped by a signal, checkpointed) leaves ``stopped.<local rank>``
STOPPED_DIR = "MONAI_FAST_STOPPED_DIR"

logger = logging.getLogger("monai_fast.distributed")


class NestedSpawnError(RuntimeError):
    """A launched rank asked ignite to start processes of its own."""


def guard_ignite_spawn() -> None:
    """Make ``ignite.distributed.spawn`` (and so ``idist.Parallel(nproc_per_node=N).run``) raise
    `NestedSpawnError`."""
    import ignite.distributed as idist
    from ignite.distributed import utils

    from monai_fast.distributed.env import detect, nested_spawn_message

    @functools.wraps(utils.spawn)
    def refuse(
        backend: str, fn: Any, args: tuple, kwargs_dict: dict | None = None, nproc_per_node: int = 1, **kwargs: Any
    ) -> None:
        raise NestedSpawnError(nested_spawn_message(nproc_per_node, detect()))

    utils.spawn = refuse  # what idist.Parallel.run calls
    idist.spawn = refuse  # the same function, re-exported


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``argv[0]`` (a script, or ``-m MODULE``) with the rest as its arguments; 2 if it tried to spawn ranks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = argv[:1] == ["-m"]
    argv = argv[1:] if module else argv
    if not argv:
        what = "-m MODULE" if module else "SCRIPT"
        print(f"usage: python -m monai_fast.apps.launch.launched {what} [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    guard_ignite_spawn()
    sys.argv = argv
    try:
        if module:
            sys.path[0] = os.getcwd()  # as `python -m MODULE` sets it
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
            runpy.run_path(script, run_name="__main__")
    except NestedSpawnError as e:
        print(f"monai-fast launch: {script}: {e}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as e:  # a rank stopped by a signal says so to the launch, which then exits as it did
        from monai_fast.handlers.preemption import STOPPED_EXIT

        if e.code == STOPPED_EXIT and os.environ.get(STOPPED_DIR):
            with open(os.path.join(os.environ[STOPPED_DIR], f"stopped.{os.environ.get('LOCAL_RANK', '0')}"), "w"):
                pass
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
