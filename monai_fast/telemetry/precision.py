"""Precision in one place: the names, their autocast dtype, and the choice for a device.

``"auto"`` is bf16 on a GPU that runs it natively, else fp16; on a CPU bf16 only where it measures
faster (`choose_precision()`; the rules: docs/precision.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from ignite import distributed as idist

from monai_fast.precision_names import PRECISIONS, REQUESTS
from monai_fast.telemetry.cuda import bf16_supported, cpuinfo_value

__all__ = [
    "PRECISIONS",
    "REQUESTS",
    "autocast_dtype",
    "autocast_for",
    "check_precision",
    "choose_precision",
    "cpu_bf16_speedup",
    "cpu_has_bf16_hardware",
    "onednn_isa_limit",
]

logger = logging.getLogger("monai_fast.telemetry")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: bf16 must beat fp32 by this factor on a CPU to be chosen
MIN_CPU_GAIN = 1.1
#: a bf16 pass this many times slower than fp32, in the warm-up and in the first round, ends the measurement
CLEAR_CPU_LOSS = 4.0
#: capability flags (``torch.cpu.get_capabilities()`` / ``/proc/cpuinfo``) of native bf16 matrix hardware
_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "sve_bf16", "bf16")
#: oneDNN's x86 ISA limits (``ONEDNN_MAX_CPU_ISA``) below its bf16 kernels: bf16 is emulated under them
_ISA_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def check_precision(name: str, allow_auto: bool = False) -> str:
    """``name`` when it is a known precision (or ``"auto"`` with ``allow_auto``).

    Raises:
        ValueError: naming the allowed values.
    """
    allowed = REQUESTS if allow_auto else PRECISIONS
    if name not in allowed:
        raise ValueError(f"precision must be one of {', '.join(repr(a) for a in allowed)}; got {name!r}")
    return name


def autocast_dtype(precision: str) -> torch.dtype:
    """The dtype autocast runs in for ``precision`` (fp32: ``torch.float32``, autocast off)."""
    return _DTYPES.get(check_precision(precision), torch.float32)


def autocast_for(precision: str, device: torch.device | str) -> torch.autocast:
    """``torch.autocast`` for ``"bf16"``/``"fp16"`` on ``device``'s type; disabled for ``"fp32"``."""
    dtype = autocast_dtype(precision)
    on = precision != "fp32"
    return torch.autocast(torch.device(device).type, dtype=dtype if on else torch.bfloat16, enabled=on)


def _cpu_flags() -> Mapping[str, Any]:
    """This CPU's features: torch's public ``torch.cpu.get_capabilities()``, else ``/proc/cpuinfo`` flags."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        return get()
    return dict.fromkeys((cpuinfo_value("flags", "Features") or "").split(), True)


def onednn_isa_limit() -> str | None:
    """oneDNN's CPU ISA limit (``ONEDNN_MAX_CPU_ISA``, or the older ``DNNL_MAX_CPU_ISA``) when it keeps
    oneDNN below its bf16 kernels, else None: the hardware's bf16 units are then out of torch's reach."""
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return isa if isa in _ISA_WITHOUT_BF16 else None


def cpu_has_bf16_hardware(flags: Mapping[str, Any] | None = None) -> bool:
    """Whether this CPU has native bf16 matrix instructions (AMX-BF16, AVX512-BF16, Arm BF16) that torch can use.

    Args:
        flags: capability flags to judge; default this CPU's, where oneDNN limited below them
            (`onednn_isa_limit()`) counts as none.
    """
    if flags is None:
        if onednn_isa_limit():
            return False
        flags = _cpu_flags()
    return any(bool(flags.get(name)) for name in _BF16_FLAGS)


def cpu_bf16_speedup(rounds: int = 5) -> float:
    """fp32 time / bf16-autocast time of a small 3D convolution stack on this CPU (> 1: bf16 helps).

    Each cost is the calling thread's CPU time with torch on one thread, the least of interleaved rounds
    (docs/precision.md); a loss of `CLEAR_CPU_LOSS` in the warm-up and the first round ends it there.
    """
    net = torch.nn.Sequential(
        torch.nn.Conv3d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(16, 8, 3, padding=1)
    )
    x = torch.randn(2, 8, 32, 32, 32)

    def once(precision: str) -> float:
        with torch.no_grad(), autocast_for(precision, "cpu"):
            t = time.thread_time()
            net(x)
            return time.thread_time() - t

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # all the work in this thread, where thread_time sees it
    try:
        warm = once("fp32"), once("bf16")  # warm-up: oneDNN picks and caches its kernels
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        for _ in range(max(1, rounds)):
            for precision in ("fp32", "bf16"):
                times[precision].append(once(precision))
            if all(bf16 >= CLEAR_CPU_LOSS * fp32 for fp32, bf16 in (warm, (times["fp32"][0], times["bf16"][0]))):
                break  # emulated bf16: a clear loss twice, no need for seconds more of it
    finally:
        torch.set_num_threads(threads)
    return min(times["fp32"]) / max(min(times["bf16"]), 1e-9)


def _decide_cpu() -> str:
    """This process's choice between bf16 and fp32 on its CPU (hardware first, then a measurement)."""
    if not cpu_has_bf16_hardware():
        limit = onednn_isa_limit()
        why = f"oneDNN is limited to {limit} (ONEDNN_MAX_CPU_ISA), below" if limit else "this CPU has no"
        logger.info("precision: %s bf16 matrix hardware (AMX-BF16/AVX512-BF16); training in fp32", why)
        return "fp32"
    gain = cpu_bf16_speedup()
    if gain < MIN_CPU_GAIN:
        logger.warning(
            "precision: bf16 autocast is not faster on this CPU (fp32/bf16 time %.2f); training in fp32", gain
        )
        return "fp32"
    logger.info("precision: bf16 autocast measured %.1fx faster than fp32 on this CPU", gain)
    return "bf16"


def choose_precision(requested: str, device: torch.device | str) -> str:
    """Resolve ``"auto"``/``"bf16"``/``"fp16"``/``"fp32"`` for ``device`` (the rules: docs/precision.md).

    An explicit precision is returned as it is (fp16 needs CUDA). ``"auto"`` on a CPU in a job of several
    processes is decided on rank 0 and broadcast, so every rank must call this at the same point.

    Raises:
        ValueError: for ``"fp16"`` on a CPU, or an unknown name.

    Example:
        >>> choose_precision("auto", "cuda")  # on a GPU that runs bf16 natively
        'bf16'
    """
    check_precision(requested, allow_auto=True)
    device = torch.device(device)
    if device.type == "cuda":
        if requested == "auto":
            return "bf16" if bf16_supported(device) else "fp16"
        return requested
    if requested == "fp16":
        raise ValueError("precision 'fp16' needs a CUDA device; use 'bf16' or 'fp32' on a CPU")
    if requested != "auto":
        return requested
    if idist.get_world_size() == 1:
        return _decide_cpu()
    mine = _decide_cpu() if idist.get_rank() == 0 else None
    return str(idist.broadcast(mine, src=0, safe_mode=True))
