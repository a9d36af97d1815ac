"""``torch.compile`` for a trainer's (or an evaluator's) network, where it measures faster and pays back within the run.

Examples:
    >>> from monai_fast.handlers.compile import CompileChoice
    >>> choice = CompileChoice("auto")
    >>> choice.attach(trainer)  # doctest: +SKIP
    >>> trainer.run()  # doctest: +SKIP
    >>> choice.compiled, choice.reason  # doctest: +SKIP
    (True, 'compiled faster: 1.24x median over 3 rounds, 1.21x-1.27x; ...')
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.memory_format import MEMORY_FORMATS, layout_pinned, layouts_of, to_layout
from monai_fast.handlers.throughput import batch_shape
from monai_fast.telemetry import device_description, synchronize
from monai_fast.telemetry.memory import is_out_of_memory
from monai_fast.tune.measure import inference_call_s, training_step_s
from monai_fast.tune.result import model_signature
from monai_fast.tune.rounds import MIN_GAIN as ROUNDS_MIN_GAIN
from monai_fast.tune.rounds import Decision, at_measure_batch, decide, decided_on_rank0, network_copy
from monai_fast.tune.store import TuneStore, default_store_path

__all__ = ["COLD_COMPILE_S", "EXPECTED_GAIN", "MIN_GAIN", "CompileChoice", "strip_meta", "validations_left"]

logger = logging.getLogger("monai_fast.handlers")

#: the speed-up a compiled training step must show in every round (or in its median, see `decide`)
MIN_GAIN = 1.1
#: the speed-up a compile is expected to bring at best, before anything is measured: a run too short for
#: it to repay `COLD_COMPILE_S` at this gain is not compiled at all
EXPECTED_GAIN = 1.3
#: the compile time assumed for a network never compiled here before (a 3-D UNet's first compile on a CPU
#: takes minutes, with the compiler's cache warm seconds); a compile measured here replaces it
COLD_COMPILE_S = 120.0


def strip_meta(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: MONAI's ``MetaTensor`` inputs as plain tensors, so the compiled graph does not
    recompile for each item's metadata (as ``SupervisedTrainer(compile=True)`` does too)."""
    plain = tuple(a.as_tensor() if isinstance(a, MetaTensor) else a for a in args)
    return plain, {k: v.as_tensor() if isinstance(v, MetaTensor) else v for k, v in kwargs.items()}


