"""What the tuner picked and every trial it made, as a table and as recipe options, and where the training cache
goes next to the pick (`place_cache()`: the budget minus the batch's measured peak is the cache's)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

__all__ = [
    "CacheChoice",
    "Tunable",
    "TuneResult",
    "layout_name",
    "model_signature",
    "place_cache",
    "trial_setting",
    "trial_throughput",
]

MIB = 2**20

_Config = TypeVar("_Config", bound="Tunable")


class Tunable(Protocol):
    """A configuration that takes a tuner's pick: `monai_fast.apps.recipes.RecipeConfig` is one."""

    def tuned(
        self: _Config,
        batch_size: int,
        sw_batch_size: int,
        val_device: str,
        precision: str,
        cache_budget_mib: float | None = None,
    ) -> _Config: ...


@dataclass
class TuneResult:
    """What the tuner picked, and every trial it made.

    Attributes:
        key: the cache key (device, memory, model, patch, shapes, ranges, world size).
        device: human-readable device name.
        batch_size, sw_batch_size, val_device, precision: the pick.
        train_samples_per_s: training patches/s of the pick (all ranks together).
        val_volumes_per_s: validation volumes/s of the pick (per rank).
        budget_mib: memory a candidate may peak at (cap minus margin).
        leak_mib: how far live memory after a trial rose above its level after the first trial (should be 0).
        tuning_s: wall seconds the search took.
        trials: one dict per trial (``phase`` is ``train`` or ``val``).
        from_cache: the result was read from the cache file, nothing was run.
        cache_where: where the training cache goes next to the pick (`place_cache()`; ``None``: not placed).
        cache_budget_mib: the memory left for it.
        cache_reason: why.
    """

    key: str
    device: str
    batch_size: int
    sw_batch_size: int
    val_device: str
    precision: str
    train_samples_per_s: float
    val_volumes_per_s: float
    budget_mib: float
    leak_mib: float
    tuning_s: float
    trials: list[dict] = field(default_factory=list)
    from_cache: bool = False
    cache_where: str | None = None
    cache_budget_mib: float | None = None
    cache_reason: str = ""

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "from_cache"}

    @classmethod
    def from_dict(cls, d: dict) -> TuneResult:
        return cls(**d)

    def apply(self, config: _Config) -> _Config:
        """A copy of ``config`` with the tuned settings, by its ``tuned`` method (`RecipeConfig.tuned()`)."""
        return config.tuned(
            batch_size=self.batch_size,
            sw_batch_size=self.sw_batch_size,
            val_device=self.val_device,
            precision=self.precision,
            cache_budget_mib=self.cache_budget_mib,
        )

    def is_pick(self, trial: dict) -> bool:
        """Whether ``trial`` (one of `trials`) measured the picked setting of its phase."""
        if trial["phase"] == "train":
            return trial["precision"] == self.precision and trial["value"] == self.batch_size
        return trial["val_device"] == self.val_device and trial["value"] == self.sw_batch_size

    def picked(self, phase: str, value: int | None = None) -> dict | None:
        """The first feasible trial of ``phase`` at the pick (or at ``value`` with the pick's other settings)."""
        want = {
            "phase": phase,
            "value": value if value is not None else (self.batch_size if phase == "train" else self.sw_batch_size),
        }
        want.update({"precision": self.precision} if phase == "train" else {"val_device": self.val_device})
        return next((t for t in self.trials if t["feasible"] and all(t[k] == v for k, v in want.items())), None)

    def table(self) -> str:
        """The trials as a text table, the pick marked with ``*``."""
        head = f"{'phase':<6} {'setting':<34} {'result':>14} {'peak MiB':>9} {'cost s':>7}  note"
        lines = [head, "-" * len(head)]
        for t in self.trials:
            res = trial_throughput(t) if t["feasible"] else "infeasible"
            peak = f"{t['peak_mib']:.0f}" if t["peak_mib"] is not None else "-"
            mark = "* " if self.is_pick(t) else ""
            lines.append(
                f"{t['phase']:<6} {trial_setting(t):<34} {res:>14} {peak:>9} {t['cost_s']:>7.1f}  {mark}{t['reason']}"
            )
        lines.append(
            f"pick: batch_size={self.batch_size}, sw_batch_size={self.sw_batch_size}, val_device={self.val_device}, "
            f"precision={self.precision}; budget {self.budget_mib:.0f} MiB; tuning took {self.tuning_s:.1f} s"
        )
        if self.cache_where is not None:
            lines.append(f"cache: {self.cache_where}, {self.cache_budget_mib:.0f} MiB left for it; {self.cache_reason}")
        return "\n".join(lines)


def trial_setting(trial: dict) -> str:
    """A trial record's setting in words: ``batch_size=4 (bf16)``, ``sw_batch_size=8 (bf16, cpu)``."""
    if trial["phase"] == "train":
        return f"batch_size={trial['value']} ({trial['precision']})"
    return f"sw_batch_size={trial['value']} ({trial['precision']}, {trial['val_device']})"


def trial_throughput(trial: dict) -> str:
    """A feasible trial record's throughput with its unit: ``12.50 patch/s``, ``3.20 vol/s``."""
    return f"{trial['throughput']:.2f} {'patch/s' if trial['phase'] == 'train' else 'vol/s'}"


