"""Choose the network's memory format (``channels_last_3d`` or contiguous) by measuring a copy of it.

``channels_last_3d`` speeds 3D convolutions up where the convolution kernels prefer it (many GPU
and some CPU/precision combinations) and slows them down elsewhere, so it is measured: a deep
copy of the network (the real one, its weights and batch-norm statistics, is untouched) runs a
forward and backward pass on a random batch of the real batch's shape, in the run's precision, in
each layout, interleaved over a few rounds; the median decides. The rounds stop early once the answer
is clear, or once they took their share of the planned run: a training step of a large network takes
seconds on a CPU, and a near-tie is worth more measuring to a long run than to a short one. Under DDP
rank 0 decides and every rank takes its answer.

Examples:
    >>> import torch
    >>> from monai_fast.handlers.memory_format import choose_memory_format
    >>> net = torch.nn.Conv3d(1, 4, 3)
    >>> choice, why = choose_memory_format(net, {"image": torch.zeros(2, 1, 8, 8, 8)}, "cpu", None, "contiguous")
    >>> choice
    'contiguous'
"""

from __future__ import annotations

import copy
import statistics
import time
from contextlib import nullcontext
from typing import Any

import ignite.distributed as idist
import torch

from monai_fast.handlers.throughput import batch_shape

__all__ = [
    "CLEAR_MARGIN",
    "MEASURE_MIN_S",
    "MEASURE_SHARE",
    "MIN_GAIN",
    "choose_memory_format",
    "in_channels_last_3d",
    "measure_budget_s",
    "settled",
]

#: the measured speed-up ``channels_last_3d`` must show to be chosen
MIN_GAIN = 1.05


