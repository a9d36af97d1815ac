"""Thin wrappers over hardware libraries (CUDA via torch); nothing else in monai_fast touches them."""

from monai_fast.telemetry.cuda import cuda_available, device_description, synchronize

__all__ = ["cuda_available", "device_description", "synchronize"]
