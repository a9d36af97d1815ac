"""Thin wrappers over hardware libraries (CUDA via torch, NVML, NVTX); nothing else in monai_fast touches them."""

from monai_fast.telemetry.cuda import (
    bf16_supported,
    cuda_available,
    cuda_free_bytes,
    cuda_rng_states,
    current_cuda_device,
    device_description,
    set_cuda_device,
    set_cuda_rng_states,
    synchronize,
)

__all__ = [
    "bf16_supported",
    "cuda_available",
    "cuda_free_bytes",
    "cuda_rng_states",
    "current_cuda_device",
    "device_description",
    "set_cuda_device",
    "set_cuda_rng_states",
    "synchronize",
]
