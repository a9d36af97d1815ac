"""Preemption: a real signal to a real training process, resume, and equal final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from tutorial_runs import TUTORIAL, tutorial_args

from monai_fast.handlers import Preemption
from monai_fast.handlers.preemption import STOPPED_EXIT

_args = tutorial_args


def _progress(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _signal_after(cmd, progress: Path, n: int, sig=signal.SIGTERM, env=None, log=None) -> int:
    """Start cmd, send `sig` once `n` iterations completed; return the exit code."""
    p = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while len(_progress(progress)) < n:
            assert p.poll() is None, "the run ended before it could be signalled"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.send_signal(sig)
        return p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("stop_after, sig", [(6, signal.SIGTERM), (8, signal.SIGUSR1)])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, tiny_spleen, reference, stop_after, sig):
    # stop_after 6: mid-epoch (epoch 2, batch 2 of 4); 8: the signal lands at an epoch's end
    expected = json.loads((reference / "rank0.json").read_text())

    out, ck, prog = tmp_path / "run", tmp_path / "ckpt", tmp_path / "progress"
    cmd = [sys.executable, *_args(tiny_spleen, out, "--checkpoint-dir", str(ck), "--progress-file", str(prog))]
    with open(tmp_path / "first.log", "w") as log:
        rc = _signal_after(cmd, prog, stop_after, sig, log=log)
    first = _progress(prog)
    assert rc == STOPPED_EXIT, (tmp_path / "first.log").read_text()[-3000:]  # stopped: a supervisor restarts it
    assert not (out / "rank0.json").exists()  # it stopped early, as asked
    saved = sorted(p.name for p in ck.iterdir())
    assert saved == [f"ckpt-{first[-1]:09d}.pt"], saved  # checkpoint at the last completed iteration
    assert first[-1] < 12

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    got = json.loads((out / "rank0.json").read_text())
    assert got["resumed_from"] == first[-1]
    assert _progress(prog) == list(range(1, first[-1] + 1)) + list(range(first[-1] + 1, 13))  # none lost, none repeated
    assert got["weights_sha1"] == expected["weights_sha1"]
    assert got["val_mean_dice"] == expected["val_mean_dice"]


def _relative_distance(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over the floating-point tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    keys = [k for k in b if b[k].is_floating_point()]
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys)
    return (num / sum(float(b[k].double().pow(2).sum()) for k in keys)) ** 0.5


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_spleen) -> Path:
    """The uninterrupted run every single-process resume test compares against (its rank0.json and weights)."""
    folder = tmp_path_factory.mktemp("reference")
    ref = subprocess.run(
        [sys.executable, *_args(tiny_spleen, folder, "--save-weights")], capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    return folder


def _resume_against_reference(tmp_path: Path, data: Path, reference: Path, stop_after: int = 6) -> dict:
    """A run SIGTERMed after ``stop_after`` iterations and resumed, against the uninterrupted ``reference``: their
    weights, and the checkpoint's."""
    out, ck, prog = tmp_path / "run", tmp_path / "ckpt", tmp_path / "progress"
    cmd = [
        sys.executable,
        *_args(data, out, "--checkpoint-dir", str(ck), "--progress-file", str(prog), "--save-weights"),
    ]
    with open(tmp_path / "first.log", "w") as log:
        assert _signal_after(cmd, prog, stop_after, log=log) == STOPPED_EXIT, (tmp_path / "first.log").read_text()
    stopped_after = _progress(prog)[-1]  # the iteration running when the signal came is finished first
    (saved,) = ck.iterdir()
    at_checkpoint = torch.load(saved, map_location="cpu", weights_only=False)["model"]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    return {
        "ref": json.loads((reference / "rank0.json").read_text()),
        "got": json.loads((out / "rank0.json").read_text()),
        "ref_weights": torch.load(reference / "weights_rank0.pt", weights_only=True),
        "got_weights": torch.load(out / "weights_rank0.pt", weights_only=True),
        "at_checkpoint": at_checkpoint,
        "stopped_after": stopped_after,
        "progress": _progress(prog),
    }


def test_saved_weights_of_a_resumed_run_equal_the_reference_and_differ_from_the_checkpoint(
    tmp_path, tiny_spleen, reference
):
    # the mechanics of the CUDA test below, on a CPU, where the run is bit-reproducible
    r = _resume_against_reference(tmp_path, tiny_spleen, reference)
    assert r["got"]["device"] == "cpu" and r["got"]["resumed_from"] == r["stopped_after"] >= 6
    assert _relative_distance(r["got_weights"], r["ref_weights"]) == 0.0
    assert _relative_distance(r["at_checkpoint"], r["ref_weights"]) > 0.0  # 6 more iterations moved the weights


@pytest.mark.gpu
def test_resume_on_cuda_ends_within_tolerance_of_an_uninterrupted_run(tmp_path, tiny_spleen, reference):
    # cuDNN's backward kernels are not bit-exact: the resumed run must land near the reference, far nearer than
    # the checkpoint it resumed from, with every iteration run once
    r = _resume_against_reference(tmp_path, tiny_spleen, reference)
    assert r["got"]["device"].startswith("cuda") and r["ref"]["device"].startswith("cuda")
    assert r["got"]["resumed_from"] == r["stopped_after"] >= 6 and r["progress"] == list(range(1, 13))  # each once
    resumed = _relative_distance(r["got_weights"], r["ref_weights"])
    moved = _relative_distance(r["at_checkpoint"], r["ref_weights"])
    assert resumed < 1e-2 and moved > 10 * resumed, (resumed, moved)
    assert abs(r["got"]["val_mean_dice"] - r["ref"]["val_mean_dice"]) <= 0.05


