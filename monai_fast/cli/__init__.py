"""``monai-fast``: the command line. It parses and prints; the work is in the library.

``monai-fast demo``   race the fast recipe against the plain-MONAI baseline to a target Dice.
``monai-fast bench``  the same race with all three recipes and repeats; JSON for benchmarks/results.
``monai-fast synth``  write a synthetic data set in Medical Segmentation Decathlon layout.
``monai-fast doctor`` name a run's bottleneck from its record, with evidence and the fix.
``monai-fast tune``   pick batch size, sliding-window batch, validation device, precision by throughput.
``monai-fast launch`` run a training script on N local processes (torchrun, DDP).
``monai-fast sbatch`` write an sbatch script (ranks per GPU, requeue, USR1 before the time limit).
``monai-fast bundle`` run a MONAI bundle with FastTraining, or write the bundle config fragment.

``demo``, ``bench`` and ``tune`` call :mod:`monai_fast.race` (in :mod:`monai_fast.cli.race_cmds`);
the others (in :mod:`monai_fast.cli.tools`) call the data, distributed and report modules.

Example:
    >>> from monai_fast.cli import main
    >>> main(["synth", "/tmp/mf-synth", "--cases", "1", "--shape", "16", "16", "16", "--no-progress"])  # doctest: +SKIP
    wrote 1 spleen-like cases in MSD layout to /tmp/mf-synth
    0
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from monai_fast.cli.args import flag_of

__all__ = ["COMPUTE_COMMANDS", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``monai-fast`` argument parser (each command's module imported here, so that importing one command's
    module loads only what that command needs)."""
    from monai_fast.cli.bundle_cmd import add_bundle_command
    from monai_fast.cli.infer_cmd import add_infer_command
    from monai_fast.cli.race_cmds import add_race_commands
    from monai_fast.cli.tools import add_tool_commands
    from monai_fast.cli.train import add_train_command

    parser = argparse.ArgumentParser(
        prog="monai-fast",
        description="Fast 3D medical-image training with MONAI and PyTorch-Ignite: recipes, handlers, benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'monai-fast COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    add_race_commands(sub)
    add_tool_commands(sub)
    add_train_command(sub)
    add_infer_command(sub)
    add_bundle_command(sub)
    return parser


#: commands that train or infer, where :mod:`monai_fast.openmp`'s line is worth a log line
COMPUTE_COMMANDS = frozenset({"demo", "bench", "tune", "train", "infer", "launch", "bundle"})


def main(argv: Sequence[str] | None = None, startup_notes: Sequence[str] = (), pin_openmp: bool = False) -> int:
    """Run one ``monai-fast`` command; bad input ends in one line naming the option, no traceback.

    An output that cannot be written ends the same way: a full file system (one line naming the
    file and the space missing) or a checkpoint folder replaced by a file; so does a missing extra
    (the line that installs it, ``pip install "monai-fast[wsi]"``).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        startup_notes: what the entry point set up before torch loaded (:mod:`monai_fast.__main__`),
            logged once for the commands that compute.
        pin_openmp: for a command that trains or infers in this process, pin OpenMP's worker threads one
            per core first (:func:`monai_fast.openmp.pin_openmp_workers`; the entry point asks for it).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("ignite").setLevel(logging.WARNING)
    notes = list(startup_notes) if args.subcommand in COMPUTE_COMMANDS else []
    if pin_openmp and args.subcommand in COMPUTE_COMMANDS - {
        "launch"
    }:  # before any thread starts; launch's ranks compute
        from monai_fast.openmp import pin_openmp_workers

        notes.append(pin_openmp_workers())
    for note in filter(None, notes):
        logging.getLogger("monai_fast").info(note)
    from monai_fast.data.items import DataItemError
    from monai_fast.data.msd import MSDDataError
    from monai_fast.data.preflight import PreflightError
    from monai_fast.extras import MissingExtraError
    from monai_fast.training.options import OptionError
    from monai_fast.tune import TuningError

    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that closed the pipe early fails here, inside the handler below
        return status
    except BrokenPipeError:  # `monai-fast doctor RUN | head`: the reader has what it wanted; stop quietly
        # the Python docs' recipe (signal module, "Note on SIGPIPE"): point stdout at devnull so that the
        # interpreter's own flush at exit does not fail a second time
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OptionError as e:
        raise SystemExit(f"monai-fast {args.subcommand}: {flag_of(e.option)}: {e.message}") from e
    except TuningError as e:
        raise SystemExit(f"monai-fast: tuning failed: {e}") from e
    except (FileNotFoundError, MSDDataError, PreflightError, MissingExtraError) as e:  # one clear line, no traceback
        raise SystemExit(f"monai-fast {args.subcommand}: {e}") from e
    except DataItemError as e:  # a file that cannot be read or transformed, named
        raise SystemExit(f"monai-fast {args.subcommand}: bad data: {_item_line(e)}") from e
    except Exception as e:  # a full disk or a replaced output folder: the one line naming the path, whatever raised it
        stop = _output_line(e)
        if stop is None:
            raise
        raise SystemExit(f"monai-fast {args.subcommand}: {stop}") from e


def _output_line(e: BaseException) -> str | None:
    """The one-line message of an output that could not be written (a full file system, a checkpoint folder
    that is no longer a folder, a run folder another run owns), found anywhere in ``e``'s chain; ``None`` for
    other errors."""
    from monai_fast.files import RunFolderBusyError, no_space_in
    from monai_fast.handlers.checkpoint_folder import CheckpointFolderError

    full = no_space_in(e)
    if full is not None:
        return str(full)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (CheckpointFolderError, RunFolderBusyError)):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    return None


def _item_line(e: BaseException) -> str:
    """The one line of a :class:`DataItemError` that names the file, also when a DataLoader worker
    process re-raised it with the worker's traceback in its text."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln.split("DataItemError: ", 1)[1] for ln in lines if "DataItemError: " in ln]
    return named[-1] if named else (lines[0] if lines else type(e).__name__)


if __name__ == "__main__":
    sys.exit(main())
