"""NVML backends: nvidia-ml-py (``import pynvml``) for real, and a fake for tests.

Only this module touches NVML. ``open_nvml()`` returns a backend or raises
:class:`NvmlUnavailable` with the reason (no driver library on a CPU machine, no GPU, ...).
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

__all__ = ["FakeNvml", "NvmlBackend", "NvmlUnavailable", "PynvmlBackend", "open_nvml", "visible_gpu_indices"]

FIELDS = ("gpu_util", "mem_util", "mem_used_mib", "mem_total_mib", "power_w", "temp_c", "sm_clock_mhz")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why."""


class NvmlBackend(Protocol):
    def device_count(self) -> int: ...

    def name(self, index: int) -> str: ...

    def sample(self, index: int) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


class PynvmlBackend:
    """Reads utilisation, memory, power, temperature and SM clock through nvidia-ml-py."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
            raise NvmlUnavailable(f"nvidia-ml-py is not installed: {e}") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not start ({e}); no NVIDIA driver on this machine?") from e
        self._nvml = pynvml
        self._handles: dict[int, object] = {}

    def _handle(self, index: int):
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def name(self, index: int) -> str:
        n = self._nvml.nvmlDeviceGetName(self._handle(index))
        return n.decode() if isinstance(n, bytes) else str(n)

    def sample(self, index: int) -> dict[str, float]:
        nv, h = self._nvml, self._handle(index)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        out = {
            "gpu_util": float(util.gpu),
            "mem_util": float(util.memory),
            "mem_used_mib": mem.used / 2**20,
            "mem_total_mib": mem.total / 2**20,
        }
        for key, read in (
            ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temp_c", lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            ("sm_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
        ):
            try:
                out[key] = read()
            except nv.NVMLError:  # not every board reports every sensor
                out[key] = float("nan")
        return out

    def shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class FakeNvml:
    """A deterministic stand-in for tests: utilisation follows ``util`` (a list cycled per sample).

    Records the thread of every sample in :attr:`threads`, so tests can check that sampling never
    happens on the training thread.
    """

    def __init__(self, count: int = 1, util: list[float] | None = None, mem_total_mib: float = 81920.0) -> None:
        self.count = count
        self.util = util or [50.0]
        self.mem_total_mib = mem_total_mib
        self.samples = 0
        self.threads: set[int] = set()
        self.closed = False

    def device_count(self) -> int:
        return self.count

    def name(self, index: int) -> str:
        return f"Fake GPU {index}"

    def sample(self, index: int) -> dict[str, float]:
        self.threads.add(threading.get_ident())
        u = self.util[self.samples % len(self.util)]
        self.samples += 1
        used = self.mem_total_mib * (0.1 + 0.5 * u / 100.0)
        return {
            "gpu_util": u,
            "mem_util": u / 2,
            "mem_used_mib": used,
            "mem_total_mib": self.mem_total_mib,
            "power_w": 100.0 + 3 * u,
            "temp_c": 40.0 + u / 5,
            "sm_clock_mhz": 1980.0,
        }

    def shutdown(self) -> None:
        self.closed = True


def open_nvml() -> NvmlBackend:
    """The real NVML backend, or :class:`NvmlUnavailable` with the reason."""
    backend = PynvmlBackend()
    if backend.device_count() < 1:
        backend.shutdown()
        raise NvmlUnavailable("NVML found no GPU")
    return backend


def visible_gpu_indices(local_rank: int) -> list[int]:
    """The NVML index of the GPU that local rank ``local_rank`` uses by convention (one GPU per
    rank), honouring ``CUDA_VISIBLE_DEVICES`` given as indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in ids) and local_rank < len(ids):
            return [int(ids[local_rank])]
    return [local_rank]