class CompileChoice(EngineHandler):
    """Compiles an engine's network (``torch.compile``) when a copy of it measured faster compiled.

    Eager and compiled copies are timed in interleaved rounds; the network is compiled where the compiled step was
    faster and the planned run repays it, parameters and ``state_dict`` keys unchanged (docs/fast-training.md).

    Args:
        mode: ``"auto"`` (measure), ``True`` (compile without measuring) or ``False`` (never).
        dtype: the run's autocast dtype, asked at the choice (``None``: fp32).
        compile_seconds: the compile time to expect (``None``: ``store``'s, else `COLD_COMPILE_S`).
        on_choice: called once with ``(compiled, reason, evidence)``.
        store: the `TuneStore` file for compile times (``"default"``: `default_store_path()`; ``None``: none).
        evaluation: an evaluator: decided after its first iteration, which counts its network's calls.
        runs_left: an evaluator's runs still planned, this one included (``None``: this one).
        seconds_left: the run's wall-clock seconds left, asked at the choice (``None``: no limit).
        memory_formats: a trainer's 3-D network is also compiled in its other layout, and moved where faster.
        eager_step: ``(items, seconds)`` of an eager step measured already, weighed per item before any copy.
        ready: the choice waits for the first iteration (an evaluator's: of a run) at which this says ``True``.

    Raises:
        ValueError: ``mode`` is not ``"auto"``, ``True`` or ``False``.

    Examples:
        >>> choice = CompileChoice("auto")
        >>> choice.attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        mode: Literal["auto"] | bool = "auto",
        dtype: Callable[[], torch.dtype | None] | None = None,
        compile_seconds: float | None = None,
        on_choice: Callable[[bool, str, dict[str, Any]], None] | None = None,
        store: str | os.PathLike | None = "default",
        evaluation: bool = False,
        runs_left: Callable[[], int | None] | None = None,
        seconds_left: Callable[[], float | None] | None = None,
        memory_formats: bool = False,
        eager_step: Callable[[], tuple[int, float] | None] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if not (isinstance(mode, bool) or mode == "auto"):
            raise ValueError(f"CompileChoice: mode must be 'auto', True or False, got {mode!r}")
        super().__init__()
        self.mode, self.dtype, self.compile_seconds, self.on_choice = mode, dtype, compile_seconds, on_choice
        self.store = None if store is None else TuneStore(default_store_path() if store == "default" else store)
        self.evaluation, self.runs_left, self.seconds_left = bool(evaluation), runs_left, seconds_left
        self.memory_formats = bool(memory_formats) and not self.evaluation
        self.eager_step, self.ready = eager_step, ready
        self.compiled = False
        self.reason = "not decided yet"
        self._decided = False
        self._calls: list[tuple[torch.Size, float]] = []  # an evaluator's first iteration: each call's shape, seconds
        self._counter: list[Any] = []
        self._counting = False  # an evaluator's run counts its network's calls (it began ready)
        self._waited = False  # an evaluator's run began before it was ready, since the last `conclude`
        self.evidence: dict[str, Any] = {}
        self._hook: Any = None
        self._network: torch.nn.Module | None = None
        self._forward: Callable[..., Any] | None = None
        self._moved_from: str | None = None  # the layout the network had before the compiled step chose another

    def _attach(self, engine: Engine) -> None:
        if self.mode is False:
            self.reason = "switched off"
            return
        if self.evaluation:  # every run's first iteration: the first one counts the calls, then decides
            self.on(engine, Events.ITERATION_STARTED(once=1), self._count_calls)
            self.on(engine, Events.ITERATION_COMPLETED(once=1), self._choose)
        elif self.ready is None:
            self.on(engine, Events.ITERATION_STARTED(once=1), self._choose)
        else:
            self.on(engine, Events.ITERATION_STARTED, self._choose)
            self.on_run_end(engine, self.conclude)

    def conclude(self, engine: Engine | None = None) -> None:
        """A choice still waiting for ``ready`` says it stays eager: a trainer's for good, at its run's end; an
        evaluator's whose runs all began before it was ready (its owner calls this at the training's run end)
        until a later run that begins ready decides."""
        if self._decided or self.mode is False or (self.evaluation and not self._waited):
            return
        self._decided, self._waited = not self.evaluation, False
        self.reason = (
            "eager kept: every validation so far began before the choice was ready to measure"
            if self.evaluation
            else "eager kept: the run ended before the choice was ready to measure"
        )
        self.evidence = {}
        if self.on_choice is not None:
            self.on_choice(False, self.reason, self.evidence)
        else:
            logger.info("CompileChoice: %s", self.reason)

    def _detached(self, engine: Engine) -> None:
        """The network eager again, in its own layout (a detached handler leaves nothing behind)."""
        self._eager_forward()
        self._restore_layout(self._network, engine)
        for hook in (self._hook, *self._counter):
            if hook is not None:
                hook.remove()
        self._network = self._hook = self._forward = None
        self._counter = []
        self.compiled = self._decided = self._counting = False

    def _restore_layout(self, net: torch.nn.Module | None, engine: Engine) -> None:
        if net is not None and self._moved_from is not None:
            to_layout(net, getattr(engine, "optimizer", None), self._moved_from)
        self._moved_from = None

    def _compiled_forward(self) -> None:
        if self._network is not None and self._forward is not None:
            self._network.forward = self._forward  # an instance attribute: parameters and state_dict keys unchanged

    def _eager_forward(self) -> None:
        if self._network is not None:
            self._network.__dict__.pop("forward", None)

    @staticmethod
    def _net(engine: Engine) -> Any:
        network = getattr(engine, "network", None)
        return getattr(network, "module", network)  # DDP / DataParallel: compile what they call

    def _count_calls(self, engine: Engine) -> None:
        if self._decided:
            return
        if self.ready is not None and not self.ready():
            self._waited = True  # a run of an evaluator that began before it was ready: `conclude` says so
            return
        self._counting, net = True, self._net(engine)
        if not isinstance(net, torch.nn.Module):
            return
        self._calls, began = [], []

        def before(module: torch.nn.Module, args: tuple) -> None:
            began.append(time.perf_counter())

        def after(module: torch.nn.Module, args: tuple, out: Any) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None and began:
                synchronize(x.device)  # the call's real seconds: the compile's pay-back is weighed from them
                self._calls.append((x.shape, time.perf_counter() - began.pop()))

        self._counter = [net.register_forward_pre_hook(before), net.register_forward_hook(after)]

    def _choose(self, engine: Engine) -> None:
        if self._decided or (self.ready is not None and not self.ready()):  # decided, or not yet
            return
        if self.evaluation and not self._counting:  # a run that began before it was ready: the next run decides
            return
        self._decided = True
        net, state = self._net(engine), engine.state
        dtype = self.dtype() if self.dtype is not None else None
        device = torch.device(getattr(state, "device", None) or "cpu")
        left_s = self.seconds_left() if self.seconds_left is not None else None
        if self.evaluation:
            for hook in self._counter:
                hook.remove()
            self._counter = []
            shape = self._calls[0][0] if self._calls else None
            seen_s = statistics.median(s for _, s in self._calls) if self._calls else None  # as the run timed it
            runs = self.runs_left() if self.runs_left is not None else None
            per_run = len(self._calls) * (state.epoch_length or 1)
            remaining = len(self._calls) * ((state.epoch_length or 1) - 1) + per_run * (max(1, runs or 1) - 1)
            # an evaluator may run on one rank only: each rank decides for itself (no gradients to agree on)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's stream kept
                compiled, reason, evidence = self._decide(net, shape, dtype, max(1, remaining), device, seen_s, left_s)
        else:
            shape = batch_shape(state.batch)
            planned = state.max_epochs * state.epoch_length if state.max_epochs and state.epoch_length else None
            remaining = None if planned is None else max(1, planned - state.iteration + 1)

            pinned = layout_pinned(getattr(engine, "network", None)) is not None  # then no layout is measured
            known = self.eager_step() if self.eager_step is not None else None

            def measured(items: int | None) -> tuple[bool, str, dict[str, Any]]:
                seen_s = None if known is None or shape is None else known[1] * (items or shape[0]) / known[0]
                return self._decide(
                    net, shape, dtype, remaining, device, seen_s=seen_s, left_s=left_s, items=items, layouts=not pinned
                )

            compiled, reason, evidence = decided_on_rank0(
                lambda: measured(None) if shape is None else at_measure_batch(measured, shape[0], remaining, left_s),
                device,
            )
        if compiled:
            try:
                layouts = evidence.get("memory_format") or {}
                if layouts and layouts["choice"] == layouts["candidate"]:  # the compiled step is faster in it
                    self._moved_from = layouts["baseline"]
                    to_layout(net, getattr(engine, "optimizer", None), layouts["choice"])
                self._compile(engine, net, fullgraph=bool(evidence.get("fullgraph")))
            except Exception as e:  # noqa: BLE001 - a compiler failure leaves the run eager, said once
                self._restore_layout(net, engine)
                compiled, reason = False, f"eager kept: torch.compile failed on the network ({type(e).__name__}: {e})"
        self.compiled, self.reason, self.evidence = compiled, reason, evidence
        if self.on_choice is not None:  # its caller says it (FastTraining: one line per lever)
            self.on_choice(compiled, reason, evidence)
        else:
            (logger.info if compiled or "failed" not in reason else logger.warning)("CompileChoice: %s", reason)

    def _compile(self, engine: Engine, net: torch.nn.Module, fullgraph: bool) -> None:
        """The compiled forward, put in place for the engine's iterations (a trainer's from this one on).

        The first call compiles; where it fails and the same call runs eager (a compiler missing or
        failing on this network, also with ``mode=True``, which measures nothing first), the run goes on
        eager with one warning; an error the eager forward raises too is the user's and propagates.
        """
        compiled, eager = torch.compile(net.forward, fullgraph=fullgraph), net.forward

        def first_call(*args: Any, **kwargs: Any) -> Any:
            try:
                out = compiled(*args, **kwargs)
            except Exception as e:
                out = eager(*args, **kwargs)  # raises the user's own error, if it is one
                self._give_up(e)
                return out
            self._forward = compiled  # from the next call on, without this check
            self._compiled_forward()
            return out

        self._forward = first_call
        self._hook = net.register_forward_pre_hook(strip_meta, with_kwargs=True)
        self._network = net
        # per iteration only once compiled: an eager network costs the iterations nothing. The trainer's forward
        # goes eager before its own iteration handlers (a validation every N iterations); an evaluator decides
        # while ITERATION_COMPLETED fires, so its hook is added last there
        self.on(engine, Events.ITERATION_STARTED, self._compiled_forward)
        self.on(engine, Events.ITERATION_COMPLETED, self._eager_forward, first=not self.evaluation)
        if not self.evaluation:  # an evaluator decides at its first iteration's end: the next one compiles
            self._compiled_forward()

    def _give_up(self, error: Exception) -> None:
        """Eager from now on, after the compiled forward failed where the eager one ran (inside the step: a layout
        chosen with the compiled step stays, since the step's autograd holds the weights; `_detached` restores it)."""
        self._eager_forward()
        if self._hook is not None:
            self._hook.remove()
        self._hook = self._forward = None
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        self.compiled, self.reason = (
            False,
            f"eager kept: torch.compile failed on the network ({type(error).__name__}: {first})",
        )
        if self.on_choice is not None:
            self.on_choice(False, self.reason, self.evidence)
        else:
            logger.warning("CompileChoice: %s", self.reason)

    def _decide(
        self,
        net: torch.nn.Module | None,
        shape: torch.Size | None,
        dtype: torch.dtype | None,
        planned: int | None,
        device: torch.device,
        seen_s: float | None = None,
        left_s: float | None = None,
        items: int | None = None,
        layouts: bool = True,
    ) -> tuple[bool, str, dict[str, Any]]:
        """``(compile?, reason, evidence)``; ``planned``: the steps (an evaluator's network calls) left in the run;
        ``seen_s``: an eager call's seconds known already (the pay-back is then weighed before measuring);
        ``left_s``: the run's seconds left under its time limit (only the steps that fit in them count); ``items``:
        the items a training step is measured on (`at_measure_batch`'s; ``None``: the whole batch); ``layouts``: the
        network may move to another layout (`memory_formats`)."""
        if not isinstance(net, torch.nn.Module):
            return False, "eager kept: the engine has no network to compile", {}
        if shape is None:
            return False, "eager kept: the batch has no image tensor to measure with", {}
        if self.mode is True:
            return True, "compiled as requested", {"fullgraph": False}
        if self.evaluation:  # the windows as the evaluator batches them, no gradients
            x, step, unit = torch.randn(shape, device=device), inference_call_s, "network calls"
        else:
            x = torch.randn(torch.Size([items or shape[0], *shape[1:]]), device=device)
            step, unit = training_step_s, "steps"

        def copy() -> torch.nn.Module:
            return network_copy(net).to(device).train(not self.evaluation)

        key = _compile_key(net, shape, dtype, device, self.evaluation)  # the run's batch: one key per run shape
        known = self.compile_seconds
        if known is None and self.store is not None:
            known = self.store.seconds(key)
        expected_compile_s = known if known is not None else COLD_COMPILE_S

        part = f" (measured on {x.shape[0]} of the batch's {shape[0]} items)" if x.shape[0] != shape[0] else ""

        def steps_left(step_s: float) -> tuple[int | None, str]:
            """The calls left in the plan, or fewer: those that fit in the time limit's seconds left."""
            if left_s is not None and math.isfinite(left_s):
                fit = max(0, int(left_s / max(step_s, 1e-9)))
                if planned is None or fit < planned:
                    return fit, f" (those that fit in the {left_s:.0f} s left of the run's time limit)"
            return planned, ""

        def repaid(eager_s: float) -> tuple[bool, str, dict[str, Any]] | None:
            """``None`` when the calls left can repay the compile at `EXPECTED_GAIN`, else the answer."""
            steps, within = steps_left(eager_s)
            saving_s = (steps or 0) * eager_s * (1 - 1 / EXPECTED_GAIN)
            if steps is None or saving_s >= expected_compile_s:
                return None
            return (
                False,
                f"eager kept: {steps} {unit} left{within} of {eager_s:.3f} s{part} would save about "
                f"{saving_s:.0f} s at {EXPECTED_GAIN}x, less than a compile's {expected_compile_s:.0f} s "
                f"({'measured here before' if known is not None else 'assumed for a first compile'})",
                {"eager_step_s": eager_s, "planned_steps": steps, "expected_compile_s": expected_compile_s},
            )

        if seen_s is not None and (answer := repaid(seen_s)) is not None:
            return answer  # nothing copied or measured
        eager = copy()
        eager_s = step(eager, x, dtype)  # warm-up: allocator, kernel choice
        eager_s = min(eager_s, step(eager, x, dtype))
        if (answer := repaid(eager_s)) is not None:
            return answer
        compiled = copy()
        started = time.perf_counter()
        graph_break = None
        try:
            compiled.forward = torch.compile(compiled.forward, fullgraph=True)
            step(compiled, x, dtype)
        except Exception as e:  # noqa: BLE001 - a graph break (or a compiler failure: tried again below)
            if is_out_of_memory(e):
                raise
            graph_break = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            compiled = copy()
            try:
                compiled.forward = torch.compile(compiled.forward)
                step(compiled, x, dtype)
            except Exception as e2:  # noqa: BLE001 - no compiler here: eager, said once
                if is_out_of_memory(e2):
                    raise
                return False, f"eager kept: torch.compile failed ({type(e2).__name__}: {e2})", {}
        compile_s = time.perf_counter() - started
        if self.store is not None:
            self.store.put_seconds(key, compile_s)  # a later run's pay-back gate reads it
        d: Decision = decide(
            lambda: step(eager, x, dtype),
            lambda: step(compiled, x, dtype),
            names=("eager", "compiled"),
            min_gain=MIN_GAIN,
            planned_steps=planned,
        )
        evidence = {
            "compile_s": round(compile_s, 3),
            "expected_compile_s": expected_compile_s,
            "fullgraph": graph_break is None,
            "graph_break": graph_break,
            "planned_steps": planned,
            "batch": list(x.shape),  # what was measured: the run's whole batch, or part of it
            "rounds": d.as_row(),
        }
        breaks = "one graph" if graph_break is None else f"graph breaks (the first: {graph_break})"
        reason = f"{d.reason}; compiling took {compile_s:.1f} s, {breaks}"
        eager = None  # its memory, before a second compiled copy
        if d.chose_candidate and self.memory_formats and layouts and x.dim() == 5:
            compiled_step_s = statistics.median(c for _, c in d.rounds)
            steps, _ = steps_left(compiled_step_s)
            if steps is not None and steps * compiled_step_s * (1 - 1 / ROUNDS_MIN_GAIN) >= compile_s:  # repaid
                layouts = self._layouts(net, copy, compiled, x, dtype, planned)
                if layouts is not None:
                    evidence["memory_format"] = {**layouts.as_row(), "reason": layouts.reason}
                    reason = f"{reason}; compiled in both layouts, {layouts.reason}"
        return d.chose_candidate, reason, evidence

    @staticmethod
    def _layouts(
        net: torch.nn.Module,
        copy: Callable[[], torch.nn.Module],
        compiled: torch.nn.Module,
        x: torch.Tensor,
        dtype: torch.dtype | None,
        planned: int,
    ) -> Decision | None:
        """Rounds of the compiled step in the network's layout against a compiled copy in the other one
        (``None`` when that copy does not compile or run)."""
        mine, theirs = layouts_of(net)
        try:  # a 4-D weight refuses channels_last_3d; a compiler or the memory may refuse the copy
            other = copy().to(memory_format=MEMORY_FORMATS[theirs])
            other.forward = torch.compile(other.forward)  # its graph breaks were found on the first layout
            training_step_s(other, x, dtype)
            return decide(
                lambda: training_step_s(compiled, x, dtype),
                lambda: training_step_s(other, x, dtype),
                names=(mine, theirs),
                planned_steps=planned,
            )
        except Exception:  # noqa: BLE001 - the first layout stays
            logger.debug("CompileChoice: %s does not compile or run", theirs, exc_info=True)
            return None


def _compile_key(
    net: torch.nn.Module, shape: torch.Size, dtype: torch.dtype | None, device: torch.device, evaluation: bool
) -> str:
    """What a compile time depends on: the network, training or evaluation, input shape, precision, device, torch."""
    where = device_description(device).split(" (")[0]
    kind = "compile-eval" if evaluation else "compile"
    return f"{kind}|{model_signature(net)}|{tuple(shape)}|{dtype}|{where}|torch {torch.__version__}"


def validations_left(trainer: Engine) -> int | None:
    """The evaluator's runs still planned, the current one included, read at its first run: a first validation
    after epoch ``e`` is taken to repeat every ``e`` epochs (``None``: the trainer's plan is unknown)."""
    epoch, planned = trainer.state.epoch, trainer.state.max_epochs
    if not epoch or not planned:
        return None
    return 1 + max(0, planned - epoch) // epoch
