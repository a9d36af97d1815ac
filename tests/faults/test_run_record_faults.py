"""The run record and the doctor read exactly the run, whole, and advise only what applies.

Real parts only: MONAI SupervisedTrainer/Evaluator on tiny tensors, real processes writing rank records,
SIGKILL mid-run, a second process into the same folder.
"""

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
from ignite.engine import Events
from monai.data import CacheDataset, DataLoader, Dataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import ValidationHandler
from monai.inferers import SimpleInferer
from monai.networks.nets import UNet
from monai.transforms import Lambdad, RandLambdad

from monai_fast.handlers import AMPToggle, RecordHandler, TimeBreakdown
from monai_fast.handlers.record import record_of
from monai_fast.report.doctor import doctor, prescribe
from monai_fast.telemetry.record import Kind, Source, load_record, select

#: thresholds under which no run is data-bound and a CPU run is compute-bound, whatever the host's load: the verdict
#: whose fixes the advice tests read
COMPUTE_BOUND = {"data_threshold": 1.01, "data_low": 1.01}

#: one rank of a run: a real ignite engine timed into the record of ``rank`` in ``folder``
RANK_SCRIPT = textwrap.dedent("""
    import sys, time
    from ignite.engine import Engine, Events
    from monai_fast.handlers import RecordHandler, TimeBreakdown
    folder, rank, epochs, sleep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    record = RecordHandler(folder, rank=rank)
    print("ready", flush=True)
    engine = Engine(lambda e, b: time.sleep(sleep))
    record.attach(engine)
    TimeBreakdown().attach(engine)
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: print(f"epoch {e.state.epoch}", flush=True))
    engine.run(list(range(5)), max_epochs=epochs)
    print("done", flush=True)
""")


def _rank(tmp_path: Path, folder: Path, rank: int, epochs: int, sleep: float) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen(
        [sys.executable, str(script), str(folder), str(rank), str(epochs), str(sleep)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_epoch(proc: subprocess.Popen, epoch: int) -> None:
    """Read the rank's output until it says ``epoch <epoch>`` (completed), from the process itself, not its record."""
    for line in proc.stdout:
        if line.strip() == f"epoch {epoch}":
            return
    raise AssertionError(f"the rank process ended before epoch {epoch}: {proc.communicate()}")


def _items(n: int, shape: tuple[int, ...] = (1, 8, 8, 8)) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"image": torch.rand(*shape, generator=g), "label": (torch.rand(*shape, generator=g) > 0.5).float()}
        for _ in range(n)
    ]


def _segmentation_run(folder: Path, epochs: int = 2, amp: str | None = None) -> tuple[SupervisedTrainer, RecordHandler]:
    net = torch.nn.Conv3d(1, 1, 3, padding=1)
    loader = DataLoader(Dataset(_items(4)), batch_size=2)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=epochs,
        train_data_loader=loader,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
    )
    record = RecordHandler(folder)
    record.attach(trainer)
    TimeBreakdown().attach(trainer)
    if amp is not None:
        AMPToggle(amp).attach(trainer)
    return trainer, record


# ------------------------------------------------------------------ read exactly the run's files


def test_a_stray_copy_of_a_record_is_not_read_and_is_named(tmp_path):
    trainer, _ = _segmentation_run(tmp_path)
    trainer.run()
    before = doctor(tmp_path).numbers
    shutil.copy(tmp_path / "record.rank0.jsonl", tmp_path / "record.rank0 (copy).jsonl")
    after = doctor(tmp_path)
    assert after.numbers["data_s"] == pytest.approx(before["data_s"])
    assert after.numbers["compute_s"] == pytest.approx(before["compute_s"]) and after.numbers["epochs"] == 2
    assert after.numbers["strays"] == ["record.rank0 (copy).jsonl"]
    assert any("record.rank0 (copy).jsonl" in e and "not read" in e for e in after.evidence)


# ------------------------------------------------------------------ one run per folder


def test_a_second_run_into_the_same_folder_fails_at_once_and_a_killed_owner_leaves_no_lock(tmp_path):
    folder = tmp_path / "run"
    first = _rank(tmp_path, folder, 0, epochs=400, sleep=0.01)
    try:
        assert first.stdout.readline().strip() == "ready"
        second = _rank(tmp_path, folder, 0, epochs=1, sleep=0.0)
        out, err = second.communicate(timeout=60)
        assert second.returncode != 0, out
        assert "RunFolderBusyError" in err and str(folder) in err and f"pid {first.pid}" in err, err
        assert "ready" not in out  # it failed when the record was made, before any work
        rows, _ = load_record(folder)
        assert {r.get("pid") for r in rows if r.get("what") == "segment_started"} == {first.pid}  # no mixed record
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    record = RecordHandler(folder)  # the kernel dropped the killed owner's lock: the folder is free again
    assert record.segment == 1  # and the killed run's rows are kept, the new run after them
    record.record.close()


