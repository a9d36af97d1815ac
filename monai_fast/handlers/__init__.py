"""Ignite event handlers, their results and errors; each one ``attach(engine)``es to any ignite ``Engine``.

See docs/handlers.md.
"""

from monai_fast.handlers.amp import AMPToggle
from monai_fast.handlers.compile import CompileChoice
from monai_fast.handlers.core_pin import MainThreadCore
from monai_fast.handlers.fast_training import FastTraining
from monai_fast.handlers.guards import EpochLengthGuard, NonFiniteGuard, NonFiniteLossError, ShortEpochError
from monai_fast.handlers.memory_format import LayoutChoice
from monai_fast.handlers.prediction_layout import ClassesInnermost
from monai_fast.handlers.preemption import Preemption
from monai_fast.handlers.prefetch import PrefetchChoice
from monai_fast.handlers.profiling import GPUSampler, KernelProfiler, NVTXHandler
from monai_fast.handlers.record import RecordHandler
from monai_fast.handlers.smartcache import SmartCacheUpdater
from monai_fast.handlers.throughput import ThroughputMonitor
from monai_fast.handlers.time_breakdown import (
    AlgorithmTimes,
    EpochTimes,
    InferenceSplit,
    InferenceTimes,
    TimeBreakdown,
    TrainingAlgorithmTime,
)
from monai_fast.handlers.validation_schedule import (
    BackgroundValidation,
    BackgroundValidationError,
    TimeToTarget,
    ValidationSchedule,
)
from monai_fast.handlers.window_tune import SlidingWindowTune

__all__ = [
    "AMPToggle",
    "AlgorithmTimes",
    "BackgroundValidation",
    "BackgroundValidationError",
    "ClassesInnermost",
    "CompileChoice",
    "EpochLengthGuard",
    "EpochTimes",
    "FastTraining",
    "GPUSampler",
    "InferenceSplit",
    "InferenceTimes",
    "KernelProfiler",
    "LayoutChoice",
    "MainThreadCore",
    "NVTXHandler",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "Preemption",
    "PrefetchChoice",
    "RecordHandler",
    "ShortEpochError",
    "SlidingWindowTune",
    "SmartCacheUpdater",
    "ThroughputMonitor",
    "TimeBreakdown",
    "TimeToTarget",
    "TrainingAlgorithmTime",
    "ValidationSchedule",
]
