"""Shared fixtures: tiny real NIfTI data sets in MSD layout, small real file systems, and the ``gpu`` marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tutorial_runs import tutorial_args

from monai_fast.apps.sources.synthetic import generate_msd

TINY_SHAPE = (48, 48, 32)


def pytest_collection_modifyitems(config, items):
    # GPU tests are reported as skipped with a reason (pytest -rs), never silently dropped
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu'); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_spleen(tmp_path_factory):
    """Six small spleen-like cases (48x48x32 voxels)."""
    return generate_msd(tmp_path_factory.mktemp("spleen"), "spleen-like", num_cases=6, shape=TINY_SHAPE, progress=False)


@pytest.fixture(scope="session")
def two_rank_reference(tmp_path_factory, tiny_spleen) -> Path:
    """The distributed tutorial uninterrupted under ``monai-fast launch --nproc 2``: its ``rank<N>.json`` folder.

    fp32, batch 1, 3 epochs on ``tiny_spleen``: 2 iterations per epoch and rank, bit-reproducible on a CPU. Two
    ranks end with the same weights whether they share a node or not (checked), so the torchrun, preemption and
    elastic-restart tests compare against this one run (made once per pytest worker).
    """
    out = tmp_path_factory.mktemp("two-rank-reference")
    done = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "launch", "--nproc", "2", *tutorial_args(tiny_spleen, out)],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=out,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_files(tiny_spleen):
    from monai_fast.apps.sources.msd import load_msd_datalist

    return load_msd_datalist(tiny_spleen, val_fraction=0.34, seed=0)


@pytest.fixture
def tiny_config():
    from monai_fast.apps.recipes import RecipeConfig

    return RecipeConfig(
        patch_size=(32, 32, 32), batch_size=2, num_samples=2, max_epochs=1, num_workers=1, cache_threads=1
    )


@pytest.fixture(autouse=True)
def _process_left_as_found():
    """Fail a test that leaves this process's torch thread count or CPU mask changed.

    A handler that changes them must give them back, and the next test on the same pytest worker
    must not inherit them (a thread count left at 1 changes what OpenMP pinning and prefetch decide).
    """

    def state() -> tuple[int, set[int] | None]:
        return torch.get_num_threads(), os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    before = state()
    yield
    after = state()
    if after != before:
        torch.set_num_threads(before[0])
        if before[1] is not None:
            os.sched_setaffinity(0, before[1])
        pytest.fail(f"the test left torch threads / CPU mask {after}, found {before}", pytrace=False)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # never read or write the user's real ~/.cache/monai-fast from a test
    monkeypatch.setenv("MONAI_FAST_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tmpfs(tmp_path):
    """Mount real small file systems: ``tmpfs("size=1M")`` or ``tmpfs("size=4M,nr_inodes=3", "name")``.

    Each is a tmpfs under ``tmp_path`` with the given mount options, unmounted after the test. Mounting
    needs root (CAP_SYS_ADMIN): without it the test is skipped with the reason.
    """
    mounted: list[Path] = []

    def mount(options: str = "size=1M", name: str = "small") -> Path:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def in_child_as_another_user(fn, max_processes: int | None = None) -> str:
    """``fn()``'s text (or its exception as ``"Type: message"``) from a forked child that runs as another user.

    Under root the child becomes ``nobody`` (65534), so it may not signal this process; ``max_processes`` sets
    the child's ``RLIMIT_NPROC``, which the kernel enforces on threads too once the child is not root.
    """
    import resource

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        signal.alarm(120)  # a child that hangs ends, and the test with it
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            if max_processes is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
            text = str(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            text = f"{type(e).__name__}: {e}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        return f.read()
