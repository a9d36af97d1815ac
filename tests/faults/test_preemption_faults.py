"""Preemption's reliability defects, each with real parts: real ignite/MONAI engines, real signals to real
processes, real damaged files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from tutorial_runs import tutorial_args

from monai_fast.handlers import Preemption


def _engine(tmp_path: Path, net: torch.nn.Module | None = None, **kwargs):
    """A real ignite trainer (SGD on a linear model, 4 iterations per epoch) with a Preemption."""
    net = net or torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    width = net.in_features

    def step(engine, batch):
        opt.zero_grad()
        loss = net(batch).sum()
        loss.backward()
        opt.step()
        return loss.item()

    engine = Engine(step)
    ran: list[int] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: ran.append(e.state.iteration))
    data = [torch.ones(1, width) * i for i in range(4)]
    pre = Preemption(
        {"trainer": engine, "model": net, "optimizer": opt}, tmp_path / "ck", **{"save_every": 2, **kwargs}
    )
    pre.attach(engine)
    return engine, pre, data, net, ran


def _entry(ck: Path, it: int) -> Path:
    """The checkpoint of iteration ``it`` in ``ck``, whatever its layout (file or folder)."""
    found = [p for p in ck.iterdir() if p.name.startswith(f"ckpt-{it:09d}")]
    assert len(found) == 1, sorted(p.name for p in ck.iterdir())
    return found[0]


def _snapshot(ck: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in ck.iterdir()}


# ------------------------------------------------------------------ resume at the end of a run


def test_rerunning_a_finished_run_is_a_no_op_and_more_epochs_continue(tmp_path, caplog):
    engine, _, data, net, _ = _engine(tmp_path)
    engine.run(data, max_epochs=2)  # checkpoints at 2, 4, 6, 8: the last is the end of the run
    final = net.weight.detach().clone()
    before = _snapshot(tmp_path / "ck")

    engine2, pre2, _, net2, ran2 = _engine(tmp_path)
    assert pre2.resume() == 8
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        engine2.run(data, max_epochs=2)
    assert ran2 == []  # nothing retrained
    assert engine2.state.iteration == 8 and engine2.state.epoch == 2
    assert torch.equal(net2.weight, final)
    assert "end of the run" in caplog.text and "nothing to do" in caplog.text
    assert _snapshot(tmp_path / "ck") == before  # the final checkpoint is neither replaced nor pruned

    engine3, pre3, _, _, ran3 = _engine(tmp_path)
    assert pre3.resume() == 8
    engine3.run(data, max_epochs=3)  # one more epoch: continues from the checkpoint
    assert ran3 == [9, 10, 11, 12]


def _tutorial(data: Path, out: Path, ck: Path, prog: Path, epochs: int) -> list[str]:
    extra = ("--checkpoint-dir", str(ck), "--save-every", "4", "--progress-file", str(prog))
    return [sys.executable, *tutorial_args(data, out, *extra, epochs=epochs)]


def test_requeued_finished_tutorial_run_does_not_retrain(tmp_path, tiny_spleen):
    # a finished --save-every run that SLURM requeues (or a user starts again) runs the MONAI trainer again
    out, ck, prog = tmp_path / "out", tmp_path / "ck", tmp_path / "progress"
    first = subprocess.run(_tutorial(tiny_spleen, out, ck, prog, 2), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    done = json.loads((out / "rank0.json").read_text())
    steps = prog.read_text().split()
    assert steps == [str(i) for i in range(1, 9)]

    again = subprocess.run(_tutorial(tiny_spleen, out, ck, prog, 2), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert prog.read_text().split() == steps  # no iteration ran
    assert "nothing to do" in again.stderr
    redo = json.loads((out / "rank0.json").read_text())
    assert redo["weights_sha1"] == done["weights_sha1"] and redo["resumed_from"] == 8

    more = subprocess.run(_tutorial(tiny_spleen, out, ck, prog, 3), capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr[-3000:]
    assert prog.read_text().split() == [str(i) for i in range(1, 13)]  # raised max_epochs: 9..12 on top


# ------------------------------------------------------------------ pruning next to damaged checkpoints


def test_pruning_keeps_the_new_checkpoint_when_damaged_higher_ones_exist(tmp_path, caplog):
    engine, _, data, _, _ = _engine(tmp_path)
    engine.run(data, max_epochs=1)  # checkpoints 2 and 4
    ck = tmp_path / "ck"
    src = _entry(ck, 4)
    for it in (10, 12):  # damaged copies with higher numbers (a full disk, a bad block)
        dst = ck / src.name.replace("000000004", f"{it:09d}")
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
        for f in [dst] if dst.is_file() else list(dst.iterdir()):
            f.write_bytes(f.read_bytes()[:64])

    engine2, pre2, _, _, ran2 = _engine(tmp_path)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        assert pre2.resume() == 4
        engine2.run(data, max_epochs=2)  # writes 6, then 8
    assert ran2 == [5, 6, 7, 8]
    names = sorted(p.name for p in ck.iterdir())
    assert any(n.startswith("ckpt-000000008") for n in names), names  # the one just written
    assert any(n.startswith("ckpt-000000006") for n in names), names  # the newest valid other one (n_saved=2)
    assert not any(n.startswith(("ckpt-000000002", "ckpt-000000004")) for n in names), names
    damaged = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert damaged and "ckpt-000000010" in damaged[0] and "ckpt-000000012" in damaged[0]


# ------------------------------------------------------------------ what to_save holds


def test_preemption_without_the_trainer_is_refused_at_attach(tmp_path):
    net = torch.nn.Linear(2, 1)
    engine = Engine(lambda e, b: None)
    pre = Preemption({"model": net}, tmp_path / "ck")
    with pytest.raises(ValueError, match="must include the engine"):
        pre.attach(engine)
    assert not pre.is_attached()


def test_checkpoint_of_another_model_names_the_file(tmp_path):
    engine, _, data, _, _ = _engine(tmp_path, net=torch.nn.Linear(3, 1))
    engine.run(data, max_epochs=1)
    newest = _entry(tmp_path / "ck", 4)
    _, pre2, _, _, _ = _engine(tmp_path, net=torch.nn.Linear(2, 1))
    with pytest.raises(RuntimeError) as info:
        pre2.resume()
    assert newest.name in str(info.value) and "size mismatch" in str(info.value)


class _Precision:
    """Stands for AMPToggle's precision: a plain object with state_dict/load_state_dict."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def state_dict(self) -> dict:
        return {"dtype": self.dtype}

    def load_state_dict(self, state: dict) -> None:
        self.dtype = state["dtype"]