# ------------------------------------------------------------------ a killed rank keeps what it measured


def test_a_sigkilled_rank_keeps_its_rows_and_the_doctor_names_it(tmp_path):
    folder = tmp_path / "run"
    rank0 = _rank(tmp_path, folder, 0, epochs=4, sleep=0.01)
    rank1 = _rank(tmp_path, folder, 1, epochs=400, sleep=0.01)
    try:
        _wait_for_epoch(rank1, 2)
        rank1.send_signal(signal.SIGKILL)
        rank1.wait(timeout=30)
        out, err = rank0.communicate(timeout=90)
        assert rank0.returncode == 0, err
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    rows, _ = load_record(folder)
    killed = select(rows, Kind.ITERATION, Source.TIME_BREAKDOWN, rank=1)
    assert len(killed) >= 10  # every iteration it timed before the kill, not a buffer lost with the process
    assert [r["epoch"] for r in select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, rank=1)][:2] == [1, 2]
    assert len(select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, rank=0)) == 4
    d = doctor(folder)
    assert d.numbers["stopped_early"] == [1]
    named = [e for e in d.evidence if e.startswith("rank 1 stopped early")]
    assert named and "without an end row" in named[0], d.evidence
    assert not any(e.startswith("rank 0 stopped early") for e in d.evidence)


# ------------------------------------------------------------------ append, never truncate


def test_a_new_record_handler_on_the_folder_appends_a_segment(tmp_path):
    trainer, _ = _segmentation_run(tmp_path, epochs=2)
    trainer.run()
    record = RecordHandler(tmp_path)  # a notebook cell run again: a new handler on the same run folder
    record.attach(trainer)
    TimeBreakdown().attach(trainer)
    trainer.state.max_epochs = 4  # two more epochs
    trainer.run()
    rows, summary = load_record(tmp_path)
    epochs = select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")
    assert [(r["segment"], r["epoch"]) for r in epochs] == [(0, 1), (0, 2), (1, 3), (1, 4)]
    assert summary["segments"] == 2
    assert [ep.epoch for ep in trainer.state.time_breakdown] == [3, 4]  # this run's epochs, each once
    d = doctor(tmp_path)
    assert d.numbers["epochs"] == 4 and d.numbers["wall_clock"]["runs"] == 2
    assert any(e.startswith("the record holds 2 segments") for e in d.evidence), d.evidence


def test_a_restarted_job_continues_the_record_and_the_wall_clock_spans_both_processes(tmp_path):
    folder = tmp_path / "run"
    first = _rank(tmp_path, folder, 0, epochs=400, sleep=0.02)
    try:
        _wait_for_epoch(first, 3)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    second = _rank(tmp_path, folder, 0, epochs=3, sleep=0.02)  # the restart
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    rows, _ = load_record(folder)
    first_rows = [r for r in rows if r["segment"] == 0]
    busy = sum(r["data_s"] + r["compute_s"] for r in select(rows, Kind.ITERATION, Source.TIME_BREAKDOWN))
    d = doctor(folder)
    assert d.numbers["epochs"] >= 6 and d.numbers["restarts"] == 1
    segs = d.numbers["segments"]
    assert [s["ended"] for s in segs] == [False, True] and segs[0]["pid"] == first.pid
    assert d.numbers["wall_clock"]["total_s"] >= busy  # both processes' work, not the last one's alone
    assert d.numbers["wall_clock"]["total_s"] > max(r["time"] for r in first_rows) - min(r["time"] for r in first_rows)
    assert any("a restart" in e for e in d.evidence), d.evidence


# ------------------------------------------------------------------ advice that applies


def test_no_mixed_precision_advice_for_a_run_that_trained_in_bf16(tmp_path):
    trainer, _ = _segmentation_run(tmp_path, amp="bf16")
    trainer.run()
    d = doctor(tmp_path, **COMPUTE_BOUND)  # whatever the host's load: its fixes name precision
    assert d.verdict == "compute-bound"
    assert not any("mixed precision" in f for f in d.fixes), d.fixes
    assert any(f.startswith("already on in this run: precision (bf16") for f in d.fixes), d.fixes
    assert d.numbers["in_effect"]["precision"] == "bf16"


