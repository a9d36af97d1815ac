"""The time-to-Dice benchmark: the race repeated with other training seeds, medians, one JSON."""

from __future__ import annotations

import datetime as dt
import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from monai_fast.apps.demo.core import RaceEvents, RaceRun, race, speedup
from monai_fast.apps.demo.options import OptionError, RaceSpec, plan_race
from monai_fast.apps.training.options import check_writable_dir
from monai_fast.apps.training.run import TrainResult
from monai_fast.files import write_json

__all__ = ["REFERENCES", "BenchRun", "bench", "summarize"]

logger = logging.getLogger(__name__)

REFERENCES = ("baseline", "monai_tutorial")
"""Recipes every other recipe's speed-up is measured against, within the same repeat."""


@dataclass
class BenchRun:
    """What `bench()` returns: every repeat's race, the medians, and the JSON written."""

    repeats: list[RaceRun]
    summary: dict
    path: Path


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(repeats: Sequence[Sequence[TrainResult]], recipes: Sequence[str]) -> dict:
    """Per recipe: how often it reached the target, medians over repeats, speed-ups against `REFERENCES`."""
    by_recipe = [{r.recipe: r for r in reversed(rs)} for rs in repeats]  # each repeat's first run of a recipe
    summary = {}
    for name in recipes:
        runs = [by[name] for by in by_recipe]
        reached = [r for r in runs if r.reached]
        summary[name] = {
            "reached": f"{len(reached)}/{len(runs)}",
            "median_time_to_target_s": _median_or_none([r.time_to_target_s for r in reached]),
            "median_epochs_to_target": _median_or_none([r.epochs_to_target for r in reached]),
            "median_train_s_per_epoch": statistics.median(r.train_s_per_epoch for r in runs),
            "median_data_wait_share": statistics.median(r.data_wait_share for r in runs),
        }
        for ref in REFERENCES:  # same-run ratios against each reference that raced
            if ref in recipes and name != ref:
                summary[name][f"speedup_over_{ref}"] = [
                    {"factor": f, "lower_bound": lb} for f, lb in (speedup(by[name], by[ref]) for by in by_recipe)
                ]
    return summary


def bench(
    spec: RaceSpec,
    repeats: int = 1,
    out_dir: str | os.PathLike = "benchmarks/results",
    events: RaceEvents | None = None,
) -> BenchRun:
    """Race ``spec`` ``repeats`` times (training seed ``seed + i``, same data); write one JSON of epochs and medians.

    Args:
        spec: the race's options; ``run_dir`` ``None`` means ``runs/bench-<time>`` (a ``repeat<i>/`` each).
        repeats, events: how many races; hooks told of each step.
        out_dir: folder of the JSON, ``time_to_dice_<time>.json``.

    Raises:
        OptionError: a bad option (``repeats``, ``out_dir`` or any of ``spec``), before anything runs.

    Example:
        >>> done = bench(RaceSpec(device="cuda"), repeats=3, out_dir="benchmarks/results")  # doctest: +SKIP
    """
    if repeats < 1:
        raise OptionError("repeats", f"must be >= 1, got {repeats}")
    stamp = dt.datetime.now()
    base = Path(spec.run_dir) if spec.run_dir is not None else Path(f"runs/bench-{stamp:%Y%m%d-%H%M%S}")
    specs = [replace(spec, run_dir=base / f"repeat{i + 1}", train_seed=spec.seed + i) for i in range(repeats)]
    plan_race(specs[0])
    out = check_writable_dir(out_dir, "out_dir") / f"time_to_dice_{stamp:%Y%m%d-%H%M%S}.json"
    events = events or RaceEvents()
    runs = []
    for i, one in enumerate(specs):
        events.repeat_started(i + 1, repeats)
        runs.append(race(one, events))
    summary = summarize([run.results for run in runs], list(spec.recipes))
    doc = {
        **runs[-1].meta,
        "benchmark": "time_to_dice",
        "repeats": [[r.to_dict() for r in run.results] for run in runs],
        "summary": summary,
    }
    write_json(doc, out)
    logger.info("wrote %s", out)
    return BenchRun(repeats=runs, summary=summary, path=out)
