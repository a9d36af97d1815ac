"""The run record on a file system that fills during training, and one ``monai-fast train`` per output folder.

Real parts: small tmpfs file systems mounted for the test (root only; skipped with the reason
otherwise) that another writer fills in the middle of a run, MONAI ``SupervisedTrainer`` runs with
the ``RecordHandler``, the doctor reading what was recorded, and the ``monai-fast train`` command run
as real processes on tiny data.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from ignite.engine import Events
from monai.engines import SupervisedTrainer

from monai_fast.apps.inference.checkpoint import load_checkpoint
from monai_fast.files import free_bytes
from monai_fast.handlers import RecordHandler, TimeBreakdown
from monai_fast.report.doctor import doctor
from monai_fast.telemetry.record import Kind, Source, load_record, select

REPO = Path(__file__).resolve().parents[2]
TINY = ["--patch-size", "32", "32", "32", "--num-samples", "2", "--val-fraction", "0.34", "--no-progress"]


def _fill(folder: Path) -> None:
    """Take every free byte of ``folder``'s file system (another writer took the space)."""
    take = free_bytes(folder)
    if take > 0:
        with open(folder / "filler.bin", "wb") as f:
            f.write(b"\0" * take)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SM_")}


def _train(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "monai_fast",
        "train",
        "--data-dir",
        str(data),
        "--output-dir",
        str(out),
        "--max-epochs",
        "1",
        "--device",
        "cpu",
        *TINY,
        *extra,
    ]


# ------------------------------------------------------------------ the record's writer
def test_a_record_on_a_full_disk_warns_once_keeps_its_rows_and_training_finishes(tmpfs, tmp_path, caplog):
    folder = tmpfs("size=64k") / "run"
    net = torch.nn.Linear(8, 8)
    data = [{"image": torch.randn(2, 8), "label": torch.randn(2, 8)} for _ in range(40)]
    trainer = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=3,
        train_data_loader=data,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_function=torch.nn.MSELoss(),
    )
    record = RecordHandler(folder)
    record.attach(trainer)
    TimeBreakdown().attach(trainer)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=50), lambda e: _fill(folder.parent))
    with caplog.at_level(logging.WARNING, logger="monai_fast"):
        trainer.run()  # no OSError: the record's full disk does not stop training
    assert trainer.state.iteration == 120 and trainer.state.epoch == 3
    torch.save(net.state_dict(), tmp_path / "model.pth")  # the run goes on to save its model elsewhere

    path = folder / "record.rank0.jsonl"
    said = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(said) == 1, said  # one warning, not one per row
    assert "no space left" in said[0] and "missing" in said[0] and "records no more rows" in said[0], said[0]
    full = record.record.disk_full
    assert full is not None and full.path == path

    assert path.read_bytes().endswith(b"\n")  # no half row: the file ends with its last whole row
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="monai_fast"):
        rows, _ = load_record(folder)
    assert not [r for r in caplog.records if "cut short" in r.getMessage()]
    steps = [r["iteration"] for r in select(rows, Kind.ITERATION, Source.TIME_BREAKDOWN)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and 50 <= last < 120  # every row before the fill reads back
    assert f"ends at the trainer's iteration {last}" in said[0]
    assert not [r for r in rows if r.get("what") == "segment_ended"]
    d = doctor(folder)  # the doctor says where the record ends
    assert any(e.startswith("rank 0 stopped early") and f"iteration {last}" in e for e in d.evidence), d.evidence


def test_a_full_disk_while_recording_in_monai_fast_train_still_saves_the_model(tmpfs, tmp_path, tiny_spleen):
    small = tmpfs("size=2M")
    out, model_dir = small / "out", tmp_path / "model"
    record = out / "fast" / "record.rank0.jsonl"
    proc = subprocess.Popen(
        _train(tiny_spleen, out, "--model-dir", str(model_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=_env(),
    )

    def fill_once_recording() -> None:  # another writer takes the space once the record holds rows
        while proc.poll() is None:
            if record.is_file() and record.stat().st_size > 0:
                _fill(small)
                return
            time.sleep(0.02)

    filler = threading.Thread(target=fill_once_recording, daemon=True)
    filler.start()
    stdout, stderr = proc.communicate(timeout=300)
    filler.join(timeout=10)
    assert (small / "filler.bin").is_file()  # the disk filled during the run
    assert "Traceback" not in stderr, stderr[-3000:]
    assert proc.returncode == 1, stderr[-3000:]  # the model saved, other outputs named as not written
    network, _ = load_checkpoint(model_dir / "model.pth")  # the model is written whole
    assert f"model: {model_dir / 'model.pth'}" in stdout, stdout
    assert f"run record {record}: no space left" in stderr, stderr[-3000:]
    assert "not written: " in stderr and "a file: no space" not in stderr
    assert record.read_bytes().endswith(b"\n") or record.stat().st_size == 0


# ------------------------------------------------------------------ one run per output folder
def test_a_second_train_into_one_output_folder_with_another_recipe_stops_at_once(tmp_path, tiny_spleen):
    out = tmp_path / "out"
    first = subprocess.Popen(
        _train(tiny_spleen, out, "--recipe", "fast"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=_env(),
    )
    try:
        lock = out / ".monai-fast.lock"
        deadline = time.monotonic() + 120
        while f"pid {first.pid}" not in (lock.read_text() if lock.is_file() else ""):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # the first run holds the folder, however quick its training
        t0 = time.monotonic()
        try:
            second = subprocess.run(
                _train(tiny_spleen, out, "--recipe", "baseline"),
                capture_output=True,
                text=True,
                cwd=REPO,
                env=_env(),
                timeout=120,
            )
        finally:
            first.send_signal(signal.SIGCONT)
        took = time.monotonic() - t0
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-2000:]
    said = [line for line in second.stderr.splitlines() if " INFO " not in line]  # the log's progress left out
    assert len(said) == 1 and said[0].startswith("monai-fast train: "), second.stderr  # one line
    assert str(out) in said[0] and "in use by another run" in said[0] and f"pid {first.pid}" in said[0], said[0]
    assert "preflight" not in second.stderr and took < 60  # stopped before reading any data
    assert not (out / "baseline").exists()  # nothing of the second run in the folder
    assert first.returncode == 0, stderr[-3000:]  # the first run finishes, its outputs its own
    assert (out / "model" / "model.pth").is_file() and (out / "results.json").is_file()
    assert (out / "fast" / "record.rank0.jsonl").is_file()
