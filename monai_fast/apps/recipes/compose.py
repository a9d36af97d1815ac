"""Put a recipe's parts and data piece together into trainer + evaluator."""

from __future__ import annotations

import time

from monai_fast.apps.recipes.common import Recipe, assemble, attach_validation_schedule
from monai_fast.apps.recipes.datasets import DataPiece
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.handlers.fast_training import FastTraining
from monai_fast.handlers.nonfinite import NonFiniteGuard

__all__ = ["compose"]


def compose(parts: RecipeParts, data: DataPiece, t_start: float, levers: FastTraining | None = None) -> Recipe:
    """Network, optimizer, loss and engines from ``parts`` over ``data``, precision applied.

    The network is built after the data sets (the seed's random stream is the same as always),
    validation runs through a ``ValidationHandler``. With ``levers``, that
    `FastTraining` is attached to trainer and evaluator, exactly as a
    user attaches it (it adopts both loaders, caching where its planner says, and sets the
    precision: ``parts.precision_by`` must then be ``"toggle"``); without, the precision goes to
    MONAI's own ``amp`` (``parts.precision_by == "monai"``). Every trainer gets a
    ``NonFiniteGuard``, whatever the precision (fp32 included): a non-finite loss skips its step,
    and persistent ones stop the run with an error naming the files. ``recipe.notes`` say what was
    built.

    Examples:
        >>> parts = fast_parts(RecipeConfig(), "cpu")  # doctest: +SKIP
        >>> recipe = compose(parts, uncached_data(parts, train_files, val_files), time.perf_counter(),
        ...                  levers=fast_training(parts))  # doctest: +SKIP
    """
    if (parts.precision_by == "toggle") != (levers is not None):
        raise ValueError(
            f"recipe {parts.name!r}: precision_by={parts.precision_by!r} "
            f"{'needs' if levers is None else 'cannot take'} a FastTraining to apply it"
        )
    config = parts.config
    network = parts.network()
    optimizer = parts.optimizer(network.parameters())
    loss = parts.loss()
    lr = optimizer.param_groups[0]["lr"]
    precision_note = f"AMP {'on' if parts.monai_amp else 'off'}" if levers is None else f"precision {parts.precision}"
    notes = [
        data.note()
        if levers is None
        else f"built over {type(data.train_ds).__name__} + {type(data.train_loader).__name__}, "
        "then adopted by FastTraining",
        f"batch {config.batch_size} x {config.num_samples} crops, {type(loss).__name__}, "
        f"{type(optimizer).__name__}(lr={lr:g}), {precision_note}"
        + (", channels_last_3d weights" if parts.channels_last else ""),
    ]
    recipe = assemble(
        parts.name,
        config,
        parts.device,
        network,
        optimizer,
        loss,
        data.train_loader,
        data.val_loader,
        amp=parts.monai_amp,
        t_start=t_start,
        notes=notes,
    )
    NonFiniteGuard().attach(recipe.trainer)  # before AMPToggle, which then falls back through it
    if levers is not None:
        levers.attach(recipe.trainer, recipe.evaluator)
        recipe.train_loader, recipe.val_loader = recipe.trainer.data_loader, recipe.evaluator.data_loader
        recipe.amp = levers.applied["precision"]["applied"]
        recipe.notes.extend(
            f"FastTraining {lever}: {what['setting'] if what['applied'] else 'left alone'} ({what['reason']})"
            for lever, what in levers.applied.items()
        )
    if config.validation == "schedule":
        attach_validation_schedule(recipe)
        recipe.notes.append(
            f"validation on a schedule: Dice on {config.val_subset} case(s) every epoch, the full validation "
            f"every {config.val_every} epochs until that is within {config.val_margin:g} of {config.val_target:g}"
        )
    recipe.setup_s = time.perf_counter() - t_start
    return recipe
