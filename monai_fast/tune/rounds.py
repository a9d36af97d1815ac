"""A choice between two ways of doing the same work, made from interleaved rounds of timings: `decide()` keeps
the user's way (the baseline) unless the rounds agree that the candidate is faster by the required gain."""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ignite.distributed as idist
import torch

from monai_fast.telemetry.memory import is_out_of_memory

__all__ = [
    "MEASURE_MIN_S",
    "MEASURE_SHARE",
    "MIN_GAIN",
    "MIN_ROUNDS",
    "Decision",
    "decide",
    "decided_on_rank0",
    "at_measure_batch",
    "judge",
    "measure_batch",
    "measure_budget_s",
    "network_copy",
    "settled",
]

#: the fewest timed rounds a choice is ever made from
MIN_ROUNDS = 3
#: the speed-up a way must show over the user's to replace it, by default: closer than this is a near-tie
MIN_GAIN = 1.05
#: the share of the run's planned training time a measurement may take
MEASURE_SHARE = 0.01
#: and the seconds it may always take (a short run of a small network still measures its rounds)
MEASURE_MIN_S = 10.0


def measure_budget_s(planned_steps: int | None, step_s: float) -> float:
    """Seconds a measurement made during a run may take: `MEASURE_SHARE` of the planned run, at least
    `MEASURE_MIN_S`; unbounded when the run's length is not known."""
    if planned_steps is None or planned_steps <= 0:
        return float("inf")
    return max(MEASURE_MIN_S, MEASURE_SHARE * planned_steps * step_s)


def measure_batch(batch: int, planned_steps: int | None, ways: int = 2) -> int:
    """The batch size a choice's rounds run at: the run's own ``batch`` when `MEASURE_SHARE` of the planned
    steps holds a warm-up and `MIN_ROUNDS` rounds of each of ``ways`` twice over, else at most 2 (a choice
    can turn over with the batch, so a long run measures the step it takes).

    Examples:
        >>> measure_batch(8, 12_800), measure_batch(8, 48), measure_batch(8, None)
        (8, 2, 2)
    """
    if planned_steps is not None and planned_steps * MEASURE_SHARE >= 2 * ways * (1 + MIN_ROUNDS):
        return batch
    return min(batch, 2)


T = TypeVar("T")


def at_measure_batch(
    measure: Callable[[int], T], batch: int, planned_steps: int | None, left_s: float | None = None
) -> T:
    """``measure(n)`` at `measure_batch`'s size, again on at most 2 items where that runs out of memory (any
    other error propagates). A run under a finite wall-clock limit (``left_s`` seconds left) measures at most
    2 items, as its steps are not known before one is timed."""
    n = measure_batch(batch, planned_steps if left_s is None or not math.isfinite(left_s) else None)
    try:
        return measure(n)
    except Exception as e:
        if n <= 2 or not is_out_of_memory(e):
            raise
    return measure(min(batch, 2))


@dataclass(frozen=True)
class Decision:
    """What interleaved rounds of a baseline and a candidate decided, with every timing behind it.

    Attributes:
        names: (baseline, candidate), as the reason names them.
        choice: the name chosen: the candidate only when the rounds showed it faster by ``min_gain``.
        clear: whether the rounds decided it (``False``: a near-tie, disagreeing rounds or too small a budget).
        rounds: (baseline seconds, candidate seconds) per timed round, warm-up left out.
        warmup: the untimed first call of each, in seconds (``None`` when nothing ran).
        min_gain: the speed-up the candidate had to show.
        reason: one sentence with the median gain and its spread over the rounds.
    """

    names: tuple[str, str]
    choice: str
    clear: bool
    rounds: tuple[tuple[float, float], ...]
    warmup: tuple[float, float] | None
    min_gain: float
    reason: str
    ratios: tuple[float, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(b / max(c, 1e-12) for b, c in self.rounds))

    @property
    def gain(self) -> float:
        """The median over rounds of baseline seconds / candidate seconds (``nan`` without rounds)."""
        return statistics.median(self.ratios) if self.ratios else math.nan

    @property
    def chose_candidate(self) -> bool:
        return self.choice == self.names[1]

    def as_row(self) -> dict[str, Any]:
        """The evidence as plain values, for a run-record row."""
        return {
            "baseline": self.names[0],
            "candidate": self.names[1],
            "choice": self.choice,
            "clear": self.clear,
            "min_gain": self.min_gain,
            "gain": None if math.isnan(self.gain) else round(self.gain, 4),
            "rounds_s": [[round(b, 6), round(c, 6)] for b, c in self.rounds],
            "warmup_s": None if self.warmup is None else [round(w, 6) for w in self.warmup],
        }


def settled(rounds: list[tuple[float, float]], min_gain: float = MIN_GAIN, min_rounds: int = MIN_ROUNDS) -> bool:
    """Whether ``rounds`` (baseline, candidate seconds) settle a choice: at least ``min_rounds``, and the candidate
    reached ``min_gain`` in every one or in none."""
    ratios = [b / max(c, 1e-12) for b, c in rounds]
    return len(rounds) >= min_rounds and (min(ratios) >= min_gain or max(ratios) < min_gain)


