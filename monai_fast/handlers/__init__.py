"""Ignite event handlers, their results and errors; each one ``attach(engine)``es to any ignite ``Engine``.

See docs/handlers.md.
"""

from monai_fast.handlers.algorithm_time import AlgorithmTimes, TrainingAlgorithmTime
from monai_fast.handlers.amp import AMPToggle
from monai_fast.handlers.background_validation import BackgroundValidation, BackgroundValidationError
from monai_fast.handlers.compile import CompileChoice
from monai_fast.handlers.core_pin import MainThreadCore
from monai_fast.handlers.epoch_length_guard import EpochLengthGuard, ShortEpochError
from monai_fast.handlers.fast_training import FastTraining
from monai_fast.handlers.gpu_sampler import GPUSampler
from monai_fast.handlers.inference_split import InferenceSplit, InferenceTimes
from monai_fast.handlers.kernel_profiler import KernelProfiler
from monai_fast.handlers.memory_format import LayoutChoice
from monai_fast.handlers.nonfinite import NonFiniteGuard, NonFiniteLossError
from monai_fast.handlers.nvtx import NVTXHandler
from monai_fast.handlers.prediction_layout import ClassesInnermost
from monai_fast.handlers.preemption import Preemption
from monai_fast.handlers.prefetch import PrefetchChoice
from monai_fast.handlers.record import RecordHandler
from monai_fast.handlers.smartcache import SmartCacheUpdater
from monai_fast.handlers.throughput import ThroughputMonitor
from monai_fast.handlers.time_breakdown import EpochTimes, TimeBreakdown
from monai_fast.handlers.time_to_target import TimeToTarget
from monai_fast.handlers.validation_schedule import ValidationSchedule
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