def test_any_object_with_state_dict_in_to_save_is_checkpointed(tmp_path):
    engine = Engine(lambda e, b: None)
    pre = Preemption({"trainer": engine, "amp": _Precision("bf16")}, tmp_path / "ck", save_every=2)
    pre.attach(engine)
    engine.run([0, 1], max_epochs=1)
    engine2 = Engine(lambda e, b: None)
    amp2 = _Precision("fp32")
    pre2 = Preemption({"trainer": engine2, "amp": amp2}, tmp_path / "ck")
    pre2.attach(engine2)
    assert pre2.resume() == 2 and amp2.dtype == "bf16"


# ------------------------------------------------------------------ signals and the attach discipline


_BEFORE_RUN = textwrap.dedent("""
    import logging, sys, time
    from pathlib import Path
    import torch
    from ignite.engine import Engine, Events
    from monai_fast.handlers import Preemption

    logging.basicConfig(level=logging.INFO)
    tmp = Path(sys.argv[1])
    engine = Engine(lambda e, b: None)
    ran = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: ran.append(e.state.iteration))
    pre = Preemption({"trainer": engine, "model": torch.nn.Linear(2, 1)}, tmp / "ck", requeue=True)
    pre.attach(engine)
    (tmp / "ready").touch()
    deadline = time.monotonic() + 60
    while not (tmp / "go").exists():  # data checks, cache building: after attach, before run
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.run([0, 1, 2], max_epochs=2)
    print("iterations run:", len(ran), flush=True)
    pre.exit_if_preempted()
    print("not preempted", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_before_the_run_stops_it_at_once_and_requeues(tmp_path, sig):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # records the requeue instead of asking a cluster
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = subprocess.Popen(
        [sys.executable, "-c", _BEFORE_RUN, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()
            time.sleep(0.01)
        p.send_signal(sig)
        time.sleep(0.2)
        (tmp_path / "go").touch()
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-3000:]
    assert "iterations run: 0" in out and "not preempted" not in out
    assert f"{sig.name} before the run started" in out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]


def test_a_new_instance_replaces_the_old_one_and_restores_signal_handlers(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    engine = Engine(lambda e, b: None)
    net = torch.nn.Linear(2, 1)
    old = Preemption({"trainer": engine, "model": net}, tmp_path / "ck")
    old.attach(engine)
    assert signal.getsignal(signal.SIGUSR1) != before  # installed at attach, before any run
    assert signal.getsignal(signal.SIGUSR1) == old.stop_signal._on_signal
    new = Preemption({"trainer": engine, "model": net}, tmp_path / "ck")  # a re-run notebook cell
    new.attach(engine)
    assert not old.is_attached() and new.is_attached(engine)
    assert signal.getsignal(signal.SIGUSR1) == new.stop_signal._on_signal
    assert new.stop_signal._previous[signal.SIGUSR1] == before  # not chained to the old instance
    signal.raise_signal(signal.SIGUSR1)  # to this thread: handled before the next line
    assert new.stop_signal.received == signal.SIGUSR1 and old.stop_signal.received is None
    new.detach(engine)
    assert signal.getsignal(signal.SIGUSR1) == before