def model_signature(network: torch.nn.Module) -> str:
    """Class name, parameter count and a hash of the module tree (part of a result's key)."""
    n = sum(p.numel() for p in network.parameters())
    digest = hashlib.sha1(repr(network).encode()).hexdigest()[:10]
    return f"{type(network).__name__}-{n}-{digest}"


def layout_name(fmt: torch.memory_format) -> str:
    """``"channels_last_3d"`` / ``"contiguous_format"``: a memory format as a result records it."""
    return str(fmt).removeprefix("torch.")


@dataclass
class CacheChoice:
    """Where the training cache goes, for which batch size, and why.

    Attributes:
        where: ``"gpu"``, ``"ram"``, ``"disk"``, ``"smartcache"`` or ``"none"``.
        batch_size: the training batch it goes with (the pick, or a smaller one traded for a device cache).
        budget_mib: device memory left for the cache next to that batch; the recipes' ``cache_budget_mib``.
        cache_mib: the cache's measured size, safety margin included.
        reasons: how the choice was made, for the tuning table and the run's notes.
    """

    where: str
    batch_size: int
    budget_mib: float
    cache_mib: float
    reasons: list[str] = field(default_factory=list)


def place_cache(
    trials: Sequence[dict],
    pick: int,
    precision: str,
    budget_mib: float,
    cache_bytes: int,
    device: torch.device | str,
    val_peak_mib: float = 0.0,
    plan_for: Callable[[int], str] | None = None,
    tradeoff: float = 0.05,
) -> CacheChoice:
    """Choose the cache's place and the batch size it goes with, from the tuner's measured trials: device memory
    next to the pick, else next to a smaller batch within ``tradeoff`` of its throughput, else the planner's place.

    Args:
        trials: the tuner's trials (``TuneResult.trials``); ``train`` trials of ``precision`` count.
        pick: the throughput pick's batch size.
        precision: the precision the pick was measured in.
        budget_mib: memory a candidate may peak at (``TuneResult.budget_mib``).
        cache_bytes: the cache's size with its safety margin (``CachePlan.total_bytes``).
        device: the training device; device memory is GPU memory on CUDA, RAM on a CPU.
        val_peak_mib: the picked validation setting's peak, which the cache has to live with too.
        plan_for: budget bytes -> the planner's place (default ``"ram"`` on CUDA, ``"smartcache"`` on a CPU).
        tradeoff: largest share of training throughput given up for a cache in device memory.

    Raises:
        ValueError: ``pick`` has no feasible ``train`` trial of ``precision``, or a bad ``tradeoff`` / ``cache_bytes``.

    Examples:
        >>> trials = [{"phase": "train", "precision": "fp32", "value": v, "feasible": True, "throughput": t,
        ...            "peak_mib": p} for v, t, p in ((2, 96.0, 3000.0), (4, 100.0, 6000.0))]
        >>> choice = place_cache(trials, pick=4, precision="fp32", budget_mib=8000.0, cache_bytes=4000 * 2**20,
        ...                      device="cuda", val_peak_mib=2000.0)
        >>> choice.where, choice.batch_size, choice.budget_mib
        ('gpu', 2, 5000.0)
    """
    if not 0.0 <= tradeoff < 1.0:
        raise ValueError(f"tradeoff must be in [0, 1), got {tradeoff}")
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    device = torch.device(device)
    home = "gpu" if device.type == "cuda" else "ram"
    train = {
        t["value"]: t
        for t in trials
        if t["phase"] == "train" and t["precision"] == precision and t["feasible"] and t["peak_mib"] is not None
    }
    if pick not in train:
        raise ValueError(f"batch size {pick} has no feasible {precision} training trial to take its peak memory from")
    need_mib = cache_bytes / MIB

    def left(batch: int) -> float:
        return max(0.0, budget_mib - max(train[batch]["peak_mib"], val_peak_mib))

    best = train[pick]["throughput"]
    reasons = [f"cache of {need_mib:.0f} MiB (measured on a few items, margin included)"]
    if need_mib <= left(pick):
        reasons.append(
            f"fits in {'GPU' if home == 'gpu' else 'RAM'} next to batch {pick}: "
            f"{left(pick):.0f} MiB left of the {budget_mib:.0f} MiB budget"
        )
        return CacheChoice(home, pick, left(pick), need_mib, reasons)
    reasons.append(f"does not fit next to batch {pick} ({left(pick):.0f} MiB left)")
    for b in sorted((b for b in train if b < pick), key=lambda b: -train[b]["throughput"]):
        share = train[b]["throughput"] / best
        if share < 1.0 - tradeoff:
            break
        if need_mib <= left(b):
            reasons.append(
                f"batch {b} instead: {100 * (1 - share):.1f} % less training throughput, and the cache "
                f"fits next to it ({left(b):.0f} MiB left), so no host-to-device copies or CPU transforms"
            )
            return CacheChoice(home, b, left(b), need_mib, reasons)
    fallback = plan_for(int(left(pick) * MIB)) if plan_for is not None else ("ram" if home == "gpu" else "smartcache")
    reasons.append(
        f"no batch within {100 * tradeoff:.0f} % of the pick's throughput leaves room for it: "
        f"the planner puts it in {fallback}"
    )
    return CacheChoice(fallback, pick, left(pick), need_mib, reasons)
