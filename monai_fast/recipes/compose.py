"""Put a recipe's parts and data piece together into trainer + evaluator."""

from __future__ import annotations

import time

from monai_fast.handlers.nonfinite import NonFiniteGuard
from monai_fast.recipes.common import Recipe, assemble
from monai_fast.recipes.datasets import DataPiece
from monai_fast.recipes.parts import RecipeParts
from monai_fast.recipes.pieces import attach_precision

__all__ = ["compose"]


def compose(parts: RecipeParts, data: DataPiece, t_start: float) -> Recipe:
    """Network, optimizer, loss and engines from ``parts`` over ``data``, precision applied.

    The network is built after the data sets (the seed's random stream is the same as always),
    validation runs through a ``ValidationHandler``, and the precision goes either to MONAI's
    own ``amp`` (``parts.precision_by == "monai"``) or to an ``AMPToggle`` on trainer and evaluator.
    Every trainer gets a ``NonFiniteGuard``, whatever the precision (fp32 included): a non-finite
    loss skips its step, and persistent ones stop the run with an error naming the files.
    ``recipe.notes`` say what was built.

    Example:
        >>> parts = fast_parts(RecipeConfig(), "cpu")  # doctest: +SKIP
        >>> recipe = compose(parts, planned_cached_data(parts, train_files, val_files), time.perf_counter())  # doctest: +SKIP
    """
    config = parts.config
    network = parts.network()
    optimizer = parts.optimizer(network.parameters())
    loss = parts.loss()
    lr = optimizer.param_groups[0]["lr"]
    by_monai = parts.precision_by == "monai"
    precision_note = f"AMP {'on' if parts.monai_amp else 'off'}" if by_monai else f"AMPToggle {parts.precision}"
    notes = [
        data.note(),
        f"batch {config.batch_size} x {config.num_samples} crops, {type(loss).__name__}, "
        f"{type(optimizer).__name__}(lr={lr:g}), {precision_note}"
        + (", channels_last_3d weights" if parts.channels_last else ""),
    ]
    if data.plan is not None:
        notes.append(f"cache plan ({config.cache}): {data.plan.reasons[-1]}")
    recipe = assemble(
        parts.name, config, parts.device, network, optimizer, loss, data.train_loader, data.val_loader,
        amp=parts.monai_amp, t_start=t_start, notes=notes,
    )
    data.attach(recipe.trainer)
    NonFiniteGuard().attach(recipe.trainer)  # before AMPToggle, which then falls back through it
    if parts.precision_by == "toggle" and attach_precision(parts.precision, recipe.trainer, recipe.evaluator):
        recipe.amp = True
    recipe.setup_s = time.perf_counter() - t_start
    return recipe
