"""``torch.compile`` for the trainer's network, where it measures faster and pays back within the run.

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
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.throughput import batch_shape
from monai_fast.telemetry import device_description
from monai_fast.tune.measure import training_step_s
from monai_fast.tune.result import model_signature
from monai_fast.tune.rounds import Decision, decide, decided_on_rank0, network_copy
from monai_fast.tune.store import TuneStore, default_store_path

__all__ = ["COLD_COMPILE_S", "EXPECTED_GAIN", "MIN_GAIN", "CompileChoice", "strip_meta"]

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
    """Compiles the trainer's network (``torch.compile``) when a copy of it measured faster compiled.

    At the first iteration copies of the network are timed eager and compiled in interleaved rounds
    (`monai_fast.tune.rounds.decide`); the real network is compiled only when the compiled step was
    faster and the rest of the planned run repays the compile (a run too short to repay `COLD_COMPILE_S`,
    or the time measured here before, at `EXPECTED_GAIN` is left eager). Only training iterations run
    compiled; parameters and ``state_dict`` keys are unchanged. The rules are in docs/fast-training.md.

    Args:
        mode: ``"auto"`` (measure), ``True`` (compile without measuring) or ``False`` (never).
        dtype: the run's autocast dtype, asked at the first iteration (``None``: fp32).
        compile_seconds: the compile time to expect (``None``: the one measured here before for the same
            network, input shape, precision, device and torch, read from ``store``; else `COLD_COMPILE_S`).
        on_choice: called once with ``(compiled, reason, evidence)`` when the choice is made.
        store: the `TuneStore` file that keeps the compile times measured (``"default"``:
            `default_store_path()`; ``None``: none kept).

    Raises:
        ValueError: ``mode`` is not ``"auto"``, ``True`` or ``False``.

    Examples:
        >>> from ignite.engine import Engine
        >>> choice = CompileChoice(False)
        >>> choice.attach(Engine(lambda e, b: None))
        >>> choice.compiled
        False
    """

    def __init__(
        self,
        mode: Literal["auto"] | bool = "auto",
        dtype: Callable[[], torch.dtype | None] | None = None,
        compile_seconds: float | None = None,
        on_choice: Callable[[bool, str, dict[str, Any]], None] | None = None,
        store: str | os.PathLike | None = "default",
    ) -> None:
        if not (isinstance(mode, bool) or mode == "auto"):
            raise ValueError(f"CompileChoice: mode must be 'auto', True or False, got {mode!r}")
        super().__init__()
        self.mode, self.dtype, self.compile_seconds, self.on_choice = mode, dtype, compile_seconds, on_choice
        self.store = None if store is None else TuneStore(default_store_path() if store == "default" else store)
        self.compiled = False
        self.reason = "not decided yet"
        self.evidence: dict[str, Any] = {}
        self._hook: Any = None
        self._network: torch.nn.Module | None = None
        self._forward: Callable[..., Any] | None = None

    def _attach(self, engine: Engine) -> None:
        if self.mode is False:
            self.reason = "switched off"
            return
        self.on(engine, Events.ITERATION_STARTED(once=1), self._choose)
        self.on(engine, Events.ITERATION_STARTED, self._compiled_forward)
        self.on(engine, Events.ITERATION_COMPLETED, self._eager_forward, first=True)  # before any validation

    def _detached(self, engine: Engine) -> None:
        """The network eager again (a detached handler leaves nothing behind)."""
        self._eager_forward()
        if self._hook is not None:
            self._hook.remove()
        self._network = self._hook = self._forward = None
        self.compiled = False

    def _compiled_forward(self) -> None:
        if self._network is not None:
            self._network.forward = self._forward  # an instance attribute: parameters and state_dict keys unchanged

    def _eager_forward(self) -> None:
        if self._network is not None:
            self._network.__dict__.pop("forward", None)

    # ------------------------------------------------------------------ the choice
    def _choose(self, engine: Engine) -> None:
        network = getattr(engine, "network", None)
        net = getattr(network, "module", network)  # DDP / DataParallel: compile what they call
        shape = batch_shape(engine.state.batch)
        dtype = self.dtype() if self.dtype is not None else None
        state = engine.state
        planned = state.max_epochs * state.epoch_length if state.max_epochs and state.epoch_length else None
        remaining = None if planned is None else max(1, planned - state.iteration + 1)
        device = torch.device(getattr(state, "device", None) or "cpu")
        compiled, reason, evidence = decided_on_rank0(
            lambda: self._decide(net, shape, dtype, remaining, device), device
        )
        if compiled:
            try:
                self._compile(net, fullgraph=bool(evidence.get("fullgraph")))
            except Exception as e:  # noqa: BLE001 - a compiler failure leaves the run eager, said once
                compiled, reason = False, f"eager kept: torch.compile failed on the network ({type(e).__name__}: {e})"
        self.compiled, self.reason, self.evidence = compiled, reason, evidence
        (logger.info if compiled or "failed" not in reason else logger.warning)("CompileChoice: %s", reason)
        if self.on_choice is not None:
            self.on_choice(compiled, reason, evidence)

    def _compile(self, net: torch.nn.Module, fullgraph: bool) -> None:
        """The compiled forward, put in place for the training iterations (from this one on)."""
        self._forward = torch.compile(net.forward, fullgraph=fullgraph)
        self._hook = net.register_forward_pre_hook(strip_meta, with_kwargs=True)
        self._network = net
        self._compiled_forward()

    def _decide(
        self,
        net: torch.nn.Module | None,
        shape: torch.Size | None,
        dtype: torch.dtype | None,
        planned: int | None,
        device: torch.device,
    ) -> tuple[bool, str, dict[str, Any]]:
        """``(compile?, reason, evidence)``; ``planned``: the training steps left in the run (``None``: unknown)."""
        if not isinstance(net, torch.nn.Module):
            return False, "eager kept: the engine has no network to compile", {}
        if shape is None:
            return False, "eager kept: the batch has no image tensor to measure with", {}
        if self.mode is True:
            return True, "compiled as requested", {"fullgraph": False}
        x = torch.randn(torch.Size([min(shape[0], 2), *shape[1:]]), device=device)
        eager = network_copy(net).to(device).train()
        eager_s = training_step_s(eager, x, dtype)  # warm-up: allocator, kernel choice
        eager_s = min(eager_s, training_step_s(eager, x, dtype))
        key = _compile_key(net, x.shape, dtype, device)
        known = self.compile_seconds
        if known is None and self.store is not None:
            known = self.store.seconds(key)
        expected_compile_s = known if known is not None else COLD_COMPILE_S
        if planned is not None:
            saving_s = planned * eager_s * (1 - 1 / EXPECTED_GAIN)
            if saving_s < expected_compile_s:
                return (
                    False,
                    f"eager kept: {planned} steps left of {eager_s:.3f} s would save about {saving_s:.0f} s at "
                    f"{EXPECTED_GAIN}x, less than a compile's {expected_compile_s:.0f} s "
                    f"({'measured here before' if known is not None else 'assumed for a first compile'})",
                    {"eager_step_s": eager_s, "planned_steps": planned, "expected_compile_s": expected_compile_s},
                )
        compiled = network_copy(net).to(device).train()
        started = time.perf_counter()
        graph_break = None
        try:
            compiled.forward = torch.compile(compiled.forward, fullgraph=True)
            training_step_s(compiled, x, dtype)
        except Exception as e:  # noqa: BLE001 - a graph break (or a compiler failure: tried again below)
            graph_break = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            compiled = network_copy(net).to(device).train()
            try:
                compiled.forward = torch.compile(compiled.forward)
                training_step_s(compiled, x, dtype)
            except Exception as e2:  # noqa: BLE001 - no compiler here: eager, said once
                return False, f"eager kept: torch.compile failed ({type(e2).__name__}: {e2})", {}
        compile_s = time.perf_counter() - started
        if self.store is not None:
            self.store.put_seconds(key, compile_s)  # a later run's pay-back gate reads it
        d: Decision = decide(
            lambda: training_step_s(eager, x, dtype),
            lambda: training_step_s(compiled, x, dtype),
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
            "rounds": d.as_row(),
        }
        breaks = "one graph" if graph_break is None else f"graph breaks (the first: {graph_break})"
        return d.chose_candidate, f"{d.reason}; compiling took {compile_s:.1f} s, {breaks}", evidence


def _compile_key(net: torch.nn.Module, shape: torch.Size, dtype: torch.dtype | None, device: torch.device) -> str:
    """What a compile time depends on: the network, the input shape, precision, device and torch."""
    where = device_description(device).split(" (")[0]
    return f"compile|{model_signature(net)}|{tuple(shape)}|{dtype}|{where}|torch {torch.__version__}"
