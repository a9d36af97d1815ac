"""What the tuner picked and every trial it made, as a table and as recipe options."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

__all__ = ["Tunable", "TuneResult", "layout_name", "model_signature", "trial_setting", "trial_throughput"]

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
