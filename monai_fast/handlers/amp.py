"""Mixed precision you can switch at runtime on a MONAI engine, with a safe fallback to fp32."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents
from monai.inferers import Inferer

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
        with torch.autocast(t.device_type, dtype=t.autocast_dtype):
            out = self.inner(inputs, network, *args, **kwargs)
        # the loss and post-processing run outside autocast: give them fp32, as autocast would
        return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


class AMPToggle:
    """Autocast on a MONAI ``SupervisedTrainer`` / ``SupervisedEvaluator`` that can change at runtime.

    MONAI's ``amp=True`` is fixed at construction, always autocasts for ``"cuda"`` and offers no
    way out when the loss turns non-finite. This handler wraps the engine's inferer in
    ``torch.autocast`` for the engine's device (so bf16 also works on a CPU), and:

    * picks the precision: ``"auto"`` is bf16 on GPUs that support it, else fp16 with a
      ``GradScaler`` (through MONAI's own scaler path); on a CPU, bf16 only with bf16 matrix
      hardware and a measured gain, else fp32
      (:func:`~monai_fast.telemetry.precision.choose_precision`);
    * switches on and off per epoch with ``schedule(epoch) -> bool``, or by :meth:`enable` /
      :meth:`disable`;
    * checks each loss: a non-finite loss skips its optimizer step (gradients dropped; with fp16
      the scaler skips it) and is counted; fp16 overflows (the scaler lowering its scale) are
      counted too;
    * after ``max_nonfinite`` non-finite losses in a row, falls back to fp32 for the rest of the
      run and logs a warning.

    Counts are on the handler (:attr:`stats`), per epoch in the run record, and in its summary.
    :meth:`state_dict` holds the chosen precision, the fallback and the counts, so an
    ``ignite.handlers.Checkpoint`` that includes the handler resumes in the same precision
    (loaded before :meth:`attach`, nothing is measured again).

    Args:
        dtype: ``"auto"``, ``"bf16"``, ``"fp16"`` (CUDA only) or ``"fp32"`` (autocast off, the
            non-finite guard stays).
        schedule: ``epoch -> bool``, called at each epoch's start; ``None`` keeps it on.
        max_nonfinite: consecutive non-finite losses before the fallback to fp32.

    Example:
        >>> from monai_fast.handlers import AMPToggle
        >>> amp = AMPToggle("auto", schedule=lambda epoch: epoch > 1)  # fp32 for the first epoch
        >>> amp.attach(trainer)  # doctest: +SKIP
        >>> Checkpoint({"trainer": trainer, "amp": amp}, DiskSaver("ckpt"))  # doctest: +SKIP
    """

    def __init__(
        self,
        dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto",
        schedule: Callable[[int], bool] | None = None,
        max_nonfinite: int = 3,
    ) -> None:
        if dtype not in REQUESTS:
            raise ValueError(f"dtype must be 'auto', 'bf16', 'fp16' or 'fp32', got {dtype!r}")
        if schedule is not None and not callable(schedule):
            raise TypeError("schedule must be callable: epoch -> bool")
        if max_nonfinite < 1:
            raise ValueError(f"max_nonfinite must be >= 1, got {max_nonfinite}")
        self.requested = dtype
        self.schedule = schedule
        self.max_nonfinite = max_nonfinite
        self.enabled = True
        self.fell_back = False
        self.precision = "fp32"
        self.device_type = "cpu"
        self.autocast_dtype = torch.bfloat16
        self.stats = {"nonfinite": 0, "skipped_steps": 0, "overflows": 0}
        self._streak = 0
        self._engine: Engine | None = None
        self._scale_before: float | None = None
        self._epoch_counts = dict(self.stats)
        self._restored = False

    def state_dict(self) -> dict[str, Any]:
        """The chosen precision, whether it fell back to fp32, the on/off switch and the counts."""
        return {
            "precision": self.precision,
            "fell_back": self.fell_back,
            "enabled": self.enabled,
            "streak": self._streak,
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`attach` it replaces the precision decision.

        Raises:
            ValueError: for an unknown precision in ``state``.
        """
        if state["precision"] not in PRECISIONS:
            raise ValueError(f"AMPToggle state holds an unknown precision {state['precision']!r}")
        self.precision = state["precision"]
        self.fell_back = bool(state["fell_back"])
        self.enabled = bool(state["enabled"])
        self._streak = int(state["streak"])
        self.stats = {k: int(state["stats"][k]) for k in self.stats}
        self._epoch_counts = dict(self.stats)
        self._restored = True
        self.autocast_dtype = autocast_dtype(self.precision)
        e = self._engine
        if e is not None and self.precision == "fp16" and hasattr(e, "optimizer") and getattr(e, "scaler", None) is None:
            e.scaler = torch.amp.GradScaler("cuda")
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
        """Switch autocast off until :meth:`enable`."""
        self.enabled = False
        self._apply()

    def attach(self, engine: Engine) -> None:
        """Take over precision on a MONAI engine.

        Raises:
            TypeError: if ``engine`` has no ``inferer`` (not a MONAI trainer/evaluator).
            RuntimeError: if already attached.
        """
        if self._engine is not None:
            raise RuntimeError("AMPToggle is already attached; make one per engine")
        if not isinstance(getattr(engine, "inferer", None), Inferer):
            raise TypeError("AMPToggle needs a MONAI SupervisedTrainer or SupervisedEvaluator (an engine with an inferer)")
        device = torch.device(getattr(engine.state, "device", None) or "cpu")
        if not self._restored:  # a resumed run keeps the precision its checkpoint chose
            self.precision = choose_precision(self.requested, device)
        self.device_type = device.type
        self.autocast_dtype = autocast_dtype(self.precision)
        self._engine = engine
        engine.inferer = _AutocastInferer(engine.inferer, self)
        trains = hasattr(engine, "optimizer")
        if trains and self.precision == "fp16" and getattr(engine, "scaler", None) is None:
            engine.scaler = torch.amp.GradScaler("cuda")
        self._apply()
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        if trains:
            engine.add_event_handler(Events.ITERATION_STARTED, self._iteration_started)
            engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self._check_loss)
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        logger.info("AMPToggle: %s on %s", self.precision, device)

    def _apply(self) -> None:
        # MONAI's own autocast is hard-wired to "cuda": keep it off and use ours (the inferer);
        # its amp flag only selects the GradScaler path, which fp16 needs
        e = self._engine
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

    def _check_loss(self, engine: Engine) -> None:
        loss = engine.state.output["loss"]
        if bool(torch.isfinite(loss).all()):
            self._streak = 0
            return
        self.stats["nonfinite"] += 1
        self._streak += 1
        if not engine.amp:  # the GradScaler skips such a step by itself
            engine.optimizer.zero_grad(set_to_none=True)
            self.stats["skipped_steps"] += 1
        if self._streak >= self.max_nonfinite and not self.fell_back and self.active:
            self.fell_back = True
            self._apply()
            logger.warning(
                "AMPToggle: %d non-finite losses in a row at iteration %d; falling back to fp32 for the rest of the run",
                self._streak, engine.state.iteration,
            )
            if (record := record_of(engine)) is not None:
                record.add("event", "amp", what="fallback_to_fp32", iteration=engine.state.iteration)

    def _iteration_completed(self, engine: Engine) -> None:
        if self._scale_before is not None:
            scaler = engine.scaler
            if scaler.get_scale() < self._scale_before:  # the scaler found inf/nan and skipped the step
                self.stats["overflows"] += 1

    def _epoch_completed(self, engine: Engine) -> None:
        row = {k: self.stats[k] - self._epoch_counts[k] for k in self.stats}
        if (record := record_of(engine)) is not None:
            record.add("epoch", "amp", epoch=engine.state.epoch, precision=self.precision, active=self.active, **row)
            record.set_summary("amp", {"precision": self.precision, "fell_back": self.fell_back, **self.stats})
