"""Guards of a run's results: a non-finite loss or gradient never reaches the weights, in any precision, and
ranks decide together (`NonFiniteGuard`, docs/precision.md); an epoch that ends short is an error, not a smaller epoch
(`EpochLengthGuard`, docs/handlers.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from ignite import distributed as idist
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents

from monai_fast.handlers.lifecycle import EngineHandler

__all__ = [
    "EpochLengthGuard",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "ShortEpochError",
    "batch_files",
    "files_with_nonfinite_voxels",
]

logger = logging.getLogger("monai_fast.handlers")


class NonFiniteLossError(RuntimeError):
    """Training stopped on non-finite losses; the message names the iteration, epoch and files."""


def _finite(x: Any) -> bool:
    return not (isinstance(x, torch.Tensor) and x.is_floating_point()) or bool(torch.isfinite(x).all())


def _scaled(engine: Engine) -> bool:
    """Whether the engine steps through an active ``GradScaler``, which skips steps with NaN/Inf gradients."""
    scaler = getattr(engine, "scaler", None)
    return bool(getattr(engine, "amp", False)) and scaler is not None and scaler.is_enabled()


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite.

    One float32 sum per gradient and one host sync per device decide it where the sums are finite (a NaN or Inf
    anywhere makes a sum non-finite); only otherwise are the gradients read element by element, so a finite
    gradient too large for a float32 sum still passes. The sums take a tenth of ``isfinite``'s time.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        sums.setdefault(g.device, []).append(g.sum(dtype=torch.float32))
    if all(bool(torch.stack(found).sum().isfinite()) for found in sums.values()):
        return True
    return all(bool(torch.isfinite(g).all()) for g in grads)


def batch_files(batch: Any, image_key: str = "image") -> list[str] | None:
    """Per sample, the file each sample of a collated MONAI batch came from; ``None`` without metadata."""
    if not isinstance(batch, dict):
        return None
    meta = getattr(batch.get(image_key), "meta", None) or batch.get(f"{image_key}_meta_dict") or {}
    names = meta.get("filename_or_obj") if isinstance(meta, dict) else None
    if isinstance(names, (str, os.PathLike)):
        names = [names]
    return [str(n) for n in names] if names else None


def files_with_nonfinite_voxels(items: Iterable[Any]) -> list[str]:
    """The files (paths in a MONAI datalist) that hold NaN or Inf voxels, read with ``LoadImage``."""
    from monai.transforms import LoadImage

    load, bad = LoadImage(image_only=True), []
    for item in items:
        paths = item.values() if isinstance(item, dict) else [item]
        for path in paths:
            if isinstance(path, (str, os.PathLike)) and not _finite(torch.as_tensor(load(path)).float()):
                bad.append(str(path))
    return bad


class NonFiniteGuard(EngineHandler):
    """Skip steps with a non-finite loss or gradient and stop when they persist (docs/precision.md).

    ``stats`` counts ``nonfinite`` steps (a loss or its gradients), ``skipped_steps`` and ``bad_inputs`` batches
    (agreed across ranks).

    Args:
        max_nonfinite: non-finite steps in a row (finite inputs) before the fallback, or the error.
        max_bad_inputs: batches with NaN/Inf in their image or label before the error.

    Examples:
        >>> NonFiniteGuard(max_nonfinite=5).attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, max_nonfinite: int = 3, max_bad_inputs: int = 2) -> None:
        super().__init__()
        for name, value in (("max_nonfinite", max_nonfinite), ("max_bad_inputs", max_bad_inputs)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_nonfinite, self.max_bad_inputs = max_nonfinite, max_bad_inputs
        self.stats = {"nonfinite": 0, "skipped_steps": 0, "bad_inputs": 0}
        self.streak = 0
        #: called when a streak reaches ``max_nonfinite`` (set by ``AMPToggle``); ``True``: the streak starts again
        self.fallback: Callable[[Engine], bool] | None = None
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def state_dict(self) -> dict[str, Any]:
        """The counts and the current streak."""
        return {"stats": dict(self.stats), "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (counts missing from an older state stay 0)."""
        self.stats.update({k: int(v) for k, v in state["stats"].items() if k in self.stats})
        self.streak = int(state["streak"])

    def _attach(self, engine: Engine) -> None:
        if not hasattr(engine, "optimizer") or not hasattr(engine, "network"):
            raise TypeError(
                "NonFiniteGuard needs a MONAI SupervisedTrainer (an engine with a network and an optimizer)"
            )
        self.on(engine, Events.ITERATION_STARTED, self._save_buffers)
        self.on(engine, IterationEvents.BACKWARD_COMPLETED, self._check)

    def _detached(self, engine: Engine) -> None:
        self._saved = []
        self.fallback = None

    def _save_buffers(self, engine: Engine) -> None:
        # batch-norm statistics change in the forward pass; a skipped step must not keep them
        buffers = list(engine.network.buffers())
        if len(buffers) != len(self._saved) or any(b is not s for b, (s, _) in zip(buffers, self._saved, strict=False)):
            self._saved = [(b, b.detach().clone()) for b in buffers]
        else:
            for b, copy in self._saved:
                copy.copy_(b.detach())

    def _check(self, engine: Engine) -> None:
        out = engine.state.output
        bad_loss = not _finite(out["loss"])
        bad_input = bad_loss and not all(_finite(out.get(k)) for k in ("image", "label"))
        # a finite loss can still give NaN/Inf gradients (bf16, a division at zero); a GradScaler skips those itself
        bad_grad = not bad_loss and not _scaled(engine) and not _grads_finite(engine.optimizer)
        flags = torch.tensor([float(bad_loss or bad_grad), float(bad_input)])
        if idist.get_world_size() > 1:  # every rank steps, or none does
            flags = idist.all_reduce(flags, op="MAX")
        if not flags[0]:
            self.streak = 0
            return
        self._skip_step(engine)
        self.stats["nonfinite"] += 1
        self.stats["skipped_steps"] += 1
        where = f"iteration {engine.state.iteration} (epoch {engine.state.epoch})"
        if flags[1]:
            self.stats["bad_inputs"] += 1
            logger.warning("NonFiniteGuard: NaN/Inf in the input at %s; step skipped", where)
            if self.stats["bad_inputs"] >= self.max_bad_inputs:
                self._stop(
                    engine,
                    f"the input batch held NaN/Inf voxels ({self.stats['bad_inputs']} batches so far) at "
                    f"{where}; fix or remove the file(s)",
                    bad_loss,
                    bad_input,
                )
            return
        self.streak += 1
        what = "gradient from a finite loss" if bad_grad else "loss"
        logger.warning("NonFiniteGuard: non-finite %s at %s; step skipped (%d in a row)", what, where, self.streak)
        if self.streak < self.max_nonfinite:
            return
        if self.fallback is not None and self.fallback(engine):
            self.streak = 0
            return
        self._stop(
            engine,
            f"{self.streak} non-finite steps in a row from finite inputs, the last at {where} (its {what}), and no "
            "lower precision to fall back to; lower the learning rate or check the loss",
            bad_loss,
            bad_input,
        )

    def _skip_step(self, engine: Engine) -> None:
        for b, copy in self._saved:
            b.data.copy_(copy)
        if _scaled(engine):
            # the scaler must see the step as non-finite on every rank: it skips it and lowers its scale
            for group in engine.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
        else:
            engine.optimizer.zero_grad(set_to_none=True)

    def _stop(self, engine: Engine, why: str, bad_loss: bool, bad_input: bool) -> None:
        local = self._local_files(engine, bad_input) if bad_loss else ""
        parts = idist.all_gather(local) if idist.get_world_size() > 1 else [local]
        named = "; ".join(f"rank {r}: {p}" if len(parts) > 1 else p for r, p in enumerate(parts) if p)
        raise NonFiniteLossError(f"NonFiniteGuard: {why}. Files: {named or 'the batch carries no file names'}")

    def _local_files(self, engine: Engine, bad_input: bool) -> str:
        batch = engine.state.batch
        names = batch_files(batch)
        if names is not None:
            image = batch.get("image") if isinstance(batch, dict) else None
            if bad_input and isinstance(image, torch.Tensor) and len(image) == len(names):
                named = [n for n, x in zip(names, image, strict=True) if not _finite(x)]
                names = named or names
            return ", ".join(dict.fromkeys(names))
        if not bad_input:
            return ""
        items = getattr(getattr(getattr(engine, "data_loader", None), "dataset", None), "data", None) or []
        logger.warning(
            "NonFiniteGuard: the batch carries no file names; scanning %d training items for NaN/Inf", len(items)
        )
        bad = files_with_nonfinite_voxels(items)
        return ", ".join(bad) if bad else "none of the training files holds NaN/Inf voxels (a transform made them)"


def _pass_length(loader: Any) -> int | None:
    """Batches in one pass of ``loader`` (MONAI's ``ThreadDataLoader(repeats=n)`` yields each n times); ``None``:
    it has no length."""
    try:
        return len(loader) * int(getattr(loader, "repeats", 1))
    except TypeError:
        return None


class ShortEpochError(RuntimeError):
    """A data pass or an epoch ended before its length; the message names the engine and the counts."""


class EpochLengthGuard(EngineHandler):
    """Raises `ShortEpochError` when a loader's pass or an epoch ends short, before any ``EPOCH_COMPLETED`` handler.

    Args:
        name: what the engine does, for the message (``"training"``, ``"validation"``).

    Examples:
        >>> EpochLengthGuard("training").attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, name: str = "engine") -> None:
        super().__init__()
        self.name = name
        self._taken = 0  # batches from the loader's current pass
        self._planned: int | None = None  # that pass's length, read at its first batch (the data may change later)
        self._first_epoch = True  # the first epoch of a run may resume in its middle
        self._offset = 0  # iterations of this epoch done before the run started (a resume)
        self._start = 0  # engine.state.iteration when this epoch started
        self._ended_on_purpose = False

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started)
        self.on(engine, Events.GET_BATCH_COMPLETED, self._batch)
        self.on(engine, Events.DATALOADER_STOP_ITERATION, self._pass_ended, first=True)
        self.on(engine, Events.TERMINATE_SINGLE_EPOCH, self._ended_early)
        self.on(engine, Events.TERMINATE, self._ended_early)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed, first=True)

    def _started(self, engine: Engine) -> None:
        self._taken, self._first_epoch = 0, True  # ignite starts a fresh iterator for every run

    def _epoch_started(self, engine: Engine) -> None:
        length = engine.state.epoch_length
        self._offset = engine.state.iteration % length if self._first_epoch and length else 0
        self._first_epoch = False
        self._start = engine.state.iteration
        self._ended_on_purpose = False

    def _batch(self, engine: Engine) -> None:
        if self._taken == 0:
            self._planned = _pass_length(engine.state.dataloader)
        self._taken += 1

    def _ended_early(self, engine: Engine, iter_counter: int = 0) -> None:  # TERMINATE_SINGLE_EPOCH passes a count
        self._ended_on_purpose = True
        self._taken = 0  # ignite starts a new pass after a terminated epoch (a terminated run: at its next start)

    def _pass_ended(self, engine: Engine) -> None:
        expected = self._planned if self._taken else _pass_length(engine.state.dataloader)
        taken, self._taken = self._taken, 0
        if expected is not None and taken != expected:
            raise ShortEpochError(
                f"the {self.name} data loader ended a pass after {taken} of its {expected} batches (epoch "
                f"{engine.state.epoch}, iteration {engine.state.iteration}): the pass lost items, so the epoch is not "
                "used. A loader whose thread stops on an error ends its pass this way (MONAI's ThreadDataLoader); "
                "monai_fast.data.loaders.SafeThreadDataLoader raises the failing item's error instead"
            )

    def _epoch_completed(self, engine: Engine) -> None:
        length = engine.state.epoch_length
        if self._ended_on_purpose or not length:
            return
        done, expected = engine.state.iteration - self._start, length - self._offset
        if done != expected:
            raise ShortEpochError(
                f"{self.name} epoch {engine.state.epoch} ended after {done} of its {expected} iterations: the data "
                "loader gave no more batches, so the epoch's results are not used"
            )
