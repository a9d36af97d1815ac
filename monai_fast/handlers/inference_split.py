"""Where a validation iteration's time goes: the network, the sliding window around it, and the rest."""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import asdict, dataclass

import torch
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_row
from monai_fast.telemetry.cuda import Mark, seconds_between, time_mark
from monai_fast.telemetry.record import Kind, Source

__all__ = ["InferenceSplit", "InferenceTimes"]


@dataclass
class InferenceTimes:
    """Totals of one evaluator run (one validation), in seconds (what each total covers: docs/monitoring.md)."""

    iterations: int = 0
    network_calls: int = 0
    windows: int = 0
    network_s: float = 0.0
    sliding_window_s: float = 0.0
    before_s: float = 0.0
    after_s: float = 0.0

    @property
    def iteration_s(self) -> float:
        return self.network_s + self.sliding_window_s + self.before_s + self.after_s

    def as_dict(self) -> dict:
        return {**asdict(self), "iteration_s": self.iteration_s}


class InferenceSplit(EngineHandler):
    """Splits an evaluator's iterations into network time and sliding-window time around it.

    Attach it after the evaluator's metrics; a shared network is timed for validation only.
    See docs/monitoring.md.

    Args:
        network: the module the inferer calls; default the engine's ``network`` (`ValueError` at attach: none).
        logger: where the per-run line (debug level) and warnings go; default ``monai_fast.handlers``.

    Examples:
        >>> split = InferenceSplit()
        >>> split.attach(evaluator)  # doctest: +SKIP
    """

    def __init__(self, network: torch.nn.Module | None = None, logger: logging.Logger | None = None) -> None:
        if network is not None and not isinstance(network, torch.nn.Module):
            raise ValueError(f"network must be a torch.nn.Module, got {type(network).__name__}")
        super().__init__()
        self.network = network
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.runs: list[InferenceTimes] = []
        self._hooks: list = []
        self._thread: int | None = None  # the thread whose iteration is timed
        self._device = None
        self._totals = InferenceTimes()
        self._start: Mark | None = None
        self._calls: list[list[Mark]] = []
        self._forward_done: Mark | None = None
        self._warned = False

    def _attach(self, engine: Engine) -> None:
        net = self.network if self.network is not None else getattr(engine, "network", None)
        if not isinstance(net, torch.nn.Module):
            raise ValueError(
                "InferenceSplit: the engine has no `network` attribute (not a MONAI evaluator); "
                "pass network=<the module the inferer calls>"
            )
        self._device = getattr(engine.state, "device", None)
        self._hooks = [net.register_forward_pre_hook(self._before_call), net.register_forward_hook(self._after_call)]
        self.on(engine, Events.EPOCH_STARTED, self._run_started)
        self.on(engine, Events.ITERATION_STARTED, self._iteration_started)
        # MONAI's engines fire FORWARD_COMPLETED right after the inferer returns; a plain ignite Engine has none
        with contextlib.suppress(ValueError):
            self.on(engine, IterationEvents.FORWARD_COMPLETED, self._forward_completed)
        self.on(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self.on(engine, Events.EPOCH_COMPLETED, self._run_completed)

    def _detached(self, engine: Engine) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before_call(self, module: torch.nn.Module, args: tuple) -> None:
        if self._thread == threading.get_ident():
            windows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 else 1
            self._calls.append([time_mark(self._device), None, windows])

    def _after_call(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._thread == threading.get_ident() and self._calls and self._calls[-1][1] is None:
            self._calls[-1][1] = time_mark(self._device)

    def _run_started(self, engine: Engine) -> None:
        self._totals = InferenceTimes()

    def _iteration_started(self, engine: Engine) -> None:
        self._thread = threading.get_ident()
        self._calls, self._forward_done = [], None
        self._start = time_mark(self._device)

    def _forward_completed(self, engine: Engine) -> None:
        self._forward_done = time_mark(self._device)

    def _iteration_completed(self, engine: Engine) -> None:
        end = time_mark(self._device)
        self._thread = None
        t, calls = self._totals, [c for c in self._calls if c[1] is not None]
        t.iterations += 1
        if not calls:
            t.after_s += seconds_between(self._start, end)
            return
        network = sum(seconds_between(a, b) for a, b, _ in calls)
        inferer_end = self._forward_done if self._forward_done is not None else calls[-1][1]
        t.network_calls += len(calls)
        t.windows += sum(n for _, _, n in calls)
        t.network_s += network
        t.sliding_window_s += max(0.0, seconds_between(calls[0][0], inferer_end) - network)
        t.before_s += seconds_between(self._start, calls[0][0])
        t.after_s += seconds_between(inferer_end, end)

    def _run_completed(self, engine: Engine) -> None:
        t = self._totals
        self.runs.append(t)
        if t.iterations and not t.network_calls and not self._warned:
            self._warned = True
            self.logger.warning(
                "InferenceSplit: the hooked network was not called during this run; pass "
                "network=<the module the inferer calls> (a compiled or wrapped copy?)"
            )
        add_row(engine, Kind.EPOCH, Source.INFERENCE, **t.as_dict())
        if t.iteration_s > 0:
            self.logger.debug(
                "InferenceSplit: %d iterations in %.2f s: network %.0f%%, sliding window around it %.0f%%, "
                "before %.0f%%, after %.0f%%",
                t.iterations,
                t.iteration_s,
                *(100 * part / t.iteration_s for part in (t.network_s, t.sliding_window_s, t.before_s, t.after_s)),
            )
