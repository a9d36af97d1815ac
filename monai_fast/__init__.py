"""monai-fast: fast 3D medical-image training with MONAI and PyTorch-Ignite.

Handlers that ``attach(engine)`` to any ignite ``Engine`` (``FastTraining().attach(trainer, evaluator)``),
importable from here. The names load on first use: ``import monai_fast`` alone does not load torch or MONAI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "FastTraining": "monai_fast.handlers.fast_training",
    "AMPToggle": "monai_fast.handlers.amp",
    "BackgroundValidation": "monai_fast.handlers.validation_schedule",
    "ClassesInnermost": "monai_fast.handlers.prediction_layout",
    "CompileChoice": "monai_fast.handlers.compile",
    "EpochLengthGuard": "monai_fast.handlers.guards",
    "GPUSampler": "monai_fast.handlers.profiling",
    "InferenceSplit": "monai_fast.handlers.time_breakdown",
    "KernelProfiler": "monai_fast.handlers.profiling",
    "MainThreadCore": "monai_fast.handlers.core_pin",
    "NVTXHandler": "monai_fast.handlers.profiling",
    "NonFiniteGuard": "monai_fast.handlers.guards",
    "Preemption": "monai_fast.handlers.preemption",
    "PrefetchChoice": "monai_fast.handlers.prefetch",
    "RecordHandler": "monai_fast.handlers.record",
    "SlidingWindowTune": "monai_fast.handlers.window_tune",
    "SmartCacheUpdater": "monai_fast.handlers.smartcache",
    "ThroughputMonitor": "monai_fast.handlers.throughput",
    "TimeBreakdown": "monai_fast.handlers.time_breakdown",
    "TimeToTarget": "monai_fast.handlers.validation_schedule",
    "ValidationSchedule": "monai_fast.handlers.validation_schedule",
    "SafeThreadDataLoader": "monai_fast.data.loaders",
    "SafeSmartCacheDataset": "monai_fast.data.smartcache",
    "TrustedPersistentDataset": "monai_fast.data.persistent",
    "plan_cache": "monai_fast.data.planner",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from monai_fast.data.loaders import SafeThreadDataLoader as SafeThreadDataLoader
    from monai_fast.data.persistent import TrustedPersistentDataset as TrustedPersistentDataset
    from monai_fast.data.planner import plan_cache as plan_cache
    from monai_fast.data.smartcache import SafeSmartCacheDataset as SafeSmartCacheDataset
    from monai_fast.handlers.amp import AMPToggle as AMPToggle
    from monai_fast.handlers.compile import CompileChoice as CompileChoice
    from monai_fast.handlers.core_pin import MainThreadCore as MainThreadCore
    from monai_fast.handlers.fast_training import FastTraining as FastTraining
    from monai_fast.handlers.guards import EpochLengthGuard as EpochLengthGuard
    from monai_fast.handlers.guards import NonFiniteGuard as NonFiniteGuard
    from monai_fast.handlers.prediction_layout import ClassesInnermost as ClassesInnermost
    from monai_fast.handlers.preemption import Preemption as Preemption
    from monai_fast.handlers.prefetch import PrefetchChoice as PrefetchChoice
    from monai_fast.handlers.profiling import GPUSampler as GPUSampler
    from monai_fast.handlers.profiling import KernelProfiler as KernelProfiler
    from monai_fast.handlers.profiling import NVTXHandler as NVTXHandler
    from monai_fast.handlers.record import RecordHandler as RecordHandler
    from monai_fast.handlers.smartcache import SmartCacheUpdater as SmartCacheUpdater
    from monai_fast.handlers.throughput import ThroughputMonitor as ThroughputMonitor
    from monai_fast.handlers.time_breakdown import InferenceSplit as InferenceSplit
    from monai_fast.handlers.time_breakdown import TimeBreakdown as TimeBreakdown
    from monai_fast.handlers.validation_schedule import BackgroundValidation as BackgroundValidation
    from monai_fast.handlers.validation_schedule import TimeToTarget as TimeToTarget
    from monai_fast.handlers.validation_schedule import ValidationSchedule as ValidationSchedule
    from monai_fast.handlers.window_tune import SlidingWindowTune as SlidingWindowTune


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monai_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
