"""Validate a snapshot of the weights while training goes on."""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
from typing import Literal

import torch
from ignite.engine import Engine, Events
from monai.engines import Evaluator

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_row
from monai_fast.telemetry.cuda import side_stream
from monai_fast.telemetry.record import Kind, Source

__all__ = ["BackgroundValidation", "BackgroundValidationError"]

THREAD_NAME = "monai-fast-validation"


class BackgroundValidationError(RuntimeError):
    """The background validation of an epoch's weights failed; the cause is chained."""


class BackgroundValidation(EngineHandler):
    """Runs ``evaluator`` on a snapshot of the trainer's weights in a background thread.

    Every ``interval``-th epoch (and the last) the weights are copied into a private network and
    ``evaluator.run(epoch)`` starts in a thread; a failure is raised on the training thread as
    `BackgroundValidationError` naming the epoch. See docs/data.md.

    Args:
        evaluator: a MONAI ``Evaluator`` with a ``network`` (e.g. ``SupervisedEvaluator``).
        interval: validate every this many epochs.
        when_busy: ``"skip"`` or ``"wait"`` when the previous validation is still running.
        threads: ``(training, validation)`` intra-op threads on CPU.

    Examples:
        >>> BackgroundValidation(evaluator).attach(trainer)  # instead of ValidationHandler  # doctest: +SKIP
    """

    def __init__(
        self,
        evaluator: Evaluator,
        interval: int = 1,
        when_busy: Literal["skip", "wait"] = "skip",
        threads: tuple[int, int] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(evaluator, Evaluator) or not isinstance(getattr(evaluator, "network", None), torch.nn.Module):
            raise TypeError(
                "BackgroundValidation: evaluator must be a MONAI Evaluator with a network, "
                f"got {type(evaluator).__name__}"
            )
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"BackgroundValidation: interval must be an int >= 1, got {interval!r}")
        if when_busy not in ("skip", "wait"):
            raise ValueError(f"BackgroundValidation: when_busy must be 'skip' or 'wait', got {when_busy!r}")
        if threads is not None and (len(threads) != 2 or min(threads) < 1):
            raise ValueError(
                f"BackgroundValidation: threads must be (training, validation), each >= 1, got {threads!r}"
            )
        super().__init__()
        self.evaluator, self.interval, self.when_busy = evaluator, interval, when_busy
        half = max(1, torch.get_num_threads() // 2)
        self.threads = tuple(threads) if threads is not None else (half, half)
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.validated_epochs: list[int] = []  # epochs whose weights were validated, in order
        self.skipped_epochs: list[int] = []  # epochs left out because a validation was still running
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._source: torch.nn.Module | None = None
        self._own_network: torch.nn.Module | None = None
        self._threads_before = torch.get_num_threads()

    def _attach(self, trainer: Engine) -> None:
        network = getattr(trainer, "network", None)
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                "BackgroundValidation: the trainer must have a network (a MONAI SupervisedTrainer), "
                f"got {type(trainer).__name__}"
            )
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # the evaluator's metric all-reduce would interleave with DDP's gradient all-reduce
            raise ValueError(
                "BackgroundValidation: not in a multi-process run (collectives from two threads); "
                "use ValidationSchedule"
            )
        self._source = getattr(network, "module", network)  # DDP: the bare module, as the evaluator uses
        self._own_network = self.evaluator.network
        self.evaluator.network = copy.deepcopy(self._source)  # the snapshot, only ever written between validations
        self.on(trainer, Events.STARTED, self._started)
        self.on(trainer, Events.ITERATION_COMPLETED, self._raise_error)
        self.on(trainer, Events.EPOCH_COMPLETED, self._epoch_completed)
        for event in (Events.TERMINATE, Events.COMPLETED):  # before the run-end hooks: an error is raised, not logged
            self.on(trainer, event, self._completed, first=True)
        self.on_run_end(trainer, self._stop)

    def _detached(self, engine: Engine) -> None:
        self._stop(engine)
        if self._own_network is not None:
            self.evaluator.network = self._own_network

    def _started(self, trainer: Engine) -> None:
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads[0])

    def _raise_error(self, trainer: Engine | None = None) -> None:
        if self._error is not None:
            (epoch, error), self._error = self._error, None
            raise BackgroundValidationError(
                f"background validation of epoch {epoch}'s weights failed: {error!r}"
            ) from error

    def _epoch_completed(self, trainer: Engine) -> None:
        self._raise_error()
        epoch = trainer.state.epoch
        last = trainer.state.max_epochs is not None and epoch >= trainer.state.max_epochs
        if epoch % self.interval and not last:
            return
        if self._thread is not None and self._thread.is_alive():
            if self.when_busy == "skip" and not last:
                self.skipped_epochs.append(epoch)
                self.logger.debug("background validation still running: epoch %d not validated", epoch)
                return
            self._thread.join()
            self._raise_error()
        assert self._source is not None
        with torch.no_grad():
            self.evaluator.network.load_state_dict(self._source.state_dict())
        self.validated_epochs.append(epoch)
        self._thread = threading.Thread(target=self._validate, args=(trainer, epoch), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _validate(self, trainer: Engine, epoch: int) -> None:
        torch.set_num_threads(self.threads[1])
        start = time.perf_counter()
        try:
            with side_stream(self.evaluator.state.device or "cpu"):
                self.evaluator.run(epoch)
        except BaseException as e:  # handed to the training thread, never dropped
            self._error = (epoch, e)
            return
        full_s = time.perf_counter() - start
        add_row(trainer, Kind.EPOCH, Source.VALIDATION, epoch=epoch, background=True, full=True, full_s=full_s)

    def _completed(self, trainer: Engine) -> None:
        if self._thread is not None:
            self._thread.join()
        self._raise_error()

    def _stop(self, trainer: Engine) -> None:
        thread, self._thread = self._thread, None
        failing = sys.exc_info()[1] is not None  # called from the run's exception hook: the run is failing
        if thread is not None and thread.is_alive():
            if failing:
                self.evaluator.terminate()  # stop at the next batch; nobody will read the result
            thread.join()
        if self._error is not None and failing:
            (epoch, error), self._error = self._error, None
            self.logger.error("background validation of epoch %d's weights also failed: %r", epoch, error)
        torch.set_num_threads(self._threads_before)
