"""What the tuner searches: value ranges, precisions, validation devices, search strategy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from monai_fast.telemetry.memory import DeviceMemory
from monai_fast.telemetry.precision import PRECISIONS

__all__ = ["SearchSpace"]


@dataclass
class SearchSpace:
    """What to search, in the spirit of Auto3DSeg's ``gpu_customization_specs``.

    Args:
        batch_range: inclusive range of training batch sizes in volumes (``range_num_images_per_batch``).
        sw_batch_range: inclusive range of sliding-window batch sizes (``range_num_sw_batch_size``).
        val_devices: where the validation volume and stitched output live; ``None``: the training device,
            plus ``"cpu"`` when that is a GPU.
        precisions: precisions to compare (``"bf16"``, ``"fp16"``, ``"fp32"``).
        max_trials: most candidates run per search (``num_trials``).
        plateau: a doubling gaining less than this share ends the growth; ``None``: grow until one does not fit.
        margin: share of the memory cap kept free (fragmentation, the data cache, spikes).
        strategy: ``"search"`` (grow, then bisect) or ``"grid"`` (every value of both ranges).
        confirm: confirmation rounds among the best candidates of a search (`confirm_best()`); 0: none.
        confirm_top: candidates that enter the confirmation rounds (at least 2).

    Examples:
        >>> SearchSpace.from_auto3dseg({"range_num_images_per_batch": [1, 20], "num_trials": 6}).batch_range
        (1, 20)
    """

    batch_range: tuple[int, int] = (1, 16)
    sw_batch_range: tuple[int, int] = (1, 32)
    val_devices: Sequence[str] | None = None
    precisions: Sequence[str] = ("fp32",)
    max_trials: int = 8
    plateau: float | None = 0.05
    margin: float = 0.1
    strategy: str = "search"
    confirm: int = 2
    confirm_top: int = 3

    def __post_init__(self) -> None:
        for name in ("batch_range", "sw_batch_range"):
            lo, hi = (int(v) for v in getattr(self, name))
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {getattr(self, name)}")
            setattr(self, name, (lo, hi))
        bad = [p for p in self.precisions if p not in PRECISIONS]
        if bad or not self.precisions:
            raise ValueError(f"precisions must be a non-empty subset of bf16, fp16, fp32; got {list(self.precisions)}")
        self.precisions = tuple(dict.fromkeys(self.precisions))
        for name, least in (("max_trials", 1), ("confirm", 0), ("confirm_top", 2)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.strategy not in ("search", "grid"):
            raise ValueError(f"strategy must be 'search' or 'grid', got {self.strategy!r}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.plateau is not None and self.plateau < 0:
            raise ValueError(f"plateau must be >= 0 or None, got {self.plateau}")

    def most_runs(self, value_range: tuple[int, int]) -> int:
        """Most trials one search of ``value_range`` runs: its candidates, then the confirmation rounds among its best.

        Examples:
            >>> SearchSpace(max_trials=8).most_runs((1, 16))  # 8 candidates, then rounds of 3 and 2
            13
        """
        lo, hi = value_range
        searched = hi - lo + 1 if self.strategy == "grid" else min(hi - lo + 1, self.max_trials)
        confirming, confirmed = min(self.confirm_top, searched), 0
        if confirming >= 2:
            for _ in range(self.confirm):
                confirmed += confirming
                confirming -= confirming > 2
        return searched + confirmed

    def budget_bytes(self, memory: DeviceMemory, cap_mib: float | None = None) -> int:
        """Bytes a trial may peak at: ``cap_mib``, else the GPU's memory, else this process's RSS plus the
        available RAM; less the `margin` share."""
        if cap_mib is not None:
            cap = cap_mib * 2**20
        elif memory.cuda:
            cap = memory.total_bytes()
        else:
            cap = psutil.Process().memory_info().rss + psutil.virtual_memory().available
        return int(cap * (1.0 - self.margin))

    @classmethod
    def from_auto3dseg(cls, specs: dict, **overrides) -> SearchSpace:
        """Build from Auto3DSeg-style keys; unknown keys are rejected by name."""
        names = {
            "range_num_images_per_batch": "batch_range",
            "range_num_sw_batch_size": "sw_batch_range",
            "num_trials": "max_trials",
            "validation_data_device": "val_devices",
        }
        unknown = sorted(set(specs) - set(names))
        if unknown:
            raise ValueError(f"unknown tuning key(s) {unknown}; known: {sorted(names)}")
        kwargs = {names[k]: v for k, v in specs.items()}
        if isinstance(kwargs.get("val_devices"), str):
            kwargs["val_devices"] = [kwargs["val_devices"]]
        kwargs.update(overrides)
        return cls(**kwargs)
