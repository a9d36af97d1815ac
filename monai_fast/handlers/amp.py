"""Mixed precision you can switch at runtime on a MONAI engine, with a safe fallback to fp32."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from monai.inferers import Inferer

from monai_fast.handlers.guards import NonFiniteGuard
from monai_fast.handlers.lifecycle import EngineHandler, handlers_on, unwrap_inferer
from monai_fast.handlers.record import record_of
from monai_fast.telemetry.precision import PRECISIONS, REQUESTS, autocast_dtype, choose_precision

__all__ = ["AMPToggle"]

logger = logging.getLogger("monai_fast.handlers")


class _AutocastInferer(Inferer):
    """Runs the engine's own inferer under ``torch.autocast`` while the toggle is on."""

    def __init__(self, inner: Inferer, toggle: AMPToggle) -> None:
        self.inner = inner
        self.toggle = toggle

    def __call__(self, inputs: torch.Tensor, network: Callable, *args: Any, **kwargs: Any) -> Any:
        t = self.toggle
        if not t.active:
            return self.inner(inputs, network, *args, **kwargs)
        t.forwards += 1
        with torch.autocast(t.device_type, dtype=t.autocast_dtype):
            out = self.inner(inputs, network, *args, **kwargs)
        # the loss and post-processing run outside autocast: give them fp32, as autocast would
        return _as_fp32(out)


def _as_fp32(out: Any) -> Any:
    """A floating-point tensor output in fp32 (what the loss and post-processing expect outside autocast)."""
    return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


class _InertHooks:
    """What a pickled network's precision hooks become: they do nothing (the toggle stays with its engine)."""

    def before(self, *args: Any) -> None: ...

    def after(self, *args: Any) -> None: ...


