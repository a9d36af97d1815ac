"""Recipes trained an epoch at a time in turns, so their per-epoch times meet the same host load.

The recipe whose clock is behind trains the next epoch, so each gets about the same wall-clock
share while ``fast`` (the lead) trains. Then the lead sets the others' budget and they train on
alone to the target or that budget: ``epoch_multiple`` times the lead's epochs to target (a
count of epochs: how far their Dice curves get does not depend on the host's load), and/or
``budget_multiple`` times its time to target, always at most the wall-clock cap.
:func:`monai_fast.race.headline.headline` turns the results into the demo's headline.

Each run draws from its own random stream (:class:`~monai_fast.data.rng_state.OwnRandomStream`),
so the order of the turns, which follows the host's load, changes none of their shuffles or crops.

Example:
    >>> budget_after_lead(12.0, multiple=3.0, cap=300.0)
    36.0
    >>> budget_after_lead(200.0, multiple=3.0, cap=300.0)
    300.0
    >>> epochs_after_lead(8, multiple=5.0)
    40
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monai_fast.recipes import RecipeConfig
from monai_fast.recipes.runner import RaceResult, TargetRun
from monai_fast.telemetry.host import HostLoad

__all__ = ["budget_after_lead", "epochs_after_lead", "lead_of", "run_interleaved"]

logger = logging.getLogger(__name__)


def lead_of(recipes: Sequence[str]) -> str:
    """The recipe whose time to target sets the others' budget: ``fast`` when it races, else the first.

    Example:
        >>> lead_of(["baseline", "fast"]), lead_of(["baseline", "monai_tutorial"])
        ('fast', 'baseline')
    """
    return "fast" if "fast" in recipes else recipes[0]


def budget_after_lead(lead_s: float, multiple: float | None, cap: float | None) -> float:
    """Seconds the other recipes get: ``multiple`` x the lead's time (its time to target, or its time run), at most ``cap``.

    Example:
        >>> budget_after_lead(10.0, multiple=None, cap=210.0)
        210.0
    """
    cap = math.inf if cap is None else float(cap)
    return cap if multiple is None else min(cap, multiple * lead_s)


def epochs_after_lead(lead_epochs: int, multiple: float | None) -> int | None:
    """Epochs the other recipes get: ``multiple`` x the lead's epochs (to target, or run when it missed), rounded up.

    Example:
        >>> epochs_after_lead(7, multiple=None) is None, epochs_after_lead(7, multiple=2.5)
        (True, 18)
    """
    return None if multiple is None else max(1, math.ceil(multiple * lead_epochs))


def run_interleaved(
    recipes: Sequence[str], configs: Mapping[str, RecipeConfig], train_files: Sequence[dict], val_files: Sequence[dict],
    device: str, target: float, cap_s: float | None, multiple: float | None, run_dir: Path | None, progress: bool,
    events: Any, epoch_multiple: float | None = None,
) -> tuple[list[RaceResult], dict[str, int], dict, dict]:
    """Train ``recipes`` in turns until the lead is done, then the others alone within the budget the lead sets.

    Args:
        recipes: recipe names; the lead is :func:`lead_of` them.
        configs: each recipe's options.
        train_files, val_files: the data.
        device, target, run_dir, progress: as :func:`monai_fast.recipes.runner.run_to_target`.
        cap_s: most seconds on any recipe's clock (``None``: no cap).
        multiple: the others' wall-clock budget in multiples of the lead's time (``None``: the cap).
        events: a :class:`monai_fast.race.RaceEvents`.
        epoch_multiple: the others' epoch budget in multiples of the lead's epochs (``None``: none).

    Returns:
        ``(results in recipes' order, epochs each ran interleaved, how the budgets were set, how busy the host
        was while they took turns)`` (the last from :class:`~monai_fast.telemetry.host.HostLoad`).

    Example:
        >>> results, paired, budget, host = run_interleaved(["fast", "baseline"], configs, tr, va, "cpu", 0.9,
        ...                                           300.0, 3.0, None, False, RaceEvents())  # doctest: +SKIP
    """
    lead = lead_of(recipes)
    runs: dict[str, TargetRun] = {}
    for name in recipes:
        events.recipe_started(name, target, cap_s)
        runs[name] = TargetRun(name, train_files, val_files, configs[name], device, target,
                               math.inf if cap_s is None else cap_s, run_dir, progress)
    host = HostLoad().start()  # what other processes took while the per-epoch times were measured side by side
    while not runs[lead].done:
        behind = min((n for n in recipes if not runs[n].done), key=lambda n: runs[n].elapsed())
        runs[behind].segment(epochs=1)
    host_load = host.stop()
    paired = {n: len(runs[n].recorder.rows) for n in recipes}
    lead_result = runs[lead].finish()
    lead_s = lead_result.time_to_target_s if lead_result.reached else lead_result.total_s
    lead_epochs = lead_result.epochs_to_target if lead_result.reached else lead_result.epochs_run
    others_s = budget_after_lead(lead_s, multiple, cap_s)
    others_epochs = epochs_after_lead(lead_epochs, epoch_multiple)
    budget = {"cap_s": cap_s, "multiple": multiple, "lead": lead, "lead_s": lead_s, "lead_reached": lead_result.reached,
              "others_s": None if math.isinf(others_s) else others_s, "epoch_multiple": epoch_multiple,
              "lead_epochs": lead_epochs, "others_epochs": others_epochs}
    for name in recipes:
        run = runs[name]
        if name != lead and not run.done:
            run.budget_s = others_s
            events.budget_set(name, others_s, budget)
            left = None if others_epochs is None else others_epochs - run.built.trainer.state.epoch
            if left is None or left > 0:
                run.segment(epochs=left)
    logger.info("interleaved epochs: %s", ", ".join(f"{n} {k}" for n, k in paired.items()))
    return [runs[n].finish() for n in recipes], paired, budget, host_load
