"""Timed real iterations: one training step (of a network or a copy of it), one sliding-window validation pass.

Inputs are random tensors of the right shape: a step's cost does not depend on the voxel values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from monai.inferers import sliding_window_inference

from monai_fast.telemetry import synchronize
from monai_fast.telemetry.precision import autocast_dtype, autocast_for

__all__ = ["inference_call_s", "time_inference", "time_training_step", "training_step_s"]


def training_step_s(
    network: torch.nn.Module,
    x: torch.Tensor,
    dtype: torch.dtype | None,
    target: torch.Tensor | None = None,
    loss_function: Callable | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Seconds of one training step of ``network`` on ``x`` under autocast to ``dtype`` (``None``: fp32).

    The step is the forward, the loss (``loss_function(out, target)``, else the output's mean), the backward
    (through ``scaler`` when given) and the ``optimizer``'s step when given; the gradients are then dropped.
    Without an optimizer the weights stay as they are, so a copy of a network can be timed in its place.
    """
    t0 = time.perf_counter()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        out = network(x)
        if loss_function is not None:
            loss = loss_function(out, target)
    if loss_function is None:
        loss = (out[0] if isinstance(out, (list, tuple)) else out).float().mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if optimizer is not None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    network.zero_grad(set_to_none=True)
    synchronize(x.device)
    return time.perf_counter() - t0


def inference_call_s(network: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> float:
    """Seconds of one forward of ``network`` on ``x`` without gradients, under autocast to ``dtype`` (``None``: fp32),
    as an evaluator calls it on a batch of sliding windows."""
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        network(x)
    synchronize(x.device)
    return time.perf_counter() - t0


def _timed(step: Callable[[], float], warmup: int, min_iters: int, min_time_s: float) -> float:
    """Median seconds ``step`` returns after ``warmup`` calls, over at least ``min_iters`` calls and ``min_time_s``."""
    for _ in range(warmup):
        step()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - started < min_time_s:
        times.append(step())
        if len(times) >= 50:
            break
    return statistics.median(times)


def time_training_step(
    network: torch.nn.Module,
    loss_function: Callable,
    optimizer: torch.optim.Optimizer,
    batch: int,
    patch_size: Sequence[int],
    in_channels: int,
    out_channels: int,
    device: torch.device,
    precision: str = "fp32",
    warmup: int = 1,
    min_iters: int = 3,
    min_time_s: float = 0.5,
) -> float:
    """Median seconds of one forward + loss + backward + optimizer step on ``batch`` patches (fp16 with a
    ``GradScaler``, as MONAI's trainer)."""
    network.train()
    x = torch.rand(batch, in_channels, *patch_size, device=device)
    # class indices as float, as MONAI's loaders give labels (``LoadImaged``): losses that resize them take no ints
    y = torch.randint(0, out_channels, (batch, 1, *patch_size), device=device).float()
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    dtype = None if precision == "fp32" else autocast_dtype(precision)
    step = partial(training_step_s, network, x, dtype, y, loss_function, optimizer, scaler)
    try:
        return _timed(step, warmup, min_iters, min_time_s)
    finally:
        optimizer.zero_grad(set_to_none=True)


def time_inference(
    network: torch.nn.Module,
    roi_size: Sequence[int],
    sw_batch_size: int,
    volume_shape: Sequence[int],
    in_channels: int,
    device: torch.device,
    val_device: torch.device,
    precision: str = "fp32",
    overlap: float = 0.25,
    warmup: int = 1,
    min_iters: int = 2,
    min_time_s: float = 0.5,
) -> float:
    """Median seconds of a sliding-window pass over one ``volume_shape`` volume: the network on ``device``, the
    volume and the stitched output on ``val_device`` (MONAI's ``sw_device`` / ``device``)."""
    network.eval()
    image = torch.rand(1, in_channels, *volume_shape, device=val_device)

    def step() -> float:
        t0 = time.perf_counter()
        with torch.no_grad(), autocast_for(precision, device):
            out = sliding_window_inference(
                image, roi_size, sw_batch_size, network, overlap=overlap, sw_device=device, device=val_device
            )
        out.argmax(1)  # what post-processing does next; keeps the stitched output honest
        synchronize(device)
        return time.perf_counter() - t0

    try:
        return _timed(step, warmup, min_iters, min_time_s)
    finally:
        network.train()
