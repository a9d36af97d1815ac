"""Grow-then-bisect search of one integer setting for the highest measured throughput (rules: docs/tuner.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # space.py imports torch
    from monai_fast.tune.space import SearchSpace

T = TypeVar("T")

__all__ = ["Trial", "best_over", "grow_then_bisect", "peak_over_budget", "pick_best", "confirm_best"]


@dataclass
class Trial:
    """One measured (or predicted-infeasible) candidate.

    Attributes:
        value: the setting tried (e.g. a batch size).
        feasible: whether it ran within the memory budget.
        throughput: samples (or volumes) per second; ``None`` when infeasible.
        peak_mib: peak device memory during the trial, MiB (``None`` when not run).
        reason: why it is infeasible ("out of memory", ...).
        cost_s: wall seconds the trial took (0 for a predicted-infeasible one).
        predicted: infeasible by extrapolating measured memory; not run.
    """

    value: int
    feasible: bool
    throughput: float | None = None
    peak_mib: float | None = None
    reason: str = ""
    cost_s: float = 0.0
    predicted: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


#: ``(value, trials so far) -> reason`` when the value surely does not fit, else ``None``
Predict = Callable[[int, list[Trial]], str | None]


def pick_best(trials: list[Trial], tie: float = 0.02) -> Trial | None:
    """The feasible trial with the highest throughput; among those within ``tie`` of it, the smallest value
    (inside measurement noise the smaller setting saves memory)."""
    ok = [t for t in trials if t.feasible and t.throughput is not None]
    if not ok:
        return None
    best = max(t.throughput for t in ok)  # type: ignore[type-var]
    near = [t for t in ok if t.throughput >= best * (1.0 - tie)]  # type: ignore[operator]
    return min(near, key=lambda t: t.value)


def peak_over_budget(value: int, trials: list[Trial], budget_bytes: int, slack: float = 1.25) -> str | None:
    """Why ``value`` need not be run: the peak memory extrapolated from the two largest measured trials exceeds
    ``slack`` x ``budget_bytes`` (a line through them); ``None`` with fewer than two measured trials or within it."""
    points = {t.value: t.peak_mib for t in trials if t.feasible and t.peak_mib is not None}
    if len(points) < 2:
        return None
    (x0, y0), (x1, y1) = sorted(points.items())[-2:]
    predicted = y1 + (y1 - y0) / (x1 - x0) * (value - x1)
    if predicted * 2**20 > budget_bytes * slack:
        return f"predicted peak {predicted:.0f} MiB > budget {budget_bytes / 2**20:.0f} MiB"
    return None


def grow_then_bisect(
    evaluate: Callable[[int], Trial],
    low: int,
    high: int,
    max_trials: int = 8,
    plateau: float | None = 0.05,
    predict_infeasible: Predict | None = None,
    patience: int = 1,
) -> list[Trial]:
    """Search ``[low, high]`` for the value with the highest throughput in at most ``max_trials`` runs.

    A range of no more values than ``max_trials`` is run whole, in order, up to the first that does not fit.

    Args:
        evaluate: runs one candidate and returns its `Trial` (must not raise on OOM).
        low: the range's first value (``>= 1``).
        high: its last value (inclusive).
        max_trials: most candidates actually run (predicted-infeasible ones are free).
        plateau: a doubling gaining less than this share stops the growth; ``None``: grow until one does not fit.
        predict_infeasible: ``(value, trials so far) -> reason`` when it surely does not fit, else ``None``.
        patience: doublings in a row that gain less than ``plateau`` before the growth stops.

    Returns:
        The trials in the order they were made.

    Examples:
        >>> fake = lambda b: Trial(b, b < 12, min(b, 8) * 10.0 if b < 12 else None)  # flat from 8, 12+ do not fit
        >>> pick_best(grow_then_bisect(fake, 1, 64)).value
        8
    """
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    for name, value, least in (("max_trials", max_trials, 1), ("patience", patience, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if plateau is not None and plateau < 0:
        raise ValueError(f"plateau must be >= 0 or None, got {plateau}")
    search = _Search(evaluate, max_trials, predict_infeasible)
    if high - low + 1 <= max_trials:
        search.sweep(low, high)
    else:
        search.grow_bisect_narrow(low, high, plateau, patience)
    return search.trials


class _Search:
    """The phases of `grow_then_bisect()`, sharing its trials and its budget."""

    def __init__(self, evaluate: Callable[[int], Trial], max_trials: int, predict_infeasible: Predict | None) -> None:
        self.evaluate, self.max_trials, self.predict_infeasible = evaluate, max_trials, predict_infeasible
        self.trials: list[Trial] = []
        self.seen: dict[int, Trial] = {}

    def try_value(self, v: int) -> Trial | None:
        """The trial of ``v`` (run now, predicted, or from before); ``None`` once the budget is spent."""
        if v in self.seen:
            return self.seen[v]
        if sum(not t.predicted for t in self.trials) >= self.max_trials:
            return None
        why = self.predict_infeasible(v, self.trials) if self.predict_infeasible is not None else None
        t = Trial(v, False, reason=why, predicted=True) if why else self.evaluate(v)
        self.trials.append(t)
        self.seen[v] = t
        return t

    def sweep(self, low: int, high: int) -> None:
        """Every value, up to the first that does not fit (the budget covers the range)."""
        for v in range(low, high + 1):
            t = self.try_value(v)
            if t is None or not t.feasible:
                return

    def grow_bisect_narrow(self, low: int, high: int, plateau: float | None, patience: int) -> None:
        first = self.try_value(low)
        if first is None or not first.feasible:
            return
        grown = self._grow(first, high, -float("inf") if plateau is None else plateau, patience)
        if grown is None:
            return
        last_ok, limit = grown
        if limit is not None and not self._bisect_edge(last_ok, limit, 1.0 + (plateau or 0.0) / 2):
            return
        self._narrow()

    def _grow(self, first: Trial, high: int, stop_gain: float, patience: int) -> tuple[Trial, int | None] | None:
        """Double until infeasible, the range's end or a plateau: the last feasible trial and the first
        infeasible value above it (if met); ``None`` once the budget is spent."""
        last_ok, best_tp, misses = first, first.throughput, 0
        while last_ok.value < high:
            nxt = self.try_value(min(2 * last_ok.value, high))
            if nxt is None:
                return None
            if not nxt.feasible:
                return last_ok, nxt.value
            # still rising: a gain over the best so far, or over the previous reading when that came out lower
            if nxt.throughput >= min(best_tp, last_ok.throughput) * (1.0 + stop_gain):  # type: ignore[operator,type-var]
                best_tp, misses = max(best_tp, nxt.throughput), 0  # type: ignore[type-var]
            else:
                misses += 1  # one noisy reading must not end the growth: look one doubling further
                if misses > patience:
                    return last_ok, None
            last_ok = nxt
        return last_ok, None

    def _bisect_edge(self, last_ok: Trial, limit: int, rise: float) -> bool:
        """Bisect from ``last_ok`` towards the memory edge while throughput rises; ``False`` once the budget ran out."""
        lo, hi = last_ok.value, limit
        while hi - lo > 1:
            t = self.try_value((lo + hi) // 2)
            if t is None:
                return False
            if not t.feasible:
                hi = t.value
            elif t.throughput >= self.seen[lo].throughput * rise:  # type: ignore[operator]
                lo = t.value
            else:
                break  # no longer rising: the best lies below, narrowed next
        return True

    def _narrow(self) -> None:
        """Narrow the bracket around the best value measured, splitting the wider side first."""
        while True:
            best = pick_best(self.trials, tie=0.0)
            assert best is not None
            values = sorted(v for v, t in self.seen.items() if t.feasible)
            i = values.index(best.value)
            left = values[i - 1] if i > 0 else None
            above = (v for v, t in self.seen.items() if v > best.value and not t.feasible)
            right = values[i + 1] if i + 1 < len(values) else min(above, default=None)
            gaps = []
            if right is not None and right - best.value > 1:
                gaps.append((right - best.value, (best.value + right) // 2))
            if left is not None and best.value - left > 1:
                gaps.append((best.value - left, math.ceil((left + best.value) / 2)))
            if not gaps:
                return
            _, mid = max(gaps)
            if mid in self.seen or self.try_value(mid) is None:
                return


def confirm_best(trials: list[Trial], evaluate: Callable[[int], Trial], rounds: int = 2, top: int = 3) -> list[Trial]:
    """Measure the ``top`` best feasible trials again, in place, so one lucky reading cannot win.

    Each round measures every candidate still in once more, then drops the weakest while more than two
    remain. A candidate's ``throughput`` becomes the median of its readings, its ``cost_s`` includes the
    new runs, and one that no longer fits is marked infeasible.

    Args:
        trials: a search's trials; the ``top`` best feasible ones are updated.
        evaluate: runs one candidate and returns its `Trial` (must not raise on OOM).
        rounds: confirmation rounds; 0 leaves ``trials`` as they are.
        top: candidates that enter the confirmation rounds (at least 2).

    Returns:
        The finalists, best first (empty when no round ran): pick among these.
    """
    for name, value, least in (("rounds", rounds, 0), ("top", top, 2)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    entered = sorted((t for t in trials if t.feasible and t.throughput is not None), key=lambda t: -t.throughput)[:top]  # type: ignore[operator]
    if len(entered) < 2 or rounds == 0:
        return []
    readings = {t.value: [t.throughput] for t in entered}
    still_in = list(entered)
    for _ in range(rounds):
        for t in still_in:
            again = evaluate(t.value)
            t.cost_s += again.cost_s
            if not again.feasible:
                t.feasible, t.throughput, t.reason = False, None, f"measured again: {again.reason}"
                t.peak_mib = again.peak_mib if again.peak_mib is not None else t.peak_mib
                del readings[t.value]
                continue
            readings[t.value].append(again.throughput)
            if again.peak_mib is not None:
                t.peak_mib = max(t.peak_mib or 0.0, again.peak_mib)
        still_in = sorted((t for t in still_in if t.feasible), key=lambda t: -statistics.median(readings[t.value]))
        if len(still_in) > 2:
            still_in.pop()
        if len(still_in) < 2:
            break
    for t in entered:
        if t.value in readings:
            t.throughput = statistics.median(readings[t.value])
            t.reason = f"median of {len(readings[t.value])} readings"
    return sorted(still_in, key=lambda t: -t.throughput)  # type: ignore[operator]


def best_over(
    options: Sequence[T],
    evaluate_for: Callable[[T], Callable[[int], Trial]],
    value_range: tuple[int, int],
    labels: Callable[[T], dict],
    space: SearchSpace,
    predict_infeasible: Predict | None = None,
) -> tuple[list[dict], tuple[T, Trial] | None]:
    """One search of ``value_range`` per option (grid or grow-then-bisect, then `confirm_best()` and
    `pick_best()`, as ``space`` says): every trial labelled, and the option whose pick is best by over 2 %."""
    records: list[dict] = []
    best: tuple[T, Trial] | None = None
    for option in options:
        evaluate = evaluate_for(option)
        if space.strategy == "grid":
            trials = [evaluate(v) for v in range(value_range[0], value_range[1] + 1)]
        else:
            trials = grow_then_bisect(
                evaluate,
                *value_range,
                max_trials=space.max_trials,
                plateau=space.plateau,
                predict_infeasible=predict_infeasible,
            )
        finalists = confirm_best(trials, evaluate, rounds=space.confirm, top=space.confirm_top)
        pick = pick_best(finalists or trials)
        records += [dict(t.to_dict(), **labels(option)) for t in trials]
        if pick is not None and (best is None or pick.throughput > best[1].throughput * 1.02):
            best = (option, pick)
    return records, best