def judge(
    rounds: list[tuple[float, float]],
    names: tuple[str, str] = ("baseline", "candidate"),
    min_gain: float = MIN_GAIN,
    warmup: tuple[float, float] | None = None,
) -> Decision:
    """The `Decision` that timed ``rounds`` (baseline, candidate seconds) make, by `decide`'s rule.

    Examples:
        >>> judge([(2.0, 1.0), (2.1, 1.0), (1.9, 1.0)], ("contiguous", "channels_last_3d")).choice
        'channels_last_3d'
    """
    if not rounds:
        raise ValueError("judge: no rounds to judge")
    base_name, cand_name = names
    ratios = [b / max(c, 1e-12) for b, c in rounds]

    def decision(choose_candidate: bool, clear: bool, reason: str) -> Decision:
        choice = cand_name if choose_candidate else base_name
        return Decision(names, choice, clear, tuple(rounds), warmup, min_gain, reason)

    gain = statistics.median(ratios)
    spread = f"{gain:.2f}x median over {len(rounds)} rounds, {min(ratios):.2f}x-{max(ratios):.2f}x"
    if min(ratios) >= min_gain:
        return decision(True, True, f"{cand_name} faster: {spread}")
    if max(ratios) < min_gain:
        return decision(False, True, f"{base_name} kept: {cand_name} measured {spread} (below {min_gain}x)")
    if gain >= min_gain and sum(r < 1.0 for r in ratios) <= len(ratios) // 4:
        return decision(True, True, f"{cand_name} faster: {spread} (rounds vary)")
    return decision(
        False, False, f"{base_name} kept: a near-tie or rounds that disagree ({cand_name} {spread}, {min_gain}x needed)"
    )


def decide(
    baseline: Callable[[], float],
    candidate: Callable[[], float],
    *,
    names: tuple[str, str] = ("baseline", "candidate"),
    min_gain: float = MIN_GAIN,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = 9,
    budget_s: float = math.inf,
    planned_steps: int | None = None,
) -> Decision:
    """Time ``baseline`` and ``candidate`` in interleaved rounds and say which to keep.

    Each callable does the work once and returns its seconds; the first call of each is an uncounted warm-up.
    The rounds alternate which goes first and stop once ``min_rounds`` agree, else at ``max_rounds`` or when
    ``budget_s`` is spent. The candidate wins when every round, or the median with at most a quarter of the
    rounds slower, shows ``min_gain``; a budget too small for ``min_rounds`` keeps the baseline.

    Args:
        baseline: the user's way (kept unless the candidate is shown faster).
        candidate: the way that replaces it when it pays.
        names: what the reason calls the two.
        min_gain: the speed-up (baseline / candidate seconds) the candidate must show.
        min_rounds: the fewest timed rounds a choice is made from (>= 2).
        max_rounds: the most timed rounds (>= ``min_rounds``).
        budget_s: the seconds the whole measurement may take, warm-up included.
        planned_steps: the run's planned steps: the budget is then at most their `measure_budget_s`.

    Raises:
        ValueError: ``min_rounds`` < 2, ``max_rounds`` < ``min_rounds`` or ``min_gain`` < 1.

    Examples:
        >>> decide(lambda: 2.0, lambda: 1.0, names=("eager", "compiled")).choice
        'compiled'
    """
    if min_rounds < 2 or max_rounds < min_rounds:
        raise ValueError(f"decide: need 2 <= min_rounds <= max_rounds, got {min_rounds} and {max_rounds}")
    if not min_gain >= 1.0:
        raise ValueError(f"decide: min_gain must be >= 1, got {min_gain}")
    rounds: list[tuple[float, float]] = []
    started = time.perf_counter()
    warmup = (baseline(), candidate())
    if planned_steps is not None:
        budget_s = min(budget_s, measure_budget_s(planned_steps, warmup[0]))
    need_s = min_rounds * (warmup[0] + warmup[1])
    if time.perf_counter() - started + need_s > budget_s:
        why = (
            f"{names[0]} kept: {min_rounds} rounds would take about {need_s:.1f} s, more than the "
            f"{budget_s:.1f} s this run allows for measuring"
        )
        return Decision(names, names[0], False, (), warmup, min_gain, why)
    while len(rounds) < max_rounds:
        if len(rounds) % 2 == 0:
            b, c = baseline(), candidate()
        else:
            c, b = candidate(), baseline()
        rounds.append((b, c))
        if settled(rounds, min_gain, min_rounds) or (
            len(rounds) >= min_rounds and time.perf_counter() - started >= budget_s
        ):
            break
    return judge(rounds, names, min_gain, warmup)


#: the ``nn.Module`` attributes that hold forward and backward hooks
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def network_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``net`` without its forward and backward hooks (the handlers' hooks hold threads and
    locks that cannot be copied, and are not the arithmetic a measurement compares)."""
    memo: dict[int, Any] = {}
    for module in net.modules():
        for name in _HOOK_DICTS:
            hooks = module.__dict__.get(name)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    return copy.deepcopy(net, memo)


def decided_on_rank0(choose: Callable[[], Any], device: torch.device) -> Any:
    """``choose()`` run on rank 0 with the run's random stream untouched; every rank gets its answer (as JSON:
    a tuple arrives as a list), so DDP's ranks make the same choice."""
    answer = None
    if idist.get_rank() == 0:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            answer = choose()
    if idist.get_world_size() > 1:
        answer = json.loads(idist.broadcast(json.dumps(answer), src=0, safe_mode=True))
    return answer