class _PatchClassifier(torch.nn.Module):
    """A 2-D patch classifier (pathology-style): conv, pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def _patch_classifier_run(folder: Path) -> SupervisedTrainer:
    g = torch.Generator().manual_seed(0)
    items = [{"image": torch.rand(3, 16, 16, generator=g), "label": torch.tensor(i % 2)} for i in range(8)]
    net = _PatchClassifier()
    slow = Lambdad(keys="image", func=lambda x: (time.sleep(0.1), x)[1])  # validation: a large share of the clock
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(items[:4], slow), batch_size=2),
        network=net,
        inferer=SimpleInferer(),
    )
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=2,
        train_data_loader=DataLoader(Dataset(items), batch_size=4),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.CrossEntropyLoss(),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    record = RecordHandler(folder)
    record.attach(trainer)
    record.attach(evaluator)
    TimeBreakdown().attach(trainer)
    return trainer


def test_no_3d_or_sliding_window_advice_for_a_2d_patch_classifier(tmp_path):
    _patch_classifier_run(tmp_path).run()
    d = doctor(tmp_path, **COMPUTE_BOUND)  # the verdict whose fixes name channels_last_3d and windows
    assert d.verdict == "compute-bound"
    assert d.numbers["wall_clock"]["shares"]["validation"] >= 0.3  # the validation advice is in play
    everything = d.text() + (tmp_path / "report.md").read_text()
    for word in ("channels_last_3d", "sliding-window", "sw_batch_size", "SlidingWindowInferer", "stitching"):
        assert word not in everything, (word, everything)
    assert any("validate less often" in f for f in d.fixes), d.fixes  # what does apply is still said
    run = d.numbers["in_effect"]
    assert run["spatial_dims"] == 2 and run["sliding_window"] is False
    prescription = prescribe(load_record(tmp_path)[0], d)  # monai-fast doctor --apply
    assert "sw_batch_size" not in prescription and "sliding-window" not in prescription, prescription


def test_a_3d_unet_with_a_sliding_window_still_gets_that_advice(tmp_path):
    from monai.inferers import SlidingWindowInferer

    net = UNet(3, 1, 2, channels=(4, 8), strides=(2,))
    items = _items(4, (1, 16, 16, 16))
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(_items(64, (1, 16, 16, 16))), batch_size=1),  # most of the wall clock
        network=net,
        inferer=SlidingWindowInferer((8, 8, 8), sw_batch_size=2),
    )
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=DataLoader(Dataset(items), batch_size=2),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    record = RecordHandler(tmp_path)
    record.attach(trainer)
    record.attach(evaluator)
    TimeBreakdown().attach(trainer)
    trainer.run()
    d = doctor(tmp_path, **COMPUTE_BOUND)  # the verdict whose fixes name the memory format
    assert d.verdict == "compute-bound" and d.numbers["wall_clock"]["shares"]["validation"] >= 0.3  # advice's evidence
    assert any("channels_last_3d" in f for f in d.fixes) and any("sw_batch_size" in f for f in d.fixes), d.fixes
    assert d.numbers["in_effect"]["spatial_dims"] == 3 and d.numbers["in_effect"]["sliding_window"] is True
    assert "sliding-window inference" in d.numbers["inference"]["text"]


def test_time_breakdown_does_not_advise_caching_data_that_is_cached(tmp_path, caplog):
    slow_random = RandLambdad(keys="image", func=lambda x: (time.sleep(0.03), x)[1], prob=1.0)  # runs after the cache
    data = CacheDataset(_items(4), transform=slow_random, progress=False)
    net = torch.nn.Conv3d(1, 1, 1)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=DataLoader(data, batch_size=1),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
    )
    TimeBreakdown(warn_threshold=0.2).attach(trainer)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        trainer.run()
    warned = [r.getMessage() for r in caplog.records if "waiting for data" in r.getMessage()]
    assert warned, "the epoch was not data-bound: the test checks nothing"
    assert "cache deterministic transforms" not in warned[0]
    assert "are cached (the loader reads a CacheDataset)" in warned[0]


def test_time_breakdown_reads_the_cache_lever_from_the_run_record(tmp_path, caplog):
    slow = Lambdad(keys="image", func=lambda x: (time.sleep(0.03), x)[1])
    trainer, _ = _segmentation_run(tmp_path, epochs=1)
    trainer.data_loader = DataLoader(Dataset(_items(4), slow), batch_size=1)

    @trainer.on(Events.STARTED)
    def _fast_training_row(engine):  # the row FastTraining writes when its data lever cached the data set
        record_of(engine).add(
            Kind.EVENT,
            Source.FAST_TRAINING,
            lever="data",
            applied=True,
            setting="ram",
            reason="cache in RAM (CacheDataset)",
        )

    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        trainer.run()
    warned = [r.getMessage() for r in caplog.records if "waiting for data" in r.getMessage()]
    assert warned and "FastTraining cached them (ram)" in warned[0] and "cache deterministic" not in warned[0], warned


# ------------------------------------------------------------------ whole sentences


def test_every_line_of_the_report_ends_its_sentence(tmp_path):
    _patch_classifier_run(tmp_path).run()
    d = doctor(tmp_path)
    text = d.text().splitlines()
    prose = [line.strip()[2:] for line in text if line.strip().startswith("- ")]
    assert d.numbers.get("inference"), "no inference section: the test checks less than it should"
    prose += [text[text.index("inference:") + 1].strip()]
    report = (tmp_path / "report.md").read_text().splitlines()
    prose += [line[2:] for line in report if line.startswith("- ")]
    prose += [report[report.index("## Inference") + 2]]
    assert prose and all(p.rstrip().endswith((".", "!", "?")) for p in prose), [p for p in prose if not p.endswith(".")]
    assert json.loads((tmp_path / "doctor.json").read_text())["numbers"]["inference"]["text"].endswith(".")


def test_a_row_cut_short_by_a_kill_is_left_out_and_the_next_segment_starts_on_its_own_line(tmp_path, caplog):
    trainer, _ = _segmentation_run(tmp_path, epochs=1)
    trainer.run()
    path = tmp_path / "record.rank0.jsonl"
    whole = path.read_text()
    with path.open("a") as f:
        f.write('{"kind": "iteration", "source": "time_b')  # what a writer killed mid-row leaves
    with caplog.at_level(logging.WARNING, logger="monai_fast.telemetry"):
        rows, _ = load_record(tmp_path)
    assert len(rows) == len(whole.splitlines()) and any("cut short" in r.getMessage() for r in caplog.records)
    trainer, _ = _segmentation_run(tmp_path, epochs=1)  # the restart continues the record
    trainer.run()
    rows, _ = load_record(tmp_path)
    assert [r["epoch"] for r in select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN)] == [1, 1]
    assert sorted({r["segment"] for r in rows}) == [0, 1]


def test_only_a_stray_copy_in_the_folder_is_no_record(tmp_path):
    (tmp_path / "record.rank0 (copy).jsonl").write_text('{"kind": "epoch"}\n')
    with pytest.raises(FileNotFoundError, match=r"record\.rank<R>\.jsonl"):
        load_record(tmp_path)


#: a rank of a real 3-process gloo group; rank 1 fails before its first row
GROUP_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from ignite.engine import Engine
    from monai_fast.handlers import RecordHandler, TimeBreakdown
    folder, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    record = RecordHandler(folder)  # every rank makes its record (together: the ranks' placement is gathered)
    if rank == 1:
        os._exit(1)  # killed or failed before its first row
    engine = Engine(lambda e, b: time.sleep(0.01))
    record.attach(engine)
    TimeBreakdown().attach(engine)
    engine.run(list(range(5)), max_epochs=2)
    dist.destroy_process_group()
""")


def test_a_rank_that_left_no_record_is_named_by_the_world_size_the_others_recorded(tmp_path):
    from monai_fast.apps.launch import free_port

    script, folder, port = tmp_path / "group_rank.py", tmp_path / "run", str(free_port())
    script.write_text(GROUP_RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(folder), str(r), port], env=env, stderr=subprocess.PIPE)
        for r in range(3)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 1, 0], [p.stderr.read()[-2000:] for p in procs]
    d = doctor(folder)
    assert d.numbers["missing_ranks"] == [1], d.evidence
    assert any(e.startswith("rank 1 of 3 left an empty record") for e in d.evidence), d.evidence
    (folder / "record.rank1.jsonl").unlink()  # its file gone: the others' world size still names it
    d = doctor(folder)
    assert d.numbers["missing_ranks"] == [1], d.evidence
    assert any(e.startswith("rank 1 of 3 left no record") for e in d.evidence), d.evidence
    alone = tmp_path / "rank0-only"  # a job that records rank 0 alone (monai-fast train) names nobody
    _rank(tmp_path, alone, 0, epochs=1, sleep=0.0).communicate(timeout=120)
    assert "missing_ranks" not in doctor(alone).numbers