def _tiny_engine(tmp_path, max_epochs=2):
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(engine, batch):
        opt.zero_grad()
        loss = net(batch).sum()
        loss.backward()
        opt.step()
        return loss.item()

    engine = Engine(step)
    data = [torch.ones(1, 2) * i for i in range(4)]
    pre = Preemption({"trainer": engine, "model": net, "optimizer": opt}, tmp_path / "ck", save_every=2)
    pre.attach(engine)
    return engine, pre, data, net


def test_half_written_and_damaged_checkpoints_are_never_loaded(tmp_path, caplog):
    engine, _, data, _ = _tiny_engine(tmp_path)
    engine.run(data, max_epochs=2)  # periodic checkpoints at iterations 2, 4, 6, 8; the newest 2 are kept
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["ckpt-000000006.pt", "ckpt-000000008.pt"]
    # a writer killed (SIGKILL) in the middle of a checkpoint leaves only its temporary file
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from monai_fast.files import atomic_write\n"
                f"with atomic_write({str(ck / 'ckpt-000000010.pt')!r}, 'wb') as f:\n"
                "    f.write(b'half'); f.flush(); print('writing', flush=True); time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    leftovers = list(ck.glob(".ckpt-000000010.pt.*.tmp"))
    assert len(leftovers) == 1 and not (ck / "ckpt-000000010.pt").exists()
    # a full disk leaves a truncated file
    newest = ck / "ckpt-000000008.pt"
    newest.write_bytes(newest.read_bytes()[:100])

    engine2, pre2, _, _ = _tiny_engine(tmp_path)
    assert pre2.resume() == 6
    assert "ckpt-000000008.pt cannot be read" in caplog.text
    assert not leftovers[0].exists()
    assert engine2.state.iteration == 6


def test_validation_of_options(tmp_path):
    net = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="to_save is empty"):
        Preemption({}, tmp_path)
    with pytest.raises(TypeError, match=r"to_save\['x'\]"):
        Preemption({"x": object()}, tmp_path)
    with pytest.raises(ValueError, match="SIGNOPE"):
        Preemption({"model": net}, tmp_path, signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="save_every"):
        Preemption({"model": net}, tmp_path, save_every=0)
    with pytest.raises(RuntimeError, match="attach"):
        Preemption({"model": net}, tmp_path).resume()


def test_missing_object_in_checkpoint_is_named(tmp_path):
    engine, _, data, _ = _tiny_engine(tmp_path)
    engine.run(data, max_epochs=1)
    net = torch.nn.Linear(2, 1)
    engine2 = Engine(lambda e, b: None)
    pre2 = Preemption({"trainer": engine2, "model": net, "scaler": torch.amp.GradScaler("cpu")}, tmp_path / "ck")
    pre2.attach(engine2)
    with pytest.raises(KeyError, match="no state for \\['scaler'\\]"):
        pre2.resume()


def test_signal_handlers_are_restored_after_the_run(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    engine, pre, data, _ = _tiny_engine(tmp_path)
    seen = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(signal.getsignal(signal.SIGUSR1)))
    engine.run(data, max_epochs=1)
    assert seen[0] == pre.stop_signal._on_signal
    assert signal.getsignal(signal.SIGUSR1) == before


def test_two_torchrun_ranks_stop_together_when_one_is_signalled(tmp_path, tiny_spleen, two_rank_reference):
    import psutil

    expected = json.loads((two_rank_reference / "rank0.json").read_text())  # the same arguments, uninterrupted

    out, ck, prog = tmp_path / "run", tmp_path / "ckpt", tmp_path / "progress"
    cmd = [
        sys.executable,
        "-m",
        "monai_fast.apps.cli",
        "launch",
        "--nproc",
        "2",
        *_args(tiny_spleen, out, "--checkpoint-dir", str(ck), "--progress-file", str(prog)),
    ]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while len(_progress(prog)) < 3:
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            time.sleep(0.01)
        ranks = [
            c for c in psutil.Process(launcher.pid).children(recursive=True) if str(TUTORIAL) in " ".join(c.cmdline())
        ]
        rank1 = next(c for c in ranks if c.environ().get("RANK") == "1")
        os.kill(rank1.pid, signal.SIGUSR1)  # only rank 1 is told; rank 0 must stop at the same iteration
        assert launcher.wait(timeout=120) == STOPPED_EXIT, launcher.stderr.read()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stopped_at = _progress(prog)[-1]
    assert [p.name for p in ck.iterdir()] == [f"ckpt-{stopped_at:09d}.pt"]
    ranks = torch.load(ck / f"ckpt-{stopped_at:09d}.pt", weights_only=False)["preemption"]["ranks"]
    assert len(ranks) == 2 and all(r["rng_epoch_start"] and r["rng_now"] for r in ranks)  # both ranks' states, one file
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["resumed_from"] == r1["resumed_from"] == stopped_at
    assert r0["weights_sha1"] == r1["weights_sha1"] == expected["weights_sha1"]
