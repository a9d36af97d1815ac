"""Ignite event handlers; each one ``attach(engine)``es to any ignite ``Engine``, MONAI's included."""

from monai_fast.handlers.time_breakdown import EpochTimes, TimeBreakdown
from monai_fast.handlers.time_to_target import TimeToTarget

__all__ = ["EpochTimes", "TimeBreakdown", "TimeToTarget"]
