"""The bundle-native way: a config fragment that makes MONAI's own runner attach ``FastTraining`` and a run record
(one folder per run, never another run's)::

monai-fast bundle fragment --out configs/fast.json
python -m monai.bundle run --config_file "['configs/train.json','configs/fast.json']"
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

from monai_fast.bundle.checks import BundleError
from monai_fast.files import write_text

__all__ = [
    "ATTACH_CALL",
    "FAST",
    "FRAGMENT",
    "PUBLISHED",
    "attach_fast",
    "decision_lines",
    "new_run_folder",
    "printed_decisions",
    "refuse_foreign_record",
    "write_fragment",
]

ATTACH_CALL = "attach_fast("  #: what the fragment's ``initialize`` entry calls
FAST, PUBLISHED = "fast", "published"  #: the variants, as a run's record folder names them

#: the fragment: record and FastTraining on ``train#trainer`` / ``validate#evaluator``, atomic checkpoint writes
FRAGMENT: dict[str, Any] = {
    "+imports": [
        "$from monai_fast.bundle import attach_fast",
        "$from monai_fast.bundle.checkpoints import atomic_checkpoints",
    ],
    "+initialize": [
        "$attach_fast(@train#trainer, @validate#evaluator, @bundle_root + '/eval/monai_fast')",
        "$atomic_checkpoints(@train#handlers + @validate#handlers)",
    ],
}


def attach_fast(
    trainer: Any,
    evaluator: Any = None,
    records_dir: str | os.PathLike | None = None,
    run_dir: str | os.PathLike | None = None,
    resume: bool = False,
    fast: bool = True,
    announce: bool = True,
    **options: Any,
) -> Any:
    """Attach a run record, the doctor's timers and ``FastTraining`` to a bundle's engines.

    Args:
        trainer: the bundle's ``SupervisedTrainer``.
        evaluator: its ``SupervisedEvaluator``, or ``None``.
        records_dir: the folder in which this run's record folder (``<fast|published>-<time>``) is made.
        run_dir: this run's record folder itself, instead (another run's is refused unless ``resume``).
        resume: continue the record in ``run_dir`` (a run resumed from its checkpoint).
        fast: attach ``FastTraining``; ``False`` records the bundle as published.
        announce: print the record folder and each decision once, whatever logging the bundle brings.
        options: keyword arguments for ``FastTraining``.

    Returns:
        The attached ``FastTraining``, ``None`` with ``fast=False``.

    Examples:
        >>> fast = attach_fast(trainer, evaluator, records_dir="eval/monai_fast")  # doctest: +SKIP
    """
    import torch

    from monai_fast.handlers import FastTraining, InferenceSplit, RecordHandler, TimeBreakdown, TrainingAlgorithmTime

    if run_dir is not None:
        refuse_foreign_record(run_dir, resume)
    elif records_dir is not None:
        run_dir = new_run_folder(records_dir, FAST if fast else PUBLISHED)
    if run_dir is not None:
        record = RecordHandler(run_dir)
        record.attach(trainer)
        if evaluator is not None:
            record.attach(evaluator)
        if announce:
            print(f"monai-fast run record: {run_dir}", flush=True)
    if evaluator is not None and isinstance(getattr(evaluator, "network", None), torch.nn.Module):
        InferenceSplit().attach(evaluator)
    TimeBreakdown().attach(trainer)  # data wait against compute: what the doctor reads
    TrainingAlgorithmTime().attach(trainer)  # the bundle's post-processing and metrics, timed also with fast=False
    if not fast:
        return None
    handler = FastTraining(**options)
    with printed_decisions() if announce else nullcontext():
        handler.attach(trainer, evaluator)
    if announce:
        for line in decision_lines(handler.applied):
            print(line, flush=True)
    return handler


def _not_a_decision(record: logging.LogRecord) -> bool:
    """A log filter dropping FastTraining's ``FastTraining <lever>: ...`` INFO lines."""
    return not (record.levelno == logging.INFO and record.getMessage().startswith("FastTraining "))


@contextmanager
def printed_decisions() -> Iterator[None]:
    """While ``FastTraining`` attaches, keep its decisions out of the log: the caller prints each once."""
    source = logging.getLogger("monai_fast.handlers")
    source.addFilter(_not_a_decision)
    try:
        yield
    finally:
        source.removeFilter(_not_a_decision)


def decision_lines(applied: dict[str, dict[str, Any]]) -> list[str]:
    """FastTraining's decisions, one line per lever: ``FastTraining precision: bf16: <reason>``."""
    return [
        f"FastTraining {k}: {v.get('setting') if v.get('applied') else 'left alone'}: {v.get('reason', '')}"
        for k, v in applied.items()
    ]


def write_fragment(path: str | os.PathLike) -> Path:
    """Write `FRAGMENT` as JSON to ``path`` (atomically); returns the path."""
    return write_text(json.dumps(FRAGMENT, indent=2) + "\n", path)


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
            with suppress(FileExistsError):
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