class _NetworkAutocast:
    """Forward hooks that autocast ``engine.network`` for a step of the user's own (``iteration_update=``).

    They act only inside the engine's iterations, on that network object, outside any autocast; output in fp32.
    """

    def __init__(self, toggle: AMPToggle, network: torch.nn.Module) -> None:
        self.toggle = toggle
        self.network = weakref.ref(network)
        self.in_step = False
        self._local = threading.local()
        self._handles = [
            network.register_forward_pre_hook(self.before),
            network.register_forward_hook(self.after, always_call=True),
        ]

    def __deepcopy__(self, memo: dict) -> _NetworkAutocast:
        return self  # a copied network keeps hooks that do nothing for it (see ``network``)

    def __reduce__(self) -> tuple:
        return (_InertHooks, ())

    def before(self, module: torch.nn.Module, args: Any) -> None:
        """Enter autocast for a direct call of the engine's network during its step."""
        stack = self._local.__dict__.setdefault("stack", [])
        t = self.toggle
        if not self.in_step or module is not self.network() or not t.active or torch.is_autocast_enabled(t.device_type):
            stack.append(None)
            return
        ctx = torch.autocast(t.device_type, dtype=t.autocast_dtype)
        ctx.__enter__()
        stack.append(ctx)
        t.forwards += 1

    def after(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """Leave the autocast `before()` entered; the output in fp32."""
        stack = self._local.__dict__.get("stack")
        ctx = stack.pop() if stack else None
        if ctx is None:
            return None
        ctx.__exit__(None, None, None)
        return _as_fp32(output)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class AMPToggle(EngineHandler):
    """Autocast on a MONAI ``SupervisedTrainer`` / ``SupervisedEvaluator`` that can change at runtime.

    Unlike MONAI's ``amp=True`` (fixed, CUDA only) it follows the engine's device; ``schedule(epoch)`` or
    `enable()` / `disable()` switch it; on a trainer it brings a `NonFiniteGuard`. See docs/precision.md.

    Args:
        precision: ``"auto"``, ``"bf16"``, ``"fp16"`` (CUDA only) or ``"fp32"`` (autocast off): `REQUESTS`.
        schedule: ``epoch -> bool``, called at each epoch's start; ``None`` keeps it on.
        max_nonfinite: consecutive non-finite losses before the fallback to fp32.

    Examples:
        >>> amp = AMPToggle("auto", schedule=lambda epoch: epoch > 1)  # fp32 for the first epoch
        >>> amp.attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto",
        schedule: Callable[[int], bool] | None = None,
        max_nonfinite: int = 3,
    ) -> None:
        super().__init__()
        if precision not in REQUESTS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, REQUESTS))}, got {precision!r}")
        if schedule is not None and not callable(schedule):
            raise TypeError("schedule must be callable: epoch -> bool")
        if max_nonfinite < 1:
            raise ValueError(f"max_nonfinite must be >= 1, got {max_nonfinite}")
        self.requested, self.schedule, self.max_nonfinite = precision, schedule, max_nonfinite
        self.enabled, self.fell_back = True, False
        self.precision, self.device_type, self.autocast_dtype = "fp32", "cpu", torch.bfloat16
        self._guard: NonFiniteGuard | None = None
        self._own_guard = False
        self._guard_state: dict[str, Any] = NonFiniteGuard().state_dict()  # counts while no guard is attached
        self._overflows = 0
        self._scale_before: float | None = None
        self._epoch_counts = dict(self.stats)
        self._restored = False
        self._undo: dict[str, Any] = {}
        #: forwards run under this handler's autocast (through the inferer or the network's hooks)
        self.forwards = 0
        #: why the precision did not act on the engine's step (found at its first iteration), else ``None``
        self.unused: str | None = None
        self._checked = False
        self._forwards_before = 0
        self._hooks: _NetworkAutocast | None = None

    def _guard_now(self) -> dict[str, Any]:
        return self._guard.state_dict() if self._guard is not None else self._guard_state

    @property
    def stats(self) -> dict[str, int]:
        """``nonfinite`` losses and ``skipped_steps`` (from the engine's guard), fp16 ``overflows``."""
        g = self._guard_now()["stats"]
        return {"nonfinite": g["nonfinite"], "skipped_steps": g["skipped_steps"], "overflows": self._overflows}

    def state_dict(self) -> dict[str, Any]:
        """The chosen precision, whether it fell back to fp32, the on/off switch and the counts."""
        return {
            "precision": self.precision,
            "fell_back": self.fell_back,
            "enabled": self.enabled,
            "streak": self._guard_now()["streak"],
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`; before `attach()` it replaces the precision decision (`ValueError`: unknown)."""
        if state["precision"] not in PRECISIONS:
            raise ValueError(f"AMPToggle state holds an unknown precision {state['precision']!r}")
        self.precision = state["precision"]
        self.fell_back = bool(state["fell_back"])
        self.enabled = bool(state["enabled"])
        self._overflows = int(state["stats"]["overflows"])
        self._guard_state = {"stats": {**self._guard_state["stats"], **state["stats"]}, "streak": int(state["streak"])}
        self._guard_state["stats"].pop("overflows")
        if self._guard is not None:
            self._guard.load_state_dict(self._guard_state)
        self._epoch_counts = dict(self.stats)
        self._restored = True
        self.autocast_dtype = autocast_dtype(self.precision)
        if self.engine is not None:
            self._scale_fp16(self.engine)
        self._apply()

    @property
    def active(self) -> bool:
        """Whether autocast is on right now."""
        return self.enabled and not self.fell_back and self.precision != "fp32"

    def enable(self) -> None:
        """Switch autocast on (unless it fell back to fp32)."""
        self.enabled = True
        self._apply()

    def disable(self) -> None:
        """Switch autocast off until `enable()`."""
        self.enabled = False
        self._apply()

    def _attach(self, engine: Engine) -> None:
        if not isinstance(getattr(engine, "inferer", None), Inferer):
            raise TypeError(
                "AMPToggle needs a MONAI SupervisedTrainer or SupervisedEvaluator (an engine with an inferer)"
            )
        device = torch.device(getattr(engine.state, "device", None) or "cpu")
        if not self._restored:  # a resumed run keeps the precision its checkpoint chose
            self.precision = choose_precision(self.requested, device)
        self.device_type, self.autocast_dtype = device.type, autocast_dtype(self.precision)
        self._undo = {k: getattr(engine, k, d) for k, d in (("amp", False), ("amp_kwargs", {}), ("scaler", None))}
        engine.inferer = _AutocastInferer(engine.inferer, self)
        network = getattr(engine, "network", None)
        if isinstance(network, torch.nn.Module):
            self._hooks = _NetworkAutocast(self, network)
        self._scale_fp16(engine)
        self._apply()
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        self.on(engine, Events.ITERATION_STARTED, self._step_started)
        # first: an evaluator run from the trainer's ITERATION_COMPLETED is not the trainer's step
        self.on(engine, Events.ITERATION_COMPLETED, self._step_completed, first=True)
        self.on_run_end(engine, self._step_ended)
        if trains := hasattr(engine, "optimizer"):
            self._use_guard(engine)
            self.on(engine, Events.ITERATION_STARTED, self._iteration_started)
            self.on(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        logger.info("AMPToggle: %s on %s for %s", self.precision, device, "training" if trains else "validation")

    def _scale_fp16(self, engine: Engine) -> None:  # a trainer in fp16 needs a GradScaler
        if self.precision == "fp16" and hasattr(engine, "optimizer") and getattr(engine, "scaler", None) is None:
            engine.scaler = torch.amp.GradScaler("cuda")

    def _use_guard(self, engine: Engine) -> None:
        guard = handlers_on(engine).get(NonFiniteGuard)
        self._own_guard = guard is None
        if guard is None:
            guard = NonFiniteGuard(self.max_nonfinite)
            guard.attach(engine)
        if self._restored or self._own_guard:
            guard.load_state_dict(self._guard_state)
        guard.fallback = self._fall_back
        self._guard = guard

    def _step_started(self, engine: Engine) -> None:
        if self._hooks is not None:
            self._hooks.in_step = True
        self._forwards_before = self.forwards

    def _step_completed(self, engine: Engine) -> None:
        self._step_ended(engine)
        if self._checked or not self.active:
            return
        self._checked = True
        if self.forwards == self._forwards_before:
            self.unused = (
                "the engine's step called neither its inferer nor its network outside an autocast of its own "
                "(a step function that calls another module, or autocasts itself)"
            )
            logger.warning(
                "AMPToggle: %s did not act on the first iteration: %s; the step runs as it is written",
                self.precision,
                self.unused,
            )

    def _step_ended(self, engine: Engine) -> None:
        if self._hooks is not None:
            self._hooks.in_step = False

    def _detached(self, engine: Engine) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        # undo the inferer wrapping (also under ClassesInnermost's or another toggle's wrapper) and MONAI's flags
        unwrap_inferer(engine, lambda inferer: isinstance(inferer, _AutocastInferer) and inferer.toggle is self)
        for name, value in self._undo.items():
            if hasattr(engine, name):
                setattr(engine, name, value)
        guard, self._guard = self._guard, None
        if guard is not None:
            self._guard_state = guard.state_dict()
            if guard.fallback == self._fall_back:
                guard.fallback = None
            if self._own_guard:
                guard.detach(engine)
        self._undo = {}

    def _apply(self) -> None:
        # MONAI's own autocast is hard-wired to "cuda": keep it off and use ours (the inferer);
        # its amp flag only selects the GradScaler path, which fp16 needs
        e = self.engine
        if e is None:
            return
        e.amp = self.active and self.precision == "fp16" and getattr(e, "scaler", None) is not None
        e.amp_kwargs = {"enabled": False}

    def _epoch_started(self, engine: Engine) -> None:
        if self.schedule is not None:
            self.enabled = bool(self.schedule(engine.state.epoch))
        self._apply()
        self._epoch_counts = dict(self.stats)

    def _iteration_started(self, engine: Engine) -> None:
        scaler = getattr(engine, "scaler", None)
        self._scale_before = scaler.get_scale() if engine.amp and scaler is not None else None

    def _fall_back(self, engine: Engine) -> bool:
        """The guard's fallback: fp32 for the rest of the run (``False``: off already)."""
        if self.fell_back or not self.active:
            return False
        self.fell_back = True
        self._apply()
        logger.warning(
            "AMPToggle: %d non-finite steps in a row at iteration %d; falling back to fp32 for the rest of the run",
            self._guard.streak if self._guard is not None else 0,
            engine.state.iteration,
        )
        if (record := record_of(engine)) is not None:
            record.add("event", "amp", what="fallback_to_fp32", iteration=engine.state.iteration)
        return True

    def _iteration_completed(self, engine: Engine) -> None:
        # a lower scale: the scaler found inf/nan and skipped the step
        if self._scale_before is not None and engine.scaler.get_scale() < self._scale_before:
            self._overflows += 1

    def _epoch_completed(self, engine: Engine) -> None:
        stats = self.stats
        row = {k: stats[k] - self._epoch_counts[k] for k in stats}
        if (record := record_of(engine)) is not None:
            active = self.active and self.unused is None
            record.add("epoch", "amp", epoch=engine.state.epoch, precision=self.precision, active=active, **row)
            record.set_summary(
                "amp", {"precision": self.precision, "fell_back": self.fell_back, "unused": self.unused, **stats}
            )
