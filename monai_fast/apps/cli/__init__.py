"""``monai-fast``: the command line. It parses and prints; the work is in the library.

``monai-fast demo``   race the fast recipe against the plain-MONAI baseline to a target Dice.
``monai-fast bench``  the same race with all three recipes and repeats; JSON for benchmarks/results.
``monai-fast tune``   pick batch size, sliding-window batch, validation device, precision by throughput
                      (the fast recipe's, or a MONAI bundle's with ``--bundle``).
``monai-fast launch`` run a training script on N processes per node (torchrun, DDP), on one node or several.
``monai-fast sbatch`` write an sbatch script (ranks per GPU, requeue, USR1 before the time limit).
``monai-fast k8s``    write a Kubernetes PyTorchJob manifest (pods per node, GPUs, SIGTERM grace).
``monai-fast doctor`` name a run's bottleneck from its record, with evidence and the fix.
``monai-fast synth``  write a synthetic data set: MSD layout (3D) or whole-slide images.
``monai-fast train``  train one recipe and save the model (SageMaker's channels and hyperparameters when present).
``monai-fast infer``  sliding-window inference of a checkpoint into NIfTI predictions.
``monai-fast bundle`` run a MONAI bundle with FastTraining, or write the bundle config fragment.

Each command lives in the module that registers it (`COMMANDS`), imported only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from monai_fast import __version__

__all__ = ["COMMANDS", "COMPUTE_COMMANDS", "add_options", "build_parser", "main"]

#: each command -> the module and function that register it (imported when that command runs, or for the full help)
COMMANDS = {
    "demo": ("monai_fast.apps.cli.race_cmds", "add_race_commands"),
    "bench": ("monai_fast.apps.cli.race_cmds", "add_race_commands"),
    "tune": ("monai_fast.apps.cli.race_cmds", "add_tune_command"),
    "launch": ("monai_fast.apps.cli.tools", "add_tool_commands"),
    "sbatch": ("monai_fast.apps.cli.tools", "add_tool_commands"),
    "k8s": ("monai_fast.apps.cli.tools", "add_tool_commands"),
    "doctor": ("monai_fast.apps.cli.tools", "add_tool_commands"),
    "synth": ("monai_fast.apps.cli.tools", "add_tool_commands"),
    "train": ("monai_fast.apps.cli.train", "add_train_command"),
    "infer": ("monai_fast.apps.cli.infer_cmd", "add_infer_command"),
    "bundle": ("monai_fast.apps.cli.bundle_cmd", "add_bundle_command"),
}


def add_options(g: argparse._ActionsContainer, options: Iterable[tuple[Any, ...]]) -> None:
    """Add each ``(flag, type, default, help)`` of ``options`` to the parser or group ``g``, in order.

    A fifth item, a dict, holds more ``add_argument`` keywords (``choices``, ``nargs``, ``metavar``...).
    """
    for flag, kind, default, text, *more in options:
        if len(more) > 1:
            raise ValueError(f"add_options: {flag}: (flag, type, default, help[, keywords]), got {4 + len(more)} items")
        g.add_argument(flag, type=kind, default=default, help=text, **(more[0] if more else {}))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``monai-fast`` argument parser.

    Args:
        command: register only this command (only its module is imported: ``bundle fragment`` loads no torch);
            ``None`` or not a command: every command (the full help, argparse's message on a misspelt one).
    """
    parser = argparse.ArgumentParser(
        prog="monai-fast",
        description="Fast 3D medical-image training with MONAI and PyTorch-Ignite: recipes, handlers, benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'monai-fast COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    wanted = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module, function in dict.fromkeys(wanted):
        getattr(importlib.import_module(module), function)(sub)
    return parser


#: commands that train or infer, where the OpenMP line is logged (``set_defaults(computes=False)`` opts out)
COMPUTE_COMMANDS = frozenset({"demo", "bench", "tune", "train", "infer", "launch", "bundle"})


def main(
    argv: Sequence[str] | None = None,
    startup_notes: Sequence[str] = (),
    pin_openmp: bool = False,
    startup_check: Callable[[], bool] | None = None,
) -> int:
    """Run one ``monai-fast`` command: bad input, an unwritable output, a missing extra end in one line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        startup_notes: what the entry point set up before torch loaded, logged for the commands that compute.
        pin_openmp: for a command that computes in this process, pin OpenMP's workers first (`pin_openmp_workers()`).
        startup_check: whether ``startup_notes`` apply, asked once torch has loaded; ``None``: they apply.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # the top-level options take no value
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("ignite").setLevel(logging.WARNING)
    computes = args.subcommand in COMPUTE_COMMANDS and getattr(args, "computes", True)
    notes = list(startup_notes) if computes and (startup_check is None or startup_check()) else []
    if pin_openmp and computes and args.subcommand != "launch":  # before any thread starts; launch's ranks compute
        from monai_fast.openmp import pin_openmp_workers

        notes.append(pin_openmp_workers())
    for note in filter(None, notes):
        logging.getLogger("monai_fast").info(note)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that closed the pipe early fails here, inside the handler below
        return status
    except BrokenPipeError:  # `monai-fast doctor RUN | head`: stdout to devnull, so the flush at exit does not fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # a user's mistake or an output that cannot be written: one line, no traceback
        stop = _user_line(e, args.subcommand)
        if stop is None:
            raise
        raise SystemExit(stop) from e


def _user_line(e: Exception, command: str) -> str | None:
    """The line that ends the command for a user's mistake or an unwritable output (``None``: raise ``e``)."""
    from monai_fast.apps.cli.args import flag_of
    from monai_fast.apps.sources.msd import MSDDataError
    from monai_fast.apps.sources.remote_io import RemoteDataError
    from monai_fast.apps.training.options import OptionError
    from monai_fast.data.items import DataItemError, item_line
    from monai_fast.data.preflight import PreflightError
    from monai_fast.extras import MissingExtraError
    from monai_fast.files import no_space_in
    from monai_fast.folders import RunFolderBusyError
    from monai_fast.handlers.checkpoint_folder import CheckpointFolderError
    from monai_fast.tune import TuningError

    if isinstance(e, OptionError):
        return f"monai-fast {command}: {flag_of(e.option)}: {e.message}"
    if isinstance(e, TuningError):
        return f"monai-fast: tuning failed: {e}"
    if isinstance(e, (FileNotFoundError, MSDDataError, PreflightError, MissingExtraError, RemoteDataError)):
        return f"monai-fast {command}: {e}"
    if isinstance(e, DataItemError):  # a file that cannot be read or transformed, named
        return f"monai-fast {command}: bad data: {item_line(e)}"
    full = no_space_in(e)  # a full disk or a replaced output folder, anywhere in e's chain: the line naming the path
    if full is not None:
        return f"monai-fast {command}: {full}"
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (CheckpointFolderError, RunFolderBusyError)):
            return f"monai-fast {command}: {cur}"
        cur = cur.__cause__ or cur.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
