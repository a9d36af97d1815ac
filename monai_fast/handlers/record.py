"""Put a :class:`~monai_fast.telemetry.record.RunRecord` on an engine, where every handler finds it."""

from __future__ import annotations

import os

import ignite.distributed as idist
from ignite.engine import Engine

from monai_fast.handlers.lifecycle import on_run_end
from monai_fast.telemetry.record import RunRecord

__all__ = ["RecordHandler", "record_of"]


def record_of(engine: Engine) -> RunRecord | None:
    """The record attached to ``engine`` (``engine.state.run_record``), if any."""
    return getattr(engine.state, "run_record", None)


class RecordHandler:
    """Creates the run's record and shares it with every monai-fast handler on the engines.

    Attach it to the trainer (and the same instance to the evaluator, so validation rows land in
    the same record). It flushes when each run of an engine ends and closes (writing the summary)
    when the trainer's run ends, also when it raises.

    Args:
        run_dir: the run folder; ``None`` keeps the record in memory.
        rank: default ``idist.get_rank()``.

    Example:
        >>> rec = RecordHandler("runs/exp1")
        >>> rec.attach(trainer); rec.attach(evaluator)  # doctest: +SKIP
        >>> trainer.run()  # doctest: +SKIP
        >>> # runs/exp1/record.rank0.jsonl + summary.rank0.json, read by `monai-fast doctor runs/exp1`
    """

    def __init__(self, run_dir: str | os.PathLike | None, rank: int | None = None) -> None:
        self.record = RunRecord(run_dir, rank=idist.get_rank() if rank is None else rank)
        self._owner: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """The first engine attached owns the record (closes it); later ones share it."""
        if record_of(engine) is self.record:
            raise RuntimeError("RecordHandler is already attached to this engine")
        engine.state.run_record = self.record
        if self._owner is None:
            self._owner = engine
            on_run_end(engine, lambda e: self.record.close(), last=True)
        else:
            on_run_end(engine, lambda e: self.record.flush(), last=True)
