"""Recipes trained an epoch at a time in turns, so their per-epoch times meet the same host load.

The lead (``fast``) then sets the others' epoch or time budget; docs/demo.md describes the budgets.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.training.run import TargetRun, TrainResult
from monai_fast.telemetry.host import HostLoad

__all__ = ["budget_after_lead", "epochs_after_lead", "lead_of", "lead_share", "run_interleaved"]

logger = logging.getLogger(__name__)


def lead_of(recipes: Sequence[str]) -> str:
    """The recipe whose time to target sets the others' budget: ``fast`` when it races, else the first."""
    return "fast" if "fast" in recipes else recipes[0]


def budget_after_lead(lead_s: float, multiple: float | None, cap: float | None) -> float:
    """Seconds the other recipes get: ``multiple`` x the lead's time (to target, or run), at most ``cap``."""
    cap = math.inf if cap is None else float(cap)
    return cap if multiple is None else min(cap, multiple * lead_s)


def epochs_after_lead(lead_epochs: int, multiple: float | None, max_epochs: int | None = None) -> int | None:
    """Epochs the other recipes get: ``multiple`` x the lead's epochs (to target, or run), rounded up.

    At most ``max_epochs``; ``None`` (no epoch budget) when the lead finished no epoch.
    """
    if multiple is None or lead_epochs < 1:
        return None
    epochs = max(1, math.ceil(multiple * lead_epochs))
    return epochs if max_epochs is None else min(epochs, max_epochs)


def lead_share(recipes: int) -> float:
    """With a deadline, the lead's share of the time left once ``recipes`` recipes are set up: ``1 / (recipes + 1)``."""
    return 1.0 / (recipes + 1)


def _left(deadline: float | None) -> float:
    return math.inf if deadline is None else max(0.0, deadline - time.monotonic())


def _fits(run: TargetRun, deadline: float | None) -> bool:
    """Whether ``run``'s next epoch (its longest so far plus their spread) ends before ``deadline``."""
    if deadline is None:
        return True
    walls = [r.wall_s for r in run.recorder.rows if r.wall_s is not None]
    return _left(deadline) > (2 * max(walls) - min(walls) if walls else 0.0)


def run_interleaved(
    recipes: Sequence[str],
    configs: Mapping[str, RecipeConfig],
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    device: str,
    target: float,
    time_budget_s: float | None,
    multiple: float | None,
    run_dir: Path | None,
    progress: bool,
    events: Any,
    epoch_multiple: float | None = None,
    deadline: float | None = None,
) -> tuple[list[TrainResult], dict[str, int], dict, dict]:
    """Train ``recipes`` in turns until the lead is done, then the others alone within the budget the lead sets.

    Args:
        recipes, configs: recipe names (the lead is `lead_of()` them) and each one's options.
        train_files, val_files: the data.
        device, target, run_dir, progress: as `TargetRun`'s.
        time_budget_s: most seconds on any recipe's clock (``None``: no cap).
        multiple, epoch_multiple: the others' time and epoch budgets in multiples of the lead's.
        events: a `RaceEvents`.
        deadline: ``time.monotonic()`` by which every recipe has stopped (``None``: none).

    Returns:
        ``(results in recipes' order, epochs each ran interleaved, how the budgets were set, the host's load)``.
    """
    lead = lead_of(recipes)
    cap = math.inf if time_budget_s is None else time_budget_s
    runs: dict[str, TargetRun] = {}
    for name in recipes:
        events.recipe_started(
            name, target, time_budget_s if deadline is None else min(time_budget_s or math.inf, _left(deadline))
        )
        runs[name] = TargetRun(name, train_files, val_files, configs[name], device, target, cap, run_dir, progress)
    if deadline is not None:  # the lead's share of the time the set-up left
        left = _left(deadline)
        runs[lead].time_budget_s = min(
            runs[lead].time_budget_s or math.inf, runs[lead].elapsed() + lead_share(len(recipes)) * left
        )
        shared = getattr(events, "time_shared", None)
        if shared is not None:
            shared(lead, runs[lead].time_budget_s, left)
    bound_stopped: list[str] = []  # recipes the deadline stopped before their own budget or target
    host = HostLoad().start()  # what other processes took while the per-epoch times were measured side by side
    while not runs[lead].done and _left(deadline) > 0:
        behind = min((n for n in recipes if not runs[n].done), key=lambda n: runs[n].elapsed())
        if not _fits(runs[behind], deadline):
            logger.info("%s: its next epoch would not end within the total bound: the turns stop here", behind)
            break
        runs[behind].segment(epochs=1)
    host_load = host.stop()
    if deadline is not None and not runs[lead].done:
        bound_stopped.append(lead)
    paired = {n: len(runs[n].recorder.rows) for n in recipes}
    lead_result = runs[lead].finish()
    lead_s = lead_result.time_to_target_s if lead_result.reached else lead_result.total_s
    lead_epochs = lead_result.epochs_to_target if lead_result.reached else lead_result.epochs_run
    others_s = budget_after_lead(lead_s, multiple, time_budget_s)
    max_epochs = max(configs[n].max_epochs for n in recipes if n != lead) if len(recipes) > 1 else None
    wanted_epochs = epochs_after_lead(lead_epochs, epoch_multiple)
    others_epochs = epochs_after_lead(lead_epochs, epoch_multiple, max_epochs)
    budget = {
        "time_budget_s": time_budget_s,
        "multiple": multiple,
        "lead": lead,
        "lead_s": lead_s,
        "lead_reached": lead_result.reached,
        "others_s": None if math.isinf(others_s) else others_s,
        "epoch_multiple": epoch_multiple,
        "lead_epochs": lead_epochs,
        "others_epochs": others_epochs,
        "max_epochs": max_epochs if wanted_epochs != others_epochs else None,
    }
    others = [n for n in recipes if n != lead and not runs[n].done]
    for i, name in enumerate(others):
        run = runs[name]
        seconds = others_s
        if deadline is not None:  # its share of what is left, measured now
            seconds = min(seconds, run.elapsed() + _left(deadline) / (len(others) - i))
            budget["total_budget_left_s"] = _left(deadline)
        run.time_budget_s = seconds
        events.budget_set(name, seconds, budget)
        left = None if others_epochs is None else others_epochs - run.built.trainer.state.epoch
        if deadline is None:
            if left is None or left > 0:
                run.segment(epochs=left)
            continue
        while (left is None or left > 0) and not run.done:  # an epoch at a time, each only if it ends in time
            if not _fits(run, deadline):
                logger.info("%s: its next epoch would not end within the total bound: it stops here", name)
                bound_stopped.append(name)
                break
            run.segment(epochs=1)
            left = None if left is None else left - 1
    budget["bound_stopped"] = bound_stopped
    logger.info("interleaved epochs: %s", ", ".join(f"{n} {k}" for n, k in paired.items()))
    return [runs[n].finish() for n in recipes], paired, budget, host_load
