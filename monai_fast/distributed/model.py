"""Wrap a model and optimizer for the current job: DDP under torch.distributed, Horovod's optimizer under horovodrun."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from ignite import distributed as idist

from monai_fast.data.planner import rank_partition

__all__ = ["distribute", "fix_zero_grad_signature", "rank_share"]


def fix_zero_grad_signature(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Let ``optimizer.zero_grad(set_to_none=...)`` work on optimizers whose ``zero_grad()`` takes no argument.

    Horovod's ``DistributedOptimizer`` has ``zero_grad(self)``, which MONAI's trainers call with ``set_to_none``.
    The wrapper keeps Horovod's own check, then sets the gradients to ``None`` or zero as asked; optimizers that
    accept the argument are returned untouched.
    """
    original = optimizer.zero_grad
    try:
        if "set_to_none" in inspect.signature(original).parameters:
            return optimizer
    except (TypeError, ValueError):
        pass

    @functools.wraps(original)
    def zero_grad(set_to_none: bool = True) -> None:
        original()
        torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    return optimizer


def distribute(
    network: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``idist.auto_model`` + ``idist.auto_optim`` for the current backend; a no-op for one process.

    Under torch.distributed the network becomes a ``DistributedDataParallel``; under Horovod the parameters are
    broadcast and the optimizer becomes Horovod's, callable as MONAI's trainers call it (`fix_zero_grad_signature()`).
    """
    if idist.get_world_size() == 1:
        return network, optimizer
    network = idist.auto_model(network)
    optimizer = idist.auto_optim(optimizer)
    if idist.backend() == "horovod":
        optimizer = fix_zero_grad_signature(optimizer)
    return network, optimizer


def rank_share(files: Sequence[dict], even: bool = True, seed: int = 0) -> list[dict]:
    """This rank's share of ``files``; all of them for one process.

    ``even=True`` (training) pads by repeating items so every rank runs the same number of iterations, as DDP
    needs; ``even=False`` (validation) splits without repeats, so no case is counted twice.
    """
    world, rank = idist.get_world_size(), idist.get_rank()
    if world == 1:
        return list(files)
    if len(files) < world:
        raise ValueError(f"{len(files)} files cannot be shared by {world} ranks: every rank needs at least one")
    if even:
        return rank_partition(files, rank, world, seed)
    return list(files)[rank::world]
