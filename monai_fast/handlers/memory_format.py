"""Choose the network's memory format (``channels_last_3d`` or contiguous) by measuring copies of it.

``channels_last_3d`` speeds 3D convolutions up on some devices and precisions and slows them down
on others, so copies of the network (the real one untouched) are timed in each layout in
interleaved rounds (`monai_fast.tune.rounds.decide`); a near-tie keeps the network's own layout.
Under DDP rank 0 decides and every rank takes its answer.

Examples:
    >>> import torch
    >>> from monai_fast.handlers.memory_format import choose_memory_format
    >>> net = torch.nn.Conv3d(1, 4, 3)
    >>> batch = {"image": torch.zeros(2, 1, 8, 8, 8)}
    >>> choose_memory_format(net, batch, "cpu", None, "contiguous")[0]
    'contiguous'
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from monai_fast.handlers.throughput import batch_shape
from monai_fast.telemetry.memory import is_out_of_memory
from monai_fast.tune.measure import training_step_s
from monai_fast.tune.rounds import Decision, at_measure_batch, decide, decided_on_rank0, network_copy

__all__ = ["MEMORY_FORMATS", "choose_memory_format", "in_channels_last_3d", "layout_pinned"]

#: the layouts by the names the choice and the run record use
MEMORY_FORMATS = {"channels_last_3d": torch.channels_last_3d, "contiguous": torch.contiguous_format}


def _measure(
    network: torch.nn.Module,
    shape: torch.Size,
    device: torch.device,
    dtype: torch.dtype | None,
    max_rounds: int,
    planned_steps: int | None,
    users_last: bool,
) -> Decision:
    """Interleaved rounds of a training step on copies in the network's own layout and in the other one."""
    plain = network_copy(network).to(device).train().to(memory_format=torch.contiguous_format)
    last = network_copy(network).to(device).train().to(memory_format=torch.channels_last_3d)
    x = torch.randn(shape, device=device)
    x_last = x.contiguous(memory_format=torch.channels_last_3d)
    ways = {
        "contiguous": lambda: training_step_s(plain, x, dtype),
        "channels_last_3d": lambda: training_step_s(last, x_last, dtype),
    }
    names = ("channels_last_3d", "contiguous") if users_last else ("contiguous", "channels_last_3d")
    return decide(
        ways[names[0]],
        ways[names[1]],
        names=names,
        max_rounds=max(3, max_rounds),
        planned_steps=planned_steps,
    )


def layout_pinned(network: Any) -> str | None:
    """Why ``network``'s weights must keep their layout, else None: a ``DistributedDataParallel`` built with
    ``find_unused_parameters=True`` (and no static graph) never rebuilds its gradient buckets, so weights moved
    after it was built would have every gradient copied across layouts for the rest of the run.

    Examples:
        >>> layout_pinned(torch.nn.Conv3d(1, 4, 3)) is None
        True
    """
    ddp = isinstance(network, torch.nn.parallel.DistributedDataParallel)
    if ddp and network.find_unused_parameters and not network.static_graph:
        return (
            "DistributedDataParallel(find_unused_parameters=True) keeps its gradient buckets in the layout it was "
            "built in (move the network to channels_last_3d before wrapping it)"
        )
    return None


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
    rounds: int = 5,
    planned_steps: int | None = None,
    left_s: float | None = None,
) -> tuple[str, str, dict[str, Any] | None]:
    """``("channels_last_3d" | "contiguous", reason, evidence)`` for ``network`` on batches like ``batch``.

    Args:
        network: the network (a DDP wrapper is looked through); only copies of it are run.
        batch: a batch as the engine sees it; its image tensor gives the shape.
        device: where the network trains.
        dtype: the autocast dtype of the run, ``None`` for fp32.
        request: ``"auto"`` (measure), ``"channels_last_3d"`` (use it if the network accepts it)
            or ``"contiguous"``.
        rounds: interleaved rounds per layout, at most (at least three are always run, or none).
        planned_steps: the run's planned training iterations (epochs x epoch length), which bound the
            measurement's time and say whether it runs at the batch's own size (`measure_batch`);
            ``None``: every round unless the answer is clear, at a batch of at most 2.
        left_s: the run's seconds left under a wall-clock limit (``None``: no limit; `at_measure_batch`).

    Returns:
        The layout, one sentence why, and the measured rounds (`Decision.as_row`, the ``batch`` shape measured
        and ``step_s``, the median step in the layout kept; ``None`` when nothing was measured).
    """
    net = getattr(network, "module", network)  # DDP / DataParallel
    users_last = in_channels_last_3d(net)
    if pinned := layout_pinned(network):
        return ("channels_last_3d" if users_last else "contiguous"), f"layout kept: {pinned}", None
    if request == "contiguous":
        return "contiguous", "the default layout requested", None
    if request == "channels_last_3d" and users_last:
        return "channels_last_3d", "requested (the weights are in it already)", None
    found = batch_shape(batch)
    if found is None or len(found) != 5:
        return "contiguous", "the inputs are not 5-D volumes (N, C, D, H, W): nothing to reorder", None
    device = torch.device(device)

    def measure_at(n: int) -> list[Any]:
        shape = torch.Size([n, *found[1:]])
        if request == "channels_last_3d":  # one step in it: does the network accept the layout?
            last = network_copy(net).to(device).train().to(memory_format=torch.channels_last_3d)
            training_step_s(
                last, torch.randn(shape, device=device).contiguous(memory_format=torch.channels_last_3d), dtype
            )
            return ["channels_last_3d", "requested (the network accepts it)", None]
        measured = _measure(net, shape, device, dtype, rounds, planned_steps, users_last)
        kept = measured.names.index(measured.choice)
        step_s = round(statistics.median(r[kept] for r in measured.rounds), 6) if measured.rounds else None
        return [
            measured.choice,
            f"{measured.reason} (batch {tuple(shape)})",
            {**measured.as_row(), "batch": list(shape), "step_s": step_s},
        ]

    def measure() -> list[Any]:
        try:  # the run's own batch where the plan affords it, else (or where that runs out of memory) 2 items
            return at_measure_batch(measure_at, found[0], planned_steps, left_s)
        except Exception as e:  # noqa: BLE001 - a network that rejects the layout keeps its own
            why = "out of memory measuring it" if is_out_of_memory(e) else "the network rejects channels_last_3d"
            return ["contiguous", f"{why} ({type(e).__name__}: {e})", None]

    layout, reason, evidence = decided_on_rank0(measure, device)
    return layout, reason, evidence
