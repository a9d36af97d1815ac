import json
import time

import pytest
import torch
from ignite.engine import Engine

from monai_fast.handlers import KernelProfiler, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.telemetry.record import RunRecord, load_record


def test_record_round_trip_and_atomic_summary(tmp_path):
    rec = RunRecord(tmp_path, rank=1, flush_every=2)
    for i in range(5):
        rec.add("iteration", "x", i=i, value=torch.tensor(0.5))
    assert len((tmp_path / "record.rank1.jsonl").read_text().splitlines()) == 4  # flushed in pairs
    rec.set_summary("x", {"n": 5})
    rec.close()
    rec.close()  # idempotent
    rows, summary = load_record(tmp_path)
    assert [r["i"] for r in rows] == list(range(5)) and rows[0]["value"] == 0.5 and rows[0]["rank"] == 1
    assert summary == {"rank": 1, "x": {"n": 5}}
    assert not list(tmp_path.glob(".tmp_*"))
    with pytest.raises(ValueError, match="kind"):
        rec.add("minute", "x")


def test_load_record_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_record(tmp_path)
    (tmp_path / "record.rank0.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"record\.rank0\.jsonl:2"):
        load_record(tmp_path)


def test_record_handler_closes_on_exception(tmp_path):
    def step(e, b):
        if e.state.iteration == 2:
            raise KeyError("image")

    engine = Engine(step)
    RecordHandler(tmp_path).attach(engine)
    TimeBreakdown().attach(engine)
    with pytest.raises(KeyError):
        engine.run([0, 1, 2], max_epochs=1)
    rows, summary = load_record(tmp_path)
    assert [r["iteration"] for r in rows if r["kind"] == "iteration"] == [1]
    assert (tmp_path / "summary.rank0.json").is_file()


def test_throughput_counts_samples_and_voxels(tmp_path):
    batch = {"image": torch.zeros(4, 1, 8, 8, 4)}
    engine = Engine(lambda e, b: time.sleep(0.01))
    RecordHandler(tmp_path).attach(engine)
    tp = ThroughputMonitor()
    tp.attach(engine)
    engine.run([batch] * 5, max_epochs=2)
    ep = tp.epochs[-1]
    assert ep["samples"] == 20
    assert ep["voxels_per_s"] == pytest.approx(ep["samples_per_s"] * 256, rel=1e-6)
    assert ep["samples_per_s"] == pytest.approx(ep["samples"] / ep["epoch_s"])
    assert ep["samples_per_s"] <= 4 / 0.01  # each iteration sleeps 10 ms: never faster than that
    assert tp.epochs[0]["eta_s"] > 0 and ep["eta_s"] == 0
    rows, summary = load_record(tmp_path)
    assert summary["throughput"]["samples_per_s_mean"] > 0


def test_kernel_profiler_writes_trace_and_dlprof_style_summary(tmp_path):
    net = torch.nn.Conv3d(1, 4, 3)

    def step(e, b):
        net(torch.randn(2, 1, 8, 8, 8)).sum().backward()

    engine = Engine(step)
    prof = KernelProfiler(tmp_path, wait=1, warmup=1, active=2)
    prof.attach(engine)
    engine.run(list(range(6)), max_epochs=1)
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    summary = json.loads((tmp_path / "kernels_rank0.json").read_text())
    allk = summary["All kernels"]
    assert allk["# Ops"] > 0 and allk["CPU Time (ns)"] > 0
    assert any("conv" in r["name"].lower() for r in summary["top"])
    if not torch.cuda.is_available():
        assert allk["GPU Time (ns)"] == 0 and summary["ranked_by"] == "cpu_time_ns"


def test_kernel_profiler_stops_when_run_ends_early(tmp_path):
    engine = Engine(lambda e, b: None)
    KernelProfiler(tmp_path, wait=0, warmup=0, active=50).attach(engine)
    engine.run([0, 1], max_epochs=1)  # fewer iterations than the window: no crash, profiler stopped
    with pytest.raises(ValueError, match="active"):
        KernelProfiler(tmp_path, active=0)
