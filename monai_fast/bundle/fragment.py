"""The bundle-native way: a config fragment that makes MONAI's own runner attach ``FastTraining``.

Merged after a bundle's ``train.json`` (MONAI merges several config files in order, and a key
written ``+initialize`` appends to the bundle's own ``initialize`` list instead of replacing it),
it imports monai-fast with the bundle's own imports and adds one expression to ``initialize``,
run after the bundle's own set-up and before ``run``: :func:`attach_fast` on the bundle's trainer
and evaluator. The config's own
objects are the ones attached to, so ``$@train#trainer.run()`` trains with the levers applied::

    monai-fast bundle fragment --out configs/fast.json
    python -m monai.bundle run --config_file "['configs/train.json','configs/fast.json']"

Example:
    >>> from monai_fast.bundle import FRAGMENT
    >>> FRAGMENT["+imports"][0]
    '$from monai_fast.bundle import attach_fast'
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from monai_fast.files import write_text

__all__ = ["FRAGMENT", "attach_fast", "write_fragment"]

logger = logging.getLogger("monai_fast.bundle")

#: the fragment: record and FastTraining on ``train#trainer`` / ``validate#evaluator``, atomic checkpoint writes
#: for every ``CheckpointSaver`` in ``train#handlers`` and ``validate#handlers``
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


def attach_fast(trainer: Any, evaluator: Any = None, run_dir: str | os.PathLike | None = None, **options: Any) -> Any:
    """Attach a run record and a ``TimeBreakdown`` (with ``run_dir``) and ``FastTraining`` to a bundle's engines.

    Each decision is logged on ``monai_fast`` and printed, so it is seen whatever logging set-up
    the bundle brings.

    Args:
        trainer: the bundle's ``SupervisedTrainer``.
        evaluator: its ``SupervisedEvaluator``, or ``None``.
        run_dir: the run record's folder; ``None``: no record.
        options: keyword arguments for ``FastTraining``.

    Returns:
        The attached ``FastTraining``.
    """
    from monai_fast.handlers import FastTraining, RecordHandler, TimeBreakdown

    if run_dir is not None:
        record = RecordHandler(run_dir)
        record.attach(trainer)
        if evaluator is not None:
            record.attach(evaluator)
        TimeBreakdown().attach(trainer)
    fast = FastTraining(**options)
    fast.attach(trainer, evaluator)
    for line in decision_lines(fast.applied):
        print(line, flush=True)
    return fast


def decision_lines(applied: dict[str, dict[str, Any]]) -> list[str]:
    """FastTraining's decisions, one line per lever: ``FastTraining precision: bf16: <reason>``."""
    lines = []
    for lever, what in applied.items():
        state = what.get("setting") if what.get("applied") else "left alone"
        lines.append(f"FastTraining {lever}: {state}: {what.get('reason', '')}")
    return lines


def write_fragment(path: str | os.PathLike) -> Path:
    """Write :data:`FRAGMENT` as JSON to ``path`` (atomically); returns the path."""
    return write_text(json.dumps(FRAGMENT, indent=2) + "\n", path)
