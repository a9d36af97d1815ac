"""The few CUDA calls monai-fast makes, kept in one place so a CPU-only torch build never hits them."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "bf16_supported",
    "cpuinfo_value",
    "cuda_available",
    "cuda_device_uuid",
    "cuda_free_bytes",
    "cuda_rng_states",
    "current_cuda_device",
    "device_description",
    "set_cuda_device",
    "seconds_between",
    "set_cuda_rng_states",
    "side_stream",
    "synchronize",
    "time_mark",
]


def cuda_available() -> bool:
    """True when this torch build has CUDA and a device is visible."""
    return torch.cuda.is_available()


def bf16_supported(device: torch.device | str) -> bool:
    """Whether a CUDA device runs bfloat16 natively (Ampere and later)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def cuda_free_bytes(device: torch.device | str) -> int | None:
    """Free memory on a CUDA device in bytes (``torch.cuda.mem_get_info``), ``None`` without CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free)


def cuda_rng_states() -> list[torch.Tensor] | None:
    """The random generator states of every visible CUDA device, ``None`` without CUDA."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_cuda_rng_states(states: list[torch.Tensor] | None) -> None:
    """Restore what `cuda_rng_states()` returned; a no-op for ``None`` or without CUDA."""
    if states is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states)


def cuda_device_uuid(device: torch.device | str | None = None) -> str | None:
    """The ``GPU-...`` UUID of a CUDA device (the current one by default), ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def current_cuda_device() -> torch.device | None:
    """The calling thread's current CUDA device (per thread), ``None`` before CUDA is initialised; creates no context.

    A thread that works for another one (a loader thread) calls `set_cuda_device()` with what this returned there.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def set_cuda_device(device: torch.device | str) -> torch.device:
    """Make ``device`` the current CUDA device; a no-op for CPU devices and for ``"cuda"`` without an index.

    Returns:
        ``device``, with the index of the current CUDA device where it named none.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    return dev


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued kernels on a CUDA ``device``; a no-op for CPU devices."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


def device_description(device: torch.device | str) -> str:
    """A human-readable name of the device that runs the work, for result files."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    model = cpuinfo_value("model name") or platform.processor() or platform.machine()
    return f"CPU {model} ({os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads)"


def cpuinfo_value(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line that starts with one of ``keys``; ``None`` without one."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(keys)), None)
    except OSError:
        return None


@contextmanager
def side_stream(device: torch.device | str | None) -> Iterator[None]:
    """Run the block on a fresh CUDA stream of ``device``; a plain block elsewhere (CPU, no CUDA, ``None``).

    The stream waits for the work queued on the current stream and is synchronized on exit: a background thread
    does not queue behind the training thread's kernels, and its results are ready when the block ends.
    """
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


Mark = float | torch.cuda.Event
"""A point in time from `time_mark()`: a host clock reading, or a CUDA event on the current stream."""


def time_mark(device: torch.device | str | None) -> Mark:
    """A point on ``device``'s timeline, without waiting, for `seconds_between()`: a CUDA event, else a host clock."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(dev))
        return event
    return time.perf_counter()


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end`` (two `time_mark()` marks); waits for a CUDA ``end`` to be reached."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    if isinstance(start, float) or isinstance(end, float):
        raise TypeError("seconds_between needs two marks of the same kind (two host readings or two CUDA events)")
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
