"""Inference backends: what runs the network on each sliding window (docs/inference.md); one this machine cannot
run is one `BackendUnavailable` naming what is missing, before any volume is read. `agreement()` compares their
predictions."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from monai_fast import extras
from monai_fast.apps.inference.checkpoint import InferenceError
from monai_fast.telemetry import cuda_available
from monai_fast.telemetry.precision import autocast_for, cpu_has_bf16_hardware

__all__ = [
    "BACKENDS",
    "MIN_DICE",
    "BackendUnavailable",
    "Predictor",
    "agreement",
    "available",
    "build_predictor",
    "missing",
    "onnx_model",
    "precision_of",
    "require",
]

logger = logging.getLogger(__name__)

BACKENDS = ("eager", "autocast", "compile", "onnx", "tensorrt")


class BackendUnavailable(InferenceError):
    """A backend this machine cannot run; the message names the backend and what is missing."""


@dataclass
class Predictor:
    """A backend's callable for MONAI's sliding window, built and warmed up.

    Attributes:
        backend: one of `BACKENDS`.
        detail: what runs, in words (``"bf16 autocast"``, ``"ONNX Runtime CPUExecutionProvider"``).
        prepare_s: seconds to build and warm it up (compilation, export, session creation).
    """

    backend: str
    detail: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    prepare_s: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def missing(backend: str, device: torch.device | str = "cpu") -> str | None:
    """What ``backend`` needs on ``device`` that this machine lacks, in words; ``None`` when it can run.

    Raises:
        InferenceError: ``backend`` is not one of `BACKENDS`.
    """
    if backend not in BACKENDS:
        raise InferenceError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    gpu = device.type == "cuda" and cuda_available()
    if device.type == "cuda" and not gpu:
        return f"a CUDA device for device {str(device)!r} (this torch build or machine has none)"
    if backend == "autocast" and device.type == "cpu" and not cpu_has_bf16_hardware():
        return (
            "bf16 matrix hardware (AMX-BF16 or AVX512-BF16) on this CPU: without it bf16 autocast is emulated and "
            "slower than fp32; run it on a CUDA device (fp16) or use backend 'eager'"
        )
    if backend == "compile" and device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "a C++ compiler (g++ or clang++) on the PATH for torch.compile's CPU kernels"
    absent = [m for m in ("onnx", "onnxruntime", "onnxscript") if not extras.available(m)] if backend == "onnx" else []
    if absent:
        return f'the Python package(s) {", ".join(absent)} (pip install "monai-fast[onnx]")'
    if backend == "tensorrt":
        needs = [] if gpu else [f"a CUDA GPU (device is {str(device)!r})"]
        if not extras.available("torch_tensorrt"):
            needs.insert(0, "the torch-tensorrt package (pip install torch-tensorrt)")
        return " and ".join(needs) or None
    return None


def require(backend: str, device: torch.device | str = "cpu") -> None:
    """Raise `BackendUnavailable` naming ``backend`` and what it lacks when it cannot run on ``device``."""
    lacking = missing(backend, device)
    if lacking is not None:
        raise BackendUnavailable(f"backend {backend!r} is not available here: it needs {lacking}")


def available(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Each backend of `BACKENDS` -> what it lacks on ``device`` (``None``: available)."""
    return {b: missing(b, device) for b in BACKENDS}


class _FixedBatch:
    """Calls ``fn`` on exactly ``batch`` windows: a short batch is padded with zeros and cut back, a long one split."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], batch: int) -> None:
        self.fn, self.batch = fn, batch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > self.batch:
            return torch.cat([self(x[i : i + self.batch]) for i in range(0, n, self.batch)])
        if n < self.batch:
            return self.fn(torch.cat([x, x.new_zeros((self.batch - n, *x.shape[1:]))]))[:n]
        return self.fn(x)


def onnx_model(network: torch.nn.Module, example: torch.Tensor) -> bytes:
    """``network`` exported to ONNX (``torch.onnx.export``) for inputs shaped like ``example``, serialised."""
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # not a line per torchvision op it skips
    try:
        program = torch.onnx.export(
            network, (example,), dynamo=True, verbose=False, input_names=["image"], output_names=["logits"]
        )
    finally:
        exporter_log.setLevel(level)
    return program.model_proto.SerializeToString()


def _onnx(network: torch.nn.Module, example: torch.Tensor, device: torch.device) -> tuple[Callable, str]:
    ort = extras.require("onnxruntime", extra="onnx", feature="backend 'onnx'")
    model = onnx_model(network, example)
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        else:
            logger.warning(
                "backend 'onnx': this onnxruntime has no CUDAExecutionProvider (pip install "
                "onnxruntime-gpu); the windows run on the CPU"
            )
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # the same cores torch would use
    options.log_severity_level = 3
    session = ort.InferenceSession(model, sess_options=options, providers=providers)
    name = session.get_inputs()[0].name

    def run(x: torch.Tensor) -> torch.Tensor:
        out = session.run(None, {name: np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)})[0]
        return torch.from_numpy(out).to(x.device)

    return run, f"ONNX Runtime {session.get_providers()[0]}"


def precision_of(backend: str, device: torch.device | str) -> str:
    """The precision ``backend``'s network runs at on ``device``: fp16 (CUDA) or bf16 for autocast, else fp32."""
    if backend == "autocast":
        return "fp16" if torch.device(device).type == "cuda" else "bf16"
    return "fp32"


