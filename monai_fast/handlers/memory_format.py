"""Choose the network's memory format (``channels_last_3d`` or contiguous) by measuring it both ways.

``channels_last_3d`` speeds 3D convolutions up on some devices and precisions and slows them down
on others, so each layout is timed in interleaved rounds (`monai_fast.tune.rounds`); a near-tie
keeps the network's own layout. `LayoutChoice` times the run's own iterations, whole batch and
optimizer included, at no cost beyond the slower layout's; `choose_memory_format` times copies of
the network (the real one untouched) where a run's iterations cannot alternate, as under DDP, whose
gradient buckets keep the layout they were built in (rank 0 decides, every rank takes its answer).

Examples:
    >>> import torch
    >>> from monai_fast.handlers.memory_format import choose_memory_format
    >>> net = torch.nn.Conv3d(1, 4, 3)
    >>> batch = {"image": torch.zeros(2, 1, 8, 8, 8)}
    >>> choose_memory_format(net, batch, "cpu", None, "contiguous")[0]
    'contiguous'
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.throughput import batch_shape
from monai_fast.telemetry.cuda import synchronize
from monai_fast.telemetry.memory import is_out_of_memory
from monai_fast.tune.measure import training_step_s
from monai_fast.tune.rounds import (
    MIN_ROUNDS,
    Decision,
    at_measure_batch,
    decide,
    decided_on_rank0,
    judge,
    network_copy,
    settled,
)

__all__ = [
    "MEMORY_FORMATS",
    "LayoutChoice",
    "choose_memory_format",
    "in_channels_last_3d",
    "layout_pinned",
    "layouts_of",
    "to_layout",
]

#: the layouts by the names the choice and the run record use
MEMORY_FORMATS = {"channels_last_3d": torch.channels_last_3d, "contiguous": torch.contiguous_format}


def layout_pinned(network: Any) -> str | None:
    """Why ``network``'s weights must keep their layout, else None: a ``DistributedDataParallel`` built with
    ``find_unused_parameters=True`` (and no static graph) never rebuilds its gradient buckets, so weights moved
    after it was built would have every gradient copied across layouts for the rest of the run.

    Examples:
        >>> layout_pinned(torch.nn.Conv3d(1, 4, 3)) is None
        True
    """
    ddp = isinstance(network, torch.nn.parallel.DistributedDataParallel)
    if ddp and network.find_unused_parameters and not network.static_graph:
        return (
            "DistributedDataParallel(find_unused_parameters=True) keeps its gradient buckets in the layout it was "
            "built in (move the network to channels_last_3d before wrapping it)"
        )
    return None


def in_channels_last_3d(network: torch.nn.Module) -> bool:
    """Whether all the network's 5-D weights are in ``channels_last_3d``, at least one unambiguously.

    A weight with one input channel has the same strides in both layouts, so it decides nothing.

    Examples:
        >>> in_channels_last_3d(torch.nn.Conv3d(2, 4, 3).to(memory_format=torch.channels_last_3d))
        True
        >>> in_channels_last_3d(torch.nn.Conv3d(1, 4, 3))
        False
    """
    weights = [p for p in network.parameters() if p.dim() == 5]
    last = [p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights]
    return all(last) and any(is_last and not p.is_contiguous() for p, is_last in zip(weights, last, strict=True))


def layouts_of(network: Any) -> tuple[str, str]:
    """``(the layout network's weights are in, the other one)``, a DDP wrapper looked through.

    Examples:
        >>> layouts_of(torch.nn.Conv3d(2, 4, 3))
        ('contiguous', 'channels_last_3d')
    """
    last = in_channels_last_3d(getattr(network, "module", network))
    return ("channels_last_3d", "contiguous") if last else ("contiguous", "channels_last_3d")


def _step_in_channels_last(network: torch.nn.Module, shape: Any, device: torch.device, dtype: Any) -> None:
    """One training step of a copy of ``network`` in ``channels_last_3d``: raises where the network cannot train in
    it (a 4-D weight, a ``view`` of a convolution's output, the memory)."""
    last = network_copy(network).to(device).train().to(memory_format=torch.channels_last_3d)
    training_step_s(last, torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last_3d), dtype)


def _rejection(e: Exception) -> str:
    what = "out of memory trying it" if is_out_of_memory(e) else "the network rejects channels_last_3d"
    return f"{what} ({type(e).__name__}: {str(e).strip()[:200]})"


def _unmeasured(network: Any, batch: Any, request: str) -> tuple[str, str] | None:
    """``(layout, reason)`` where nothing needs measuring (a pinned layout, a request, no 5-D input), else None."""
    own = layouts_of(network)[0]
    if pinned := layout_pinned(network):
        return own, f"layout kept: {pinned}"
    if request == "contiguous":
        return "contiguous", "the default layout requested"
    if request == "channels_last_3d" and own == "channels_last_3d":
        return "channels_last_3d", "requested (the weights are in it already)"
    found = batch_shape(batch)
    if found is None or len(found) != 5:
        return "contiguous", "the inputs are not 5-D volumes (N, C, D, H, W): nothing to reorder"
    return None


def choose_memory_format(
    network: torch.nn.Module,
    batch: Any,
    device: torch.device | str,
    dtype: torch.dtype | None,
    request: str = "auto",
    rounds: int = 5,
    planned_steps: int | None = None,
    left_s: float | None = None,
) -> tuple[str, str, dict[str, Any] | None]:
    """``("channels_last_3d" | "contiguous", reason, evidence)`` for ``network`` on batches like ``batch``.

    Args:
        network: the network (a DDP wrapper is looked through); only copies of it are run.
        batch: a batch as the engine sees it; its image tensor gives the shape.
        device: where the network trains.
        dtype: the autocast dtype of the run, ``None`` for fp32.
        request: ``"auto"`` (measure), ``"channels_last_3d"`` (use it if the network accepts it)
            or ``"contiguous"``.
        rounds: interleaved rounds per layout, at most (at least three are always run, or none).
        planned_steps: the run's planned training iterations (epochs x epoch length), which bound the
            measurement's time and say whether it runs at the batch's own size (`measure_batch`);
            ``None``: every round unless the answer is clear, at a batch of at most 2.
        left_s: the run's seconds left under a wall-clock limit (``None``: no limit; `at_measure_batch`).

    Returns:
        The layout, one sentence why, and the measured rounds (`Decision.as_row`, the ``batch`` shape measured
        and ``step_s``, the median step in the layout kept; ``None`` when nothing was measured).
    """
    net = getattr(network, "module", network)  # DDP / DataParallel
    if (kept := _unmeasured(network, batch, request)) is not None:
        return (*kept, None)
    found = batch_shape(batch) or ()  # 5-D: `_unmeasured` answered for any other
    device = torch.device(device)
    names = layouts_of(net)

    def measure_at(n: int) -> list[Any]:
        shape = torch.Size([n, *found[1:]])
        if request == "channels_last_3d":  # one step in it: does the network accept the layout?
            _step_in_channels_last(net, shape, device, dtype)
            return ["channels_last_3d", "requested (the network accepts it)", None]
        copies = {name: network_copy(net).to(device).train().to(memory_format=f) for name, f in MEMORY_FORMATS.items()}
        x = torch.randn(shape, device=device)
        xs = {"contiguous": x, "channels_last_3d": x.contiguous(memory_format=torch.channels_last_3d)}
        measured = decide(
            *(functools.partial(training_step_s, copies[n], xs[n], dtype) for n in names),
            names=names,
            max_rounds=max(3, rounds),
            planned_steps=planned_steps,
        )
        kept = measured.names.index(measured.choice)
        step_s = round(statistics.median(r[kept] for r in measured.rounds), 6) if measured.rounds else None
        return [
            measured.choice,
            f"{measured.reason} (batch {tuple(shape)})",
            {**measured.as_row(), "batch": list(shape), "step_s": step_s},
        ]

    def measure() -> list[Any]:
        try:  # the run's own batch where the plan affords it, else (or where that runs out of memory) 2 items
            return at_measure_batch(measure_at, found[0], planned_steps, left_s)
        except Exception as e:  # noqa: BLE001 - a network that rejects the layout keeps its own
            return ["contiguous", _rejection(e), None]

    layout, reason, evidence = decided_on_rank0(measure, device)
    return layout, reason, evidence


def to_layout(network: torch.nn.Module, optimizer: Any, layout: str) -> None:
    """``network`` (weights and gradients) in ``layout``, and ``optimizer``'s per-weight state in its weight's
    strides; the same values (an optimizer's elementwise update then reads matching strides).

    Examples:
        >>> net = torch.nn.Conv3d(2, 4, 3)
        >>> to_layout(net, None, "channels_last_3d"); in_channels_last_3d(net)
        True
    """
    network.to(memory_format=MEMORY_FORMATS[layout])
    state = getattr(optimizer, "state", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or not state:
        return
    for param in network.parameters():
        for key, value in state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                state[param][key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)


class LayoutChoice(EngineHandler):
    """Chooses a trainer's network layout by alternating the run's own iterations between the network's
    layout and ``channels_last_3d`` (or back), and keeps the faster.

    From the first iteration, one untimed iteration in each layout, then interleaved rounds of one timed
    iteration each (the order alternating; batches of the first batch's shape only), judged by `judge` as
    soon as `settled` (at least `MIN_ROUNDS`), else at ``max_rounds`` or the run's end. The network, its
    gradients and the optimizer's state move together, with the same values, so the run trains on as it
    would have. A run whose plan cannot hold `MIN_ROUNDS` rounds, or that ends before them, keeps the
    network's layout. Under DDP, and for a layout requested, `choose_memory_format` decides at the first
    iteration instead.

    Args:
        request: ``"auto"``, ``"channels_last_3d"`` or ``"contiguous"``.
        dtype: asked at the first iteration: the run's autocast dtype (for `choose_memory_format`).
        on_choice: called once with ``(layout, reason, evidence)``.
        max_rounds: the most timed rounds (>= `MIN_ROUNDS`).
        seconds_left: asked at the first iteration: the run's seconds left under a time limit (``None``: none).

    Examples:
        >>> choice = LayoutChoice(on_choice=print)
        >>> choice.attach(trainer)  # doctest: +SKIP
        >>> trainer.run()  # doctest: +SKIP
        contiguous contiguous kept: channels_last_3d measured 0.99x median over 3 rounds, ... {...}
    """

    def __init__(
        self,
        request: str = "auto",
        dtype: Callable[[], torch.dtype | None] | None = None,
        on_choice: Callable[[str, str, dict[str, Any] | None], None] | None = None,
        max_rounds: int = 5,
        seconds_left: Callable[[], float | None] | None = None,
    ) -> None:
        if request not in ("auto", *MEMORY_FORMATS):
            raise ValueError(
                f"LayoutChoice: request must be 'auto', 'channels_last_3d' or 'contiguous', got {request!r}"
            )
        if max_rounds < MIN_ROUNDS:
            raise ValueError(f"LayoutChoice: max_rounds must be >= {MIN_ROUNDS}, got {max_rounds}")
        super().__init__()
        self.request, self.dtype, self.on_choice, self.max_rounds = request, dtype, on_choice, max_rounds
        self.seconds_left = seconds_left
        #: the layout kept (``None`` until chosen), why, and the measurement behind it
        self.layout: str | None = None
        self.reason = ""
        self.evidence: dict[str, Any] | None = None
        self._names: tuple[str, str] = ("contiguous", "channels_last_3d")  # (the network's, the other)
        self._plan: list[int] = []  # per iteration still to time: 0 (the network's layout) or 1
        self._timed: dict[int, float] = {}  # the current round's seconds, by way
        self._warmup: list[float] = []
        self.rounds: list[tuple[float, float]] = []
        self._open: tuple[int, float] | None = None  # (way, start) of the iteration running
        self._device = torch.device("cpu")
        self._shape: tuple[int, ...] | None = None  # the first batch's: only batches of its shape are timed
        self._skipped = 0  # batches of another shape, not timed

    @property
    def chosen(self) -> bool:
        """Whether the layout is chosen (other measurements of the step wait for it)."""
        return self.layout is not None

    def step(self) -> tuple[int, float] | None:
        """``(items, seconds)`` of the step measured in the layout kept (``None``: none was measured)."""
        evidence = self.evidence or {}
        return (evidence["batch"][0], evidence["step_s"]) if evidence.get("step_s") else None

    def _detached(self, engine: Engine) -> None:
        """Detached while measuring: the network (and its optimizer's state) back in its own layout."""
        if not self.chosen and (self._plan or self._warmup):
            to_layout(engine.network, getattr(engine, "optimizer", None), self._names[0])

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.ITERATION_STARTED, self._before)
        self.on(engine, Events.ITERATION_COMPLETED, self._after, first=True)
        self.on_run_end(engine, self._run_ended)

    def _before(self, engine: Engine) -> None:
        if self.chosen:
            return
        if not self._plan:
            self._begin(engine)
            if self.chosen:
                return
        if batch_shape(engine.state.batch) != self._shape:  # an epoch's short last batch: neither way is timed on it
            self._skipped += 1
            if self._skipped > 2 * (2 + 2 * MIN_ROUNDS):  # batches that keep changing shape: no fair rounds
                self._run_ended(engine, f"{self._skipped} batches differed from the first one's shape")
            return
        way = self._plan[0]
        to_layout(engine.network, getattr(engine, "optimizer", None), self._names[way])
        synchronize(self._device)
        self._open = (way, time.perf_counter())

    def _begin(self, engine: Engine) -> None:
        """At the first iteration: settle what needs no rounds, else plan the warm-ups and the first round."""
        network, state = engine.network, engine.state
        self._device = torch.device(getattr(state, "device", None) or "cpu")
        self._shape = batch_shape(state.batch)
        optimizer = getattr(engine, "optimizer", None)
        if (kept := _unmeasured(network, state.batch, self.request)) is not None:
            to_layout(network, optimizer, kept[0])
            self._settle(engine, *kept, None)
            return
        planned = state.max_epochs * state.epoch_length if state.max_epochs and state.epoch_length else None
        if idist.get_world_size() > 1 or self.request != "auto":
            dtype = self.dtype() if self.dtype is not None else None
            left_s = self.seconds_left() if self.seconds_left is not None else None
            layout, reason, evidence = choose_memory_format(
                network, state.batch, self._device, dtype, self.request, planned_steps=planned, left_s=left_s
            )
            to_layout(network, optimizer, layout)  # both ways: a network in channels_last_3d goes back
            self._settle(engine, layout, reason, evidence)
            return
        self._names = layouts_of(network)
        own = self._names[0]
        need = 2 + 2 * MIN_ROUNDS
        left = None if planned is None else planned - state.iteration + 1
        if left is not None and left < need:
            why = f"the run's {left} iterations cannot hold a warm-up and {MIN_ROUNDS} rounds each way ({need})"
            self._settle(engine, own, f"{own} kept: {why}", None)
            return
        if own == "contiguous" and (why := self._rejected(network)) is not None:
            self._settle(engine, own, f"{own} kept: {why}", None)
            return
        self._plan = [0, 1, 0, 1]

    def _rejected(self, network: torch.nn.Module) -> str | None:
        """Why the network cannot train in ``channels_last_3d`` (one step of a copy on at most 2 items), else
        ``None``; the run's random stream is kept."""
        assert self._shape is not None
        shape = (min(2, self._shape[0]), *self._shape[1:])
        with torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else []):
            try:
                dtype = self.dtype() if self.dtype is not None else None
                _step_in_channels_last(getattr(network, "module", network), shape, self._device, dtype)
            except Exception as e:  # noqa: BLE001 - a network that rejects the layout keeps its own
                return _rejection(e)
        return None

    def settled_at(self, batch: Any) -> bool:
        """Chosen, and ``batch`` of the shape the rounds timed (a step measured after them measures a full one)."""
        return self.chosen and (self._shape is None or batch_shape(batch) == self._shape)

    def _after(self, engine: Engine) -> None:
        if self._open is None:
            return
        synchronize(self._device)
        (way, start), self._open = self._open, None
        seconds = time.perf_counter() - start
        self._plan.pop(0)
        if len(self._warmup) < 2:
            self._warmup.append(seconds)
            return
        self._timed[way] = seconds
        if self._plan:
            return
        self.rounds.append((self._timed[0], self._timed[1]))
        self._timed = {}
        if settled(self.rounds) or len(self.rounds) >= self.max_rounds:
            self._conclude(engine)
        else:
            self._plan = [1, 0] if len(self.rounds) % 2 else [0, 1]

    def _conclude(self, engine: Engine) -> None:
        d: Decision = judge(self.rounds, self._names, warmup=(self._warmup[0], self._warmup[1]))
        to_layout(engine.network, getattr(engine, "optimizer", None), d.choice)
        kept = d.names.index(d.choice)
        shape = list(self._shape or ())
        evidence = {**d.as_row(), "batch": shape, "step_s": round(statistics.median(r[kept] for r in d.rounds), 6)}
        self._settle(engine, d.choice, f"{d.reason} (the run's own iterations, batch {tuple(shape)})", evidence)

    def _run_ended(self, engine: Engine, why: str | None = None) -> None:
        """A run that ends before the rounds settle: judged on `MIN_ROUNDS` or more, else the network's layout."""
        if self.chosen:
            return
        if len(self.rounds) >= MIN_ROUNDS:
            self._conclude(engine)
            return
        if self._plan or self._warmup:  # measuring: back to the network's own layout
            own = self._names[0]
            to_layout(engine.network, getattr(engine, "optimizer", None), own)
            why = why or f"the run ended after {len(self.rounds)} of the {MIN_ROUNDS} rounds needed"
            self._shape = None  # no shape to wait for
        else:
            own = layouts_of(engine.network)[0]
            why = "the run ended before its first iteration"
        self._settle(engine, own, f"{own} kept: {why}", None)

    def _settle(self, engine: Engine, layout: str, reason: str, evidence: dict[str, Any] | None) -> None:
        self.layout, self.reason, self.evidence = layout, reason, evidence
        self._plan, self._open = [], None
        if self.on_choice is not None:
            self.on_choice(layout, reason, evidence)
