"""NVTX backends: the ``nvtx`` package for real, and a recorder for tests.

NVIDIA's ``nvtx`` package works on CPU-only builds (a no-op unless a profiler such as Nsight Systems is attached),
unlike the private ``torch._C._nvtx`` that MONAI's ``RangeHandler`` calls.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NvtxBackend", "PackageNvtx", "RecordingNvtx"]

DOMAIN = "monai-fast"


class NvtxBackend(Protocol):
    """Push and pop nested ranges on the calling thread."""

    def push(self, message: str, color: str) -> None: ...
    def pop(self) -> None: ...


class PackageNvtx:
    """Ranges through the ``nvtx`` package, in the ``monai-fast`` domain."""

    def __init__(self) -> None:
        from monai_fast.extras import require

        self._nvtx = require("nvtx", extra="nvidia", feature="NVTX ranges (NVTXHandler, nvtx_range)")

    def push(self, message: str, color: str) -> None:
        self._nvtx.push_range(message=message, color=color, domain=DOMAIN)

    def pop(self) -> None:
        self._nvtx.pop_range(domain=DOMAIN)


class RecordingNvtx:
    """Records ``("push", message, color)`` and ``("pop", message)`` in `calls`; for tests."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._stack: list[str] = []

    def push(self, message: str, color: str) -> None:
        self._stack.append(message)
        self.calls.append(("push", message, color))

    def pop(self) -> None:
        if not self._stack:
            raise RuntimeError("pop without a matching push")
        self.calls.append(("pop", self._stack.pop()))

    @property
    def open_ranges(self) -> list[str]:
        return list(self._stack)
