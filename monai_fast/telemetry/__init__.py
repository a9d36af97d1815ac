"""Thin wrappers over hardware libraries (CUDA via torch); nothing else in monai_fast touches them."""

from monai_fast.telemetry.cuda import bf16_supported, cuda_available, cuda_free_bytes, device_description, synchronize

__all__ = ["bf16_supported", "cuda_available", "cuda_free_bytes", "device_description", "synchronize"]