def _step_s(net: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> float:
    ctx = torch.autocast(x.device.type, dtype=dtype) if dtype is not None else nullcontext()
    t0 = time.perf_counter()
    with ctx:
        out = net(x)
    loss = (out[0] if isinstance(out, (list, tuple)) else out).float().mean()
    loss.backward()
    if x.device.type == "cuda":
        from monai_fast.telemetry import synchronize

        synchronize(x.device)
    net.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _measure(
    network: torch.nn.Module,
    shape: torch.Size,
    device: torch.device,
    dtype: torch.dtype | None,
    rounds: int,
    planned_steps: int | None = None,
) -> tuple[float, float, int]:
    """Median seconds of a training step in the default layout and in ``channels_last_3d``, and the rounds run.

    The rounds stop once the answer is clear (`settled()`), or once they took their share of the run
    (`measure_budget_s()` of ``planned_steps`` at the warm-up's step time); at least one round runs.
    """
    started = time.perf_counter()
    plain = copy.deepcopy(network).to(device).train()
    last = copy.deepcopy(network).to(device).train().to(memory_format=torch.channels_last_3d)
    x = torch.randn(shape, device=device)
    x_last = x.contiguous(memory_format=torch.channels_last_3d)
    warm = _step_s(plain, x, dtype), _step_s(last, x_last, dtype)  # warm-up: allocator, kernel choice
    if rounds < 1:
        return (*warm, 0)
    budget_s = measure_budget_s(planned_steps, min(warm))
    times: dict[str, list[float]] = {"plain": [], "last": []}
    for _ in range(rounds):
        times["plain"].append(_step_s(plain, x, dtype))
        times["last"].append(_step_s(last, x_last, dtype))
        if settled(times["plain"], times["last"]) or time.perf_counter() - started >= budget_s:
            break
    return statistics.median(times["plain"]), statistics.median(times["last"]), len(times["plain"])


#: how far from `MIN_GAIN` a measured gain must be for one round to decide (step times vary by a few %)
CLEAR_MARGIN = 1.2
#: the share of the run's planned training time the measurement may take beyond its first round
MEASURE_SHARE = 0.01
#: and the seconds it may always take (a short run of a small network measures every round)
MEASURE_MIN_S = 10.0


def measure_budget_s(planned_steps: int | None, step_s: float) -> float:
    """Seconds the layout measurement may run: `MEASURE_SHARE` of the planned run, at least
    `MEASURE_MIN_S`; unbounded when the run's length is not known.

    A near-tie costs a long run more than the measurement does, a short run less: a 6-iteration run of a
    network whose step takes 6 s measures one round, a 2000-iteration one every round.

    Examples:
        >>> measure_budget_s(6, 6.5), measure_budget_s(2000, 6.5)
        (10.0, 130.0)
    """
    if planned_steps is None or planned_steps <= 0:
        return float("inf")
    return max(MEASURE_MIN_S, MEASURE_SHARE * planned_steps * step_s)


def settled(plain_s: list[float], last_s: list[float]) -> bool:
    """Whether the rounds so far decide the layout: the gain is clearly above or below `MIN_GAIN`.

    A large network's training step takes seconds on a CPU, and each round runs two of them, so the
    measurement stops as soon as the answer is plain (a clear gain or a clear loss) instead of always
    running every round.

    Examples:
        >>> settled([1.0], [0.5]), settled([1.0], [1.6]), settled([1.0], [0.97])
        (True, True, False)
    """
    if not plain_s or not last_s:
        return False
    gain = statistics.median(plain_s) / max(statistics.median(last_s), 1e-12)
    return gain >= MIN_GAIN * CLEAR_MARGIN or gain <= 1.0 / CLEAR_MARGIN


def in_channels_last_3d(network: torch.nn.Module) -> bool:
    """Whether all the network's 5-D weights are in ``channels_last_3d``, at least one unambiguously.

    A weight with one input channel has the same strides in both layouts, so it decides nothing.

    Examples:
        >>> in_channels_last_3d(torch.nn.Conv3d(2, 4, 3).to(memory_format=torch.channels_last_3d))
        True
        >>> in_channels_last_3d(torch.nn.Conv3d(1, 4, 3))
        False
    """
    weights = [p for p in network.parameters() if p.dim() == 5]
    last = [p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights]
    return all(last) and any(is_last and not p.is_contiguous() for p, is_last in zip(weights, last, strict=True))


def choose_memory_format(
    network: torch.nn.Module,
    batch: Any,
    device: torch.device | str,
    dtype: torch.dtype | None,
    request: str = "auto",
    rounds: int = 3,
    planned_steps: int | None = None,
) -> tuple[str, str]:
    """``("channels_last_3d" | "contiguous", reason)`` for ``network`` on batches like ``batch``.

    Args:
        network: the network (a DDP wrapper is looked through); only copies of it are run.
        batch: a batch as the engine sees it; its image tensor gives the shape.
        device: where the network trains.
        dtype: the autocast dtype of the run, ``None`` for fp32.
        request: ``"auto"`` (measure), ``"channels_last_3d"`` (use it if the network accepts it)
            or ``"contiguous"``.
        rounds: interleaved measurements per layout, at most: they stop once the answer is clear
            (`settled()`) or the measurement took its share of the run (`measure_budget_s()`).
        planned_steps: the run's planned training iterations (epochs x epoch length), which bound the
            measurement's time; ``None``: every round unless the answer is clear.
    """
    if request == "contiguous":
        return "contiguous", "the default layout requested"
    net = getattr(network, "module", network)  # DDP / DataParallel
    if request == "channels_last_3d" and in_channels_last_3d(net):
        return "channels_last_3d", "requested (the weights are in it already)"
    found = batch_shape(batch)
    if found is None or len(found) != 5:
        return "contiguous", "the inputs are not 5-D volumes (N, C, D, H, W): nothing to reorder"
    shape = torch.Size([min(found[0], 2), *found[1:]])
    device = torch.device(device)
    decision: list[Any] = [None, None]
    if idist.get_rank() == 0:
        try:
            with torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []
            ):  # the run's random stream is untouched
                plain_s, last_s, ran = _measure(
                    net, shape, device, dtype, rounds if request == "auto" else 0, planned_steps
                )
        except Exception as e:  # noqa: BLE001 - a network that rejects the layout keeps its own
            decision = ["contiguous", f"the network rejects channels_last_3d ({type(e).__name__}: {e})"]
        else:
            gain = plain_s / last_s if last_s > 0 else 0.0
            if request == "channels_last_3d":
                decision = ["channels_last_3d", "requested (the network accepts it)"]
            elif gain >= MIN_GAIN:
                decision = [
                    "channels_last_3d",
                    f"a training step measured {gain:.2f}x faster in it ({last_s * 1e3:.0f} ms vs "
                    f"{plain_s * 1e3:.0f} ms, median of {ran}, batch {tuple(shape)})",
                ]
            else:
                decision = [
                    "contiguous",
                    f"channels_last_3d measured {gain:.2f}x (below {MIN_GAIN}x) for batch {tuple(shape)}",
                ]
    if idist.get_world_size() > 1:
        decision = [idist.broadcast(d, src=0, safe_mode=True) for d in decision]
    return decision[0], decision[1]