def _build(network: torch.nn.Module, backend: str, example: torch.Tensor, device: torch.device) -> tuple[Callable, str]:
    if backend == "eager":
        return network, "fp32"
    if backend == "autocast":
        precision = precision_of(backend, device)

        def run(x: torch.Tensor) -> torch.Tensor:
            with autocast_for(precision, device):
                return network(x).float()

        return run, f"{precision} autocast"
    if backend == "compile":
        return torch.compile(network, dynamic=False), "torch.compile (inductor)"
    if backend == "onnx":
        return _onnx(network, example, device)
    import torch_tensorrt

    engine = torch_tensorrt.compile(
        network, ir="dynamo", inputs=[example], enabled_precisions={torch.float16, torch.float32}
    )
    return (lambda x: engine(x).float()), "TensorRT (torch-tensorrt, fp16 kernels)"


def build_predictor(
    network: torch.nn.Module,
    backend: str,
    roi_size: Sequence[int],
    sw_batch_size: int,
    device: torch.device | str = "cpu",
) -> Predictor:
    """``network`` (moved to ``device``, eval mode) behind ``backend``, built and warmed up on one window batch.

    Args:
        network: the trained network (``in_channels`` read from it, default 1).
        backend, device: one of `BACKENDS`; where the network runs.
        roi_size: the sliding window's size (the recipe's ``patch_size``).
        sw_batch_size: windows per call; static-shape backends are built for exactly this many (a short last
            batch padded and cut back).

    Raises:
        BackendUnavailable: the backend cannot run here (what is missing named), or building it failed.
    """
    device = torch.device(device)
    require(backend, device)
    network = network.to(device).eval()
    example = torch.zeros(sw_batch_size, int(getattr(network, "in_channels", 1)), *roi_size, device=device)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            fn, detail = _build(network, backend, example, device)
            if backend in ("compile", "onnx", "tensorrt"):
                fn = _FixedBatch(fn, sw_batch_size)
            fn(example)  # warm-up: compilation, kernel choice, session start
    except Exception as e:  # compilers and exporters raise many types; the backend is named, the cause chained
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise BackendUnavailable(f"backend {backend!r} failed to build on {device}: {type(e).__name__}: {first}") from e
    prepare_s = time.perf_counter() - t0
    logger.info("backend %s (%s) ready on %s in %.1f s", backend, detail, device, prepare_s)
    return Predictor(backend, detail, fn, prepare_s)


#: the mean Dice between a backend's predictions and eager fp32's that counts as agreeing
MIN_DICE = 0.99


def agreement(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor, num_classes: int = 2) -> dict[str, float]:
    """Mean Dice over the classes ``1..num_classes-1`` between label maps ``a`` and ``b``; the share of equal voxels.

    A class absent from both counts as Dice 1; maps of different shapes raise ``ValueError``.
    """
    a, b = (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (a, b))
    if a.shape != b.shape:
        raise ValueError(f"predictions of different shapes cannot be compared: {a.shape} and {b.shape}")
    dice = []
    for c in range(1, num_classes):
        in_a, in_b = a == c, b == c
        total = int(in_a.sum()) + int(in_b.sum())
        dice.append(1.0 if total == 0 else 2.0 * int(np.logical_and(in_a, in_b).sum()) / total)
    return {"dice": float(np.mean(dice)), "voxels": float((a == b).mean()) if a.size else 1.0}
