"""NVML backends: nvidia-ml-py (``import pynvml``) for real, and a fake for tests; only this module touches NVML."""

from __future__ import annotations

import contextlib
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
    def uuid(self, index: int) -> str: ...
    def sample(self, index: int) -> dict[str, float]: ...
    def shutdown(self) -> None: ...


class PynvmlBackend:
    """Reads utilisation, memory, power, temperature and SM clock through nvidia-ml-py."""

    def __init__(self) -> None:
        from monai_fast.extras import MissingExtraError, require

        try:
            pynvml = require("pynvml", extra="nvidia", feature="GPU sampling through NVML")
        except MissingExtraError as e:  # the extra helps only where NVIDIA's driver runs
            why = str(e) if os.path.exists("/proc/driver/nvidia") else "no NVIDIA driver on this machine"
            raise NvmlUnavailable(why) from e
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

    def uuid(self, index: int) -> str:
        u = self._nvml.nvmlDeviceGetUUID(self._handle(index))
        return u.decode() if isinstance(u, bytes) else str(u)

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
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


class FakeNvml:
    """A deterministic stand-in for tests: utilisation follows ``util`` (cycled per sample); `threads` holds the
    thread of every sample."""

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

    def uuid(self, index: int) -> str:
        return f"GPU-00000000-0000-0000-0000-{index:012d}"

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
    """The real NVML backend, or `NvmlUnavailable` with the reason."""
    backend = PynvmlBackend()
    if backend.device_count() < 1:
        backend.shutdown()
        raise NvmlUnavailable("NVML found no GPU")
    return backend


def visible_gpu_indices(local_rank: int, backend: NvmlBackend | None = None, cuda_uuid: str | None = None) -> list[int]:
    """The NVML index of the GPU this process uses (one GPU per rank).

    NVML and CUDA number GPUs differently, so in order of reliability: the NVML device with ``cuda_uuid`` (the
    torch device's UUID); else ``local_rank``'s entry of ``CUDA_VISIBLE_DEVICES`` (a UUID looked up in NVML, an
    index taken as it is); else ``local_rank`` itself.
    """
    if cuda_uuid and backend is not None:
        found = _index_of_uuid(backend, cuda_uuid)
        if found is not None:
            return [found]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if local_rank < len(visible):
        entry = visible[local_rank]
        if entry.isdigit():
            return [int(entry)]
        if backend is not None:
            found = _index_of_uuid(backend, entry)
            if found is not None:
                return [found]
    return [local_rank]


def _index_of_uuid(backend: NvmlBackend, uuid: str) -> int | None:
    want = uuid.lower().removeprefix("gpu-")
    for i in range(backend.device_count()):
        have = backend.uuid(i).lower().removeprefix("gpu-")
        if have == want or (len(want) >= 8 and have.startswith(want)):  # CUDA accepts unique prefixes
            return i
    return None
