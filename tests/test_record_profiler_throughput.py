import json
import time

import pytest
import torch
from ignite.engine import Engine

from monai_fast.handlers import KernelProfiler, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.telemetry.record import load_record
from monai_fast.telemetry.run_record import RunRecord


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
    assert summary == {"rank": 1, "segments": 1, "x": {"n": 5}}
    assert not list(tmp_path.glob(".*.tmp"))
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
    seen = []
    engine = Engine(lambda e, b: seen.append(torch.autograd._profiler_enabled()))
    prof = KernelProfiler(tmp_path, wait=0, warmup=1, active=50)
    prof.attach(engine)
    engine.run([0, 1, 2], max_epochs=1)  # fewer iterations than the window
    assert seen[-1], "the profiler should have been recording during the run"
    assert not prof.profiling and not torch.autograd._profiler_enabled(), "the profiler must stop with the run"
    with pytest.raises(ValueError, match="active"):
        KernelProfiler(tmp_path, active=0)


def test_kernel_profiler_stops_when_the_run_raises(tmp_path):
    def step(e, b):
        if e.state.iteration == 2:
            raise RuntimeError("bad batch")

    engine = Engine(step)
    prof = KernelProfiler(tmp_path, wait=0, warmup=0, active=50)
    prof.attach(engine)
    with pytest.raises(RuntimeError, match="bad batch"):
        engine.run([0, 1, 2], max_epochs=1)
    assert not prof.profiling and not torch.autograd._profiler_enabled()


def _event(key, device_type, cpu_us, device_us):
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEventAvg

    e = FunctionEventAvg()
    e.key, e.count, e.device_type, e.is_user_annotation = key, 2, getattr(DeviceType, device_type), False
    e.self_cpu_time_total, e.self_device_time_total = cpu_us, device_us
    return e


def test_kernel_summary_counts_gpu_time_once_like_torchs_table():
    from monai_fast.handlers.profiling import summarise_profile

    # an op that launched a kernel reports the kernel's time as its own "self device time" too
    events = [
        _event("aten::conv3d", "CPU", 50.0, 400.0),
        _event("implicit_gemm_kernel", "CUDA", 0.0, 400.0),
        _event("aten::add", "CPU", 10.0, 20.0),
        _event("elementwise_kernel", "CUDA", 0.0, 20.0),
    ]
    s = summarise_profile(events)
    allk = s["All kernels"]
    assert allk["GPU Time (ns)"] == 420_000 and allk["# Kernels"] == 2 and allk["# Ops"] == 2
    assert allk["CPU Time (ns)"] == 60_000
    assert [r["name"] for r in s["top"]] == ["implicit_gemm_kernel", "elementwise_kernel"]


@pytest.mark.gpu
def test_kernel_summary_matches_torchs_device_total_on_cuda(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from monai_fast.handlers.profiling import summarise_profile

    net = torch.nn.Conv3d(1, 8, 3).cuda()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            net(torch.randn(2, 1, 16, 16, 16, device="cuda")).sum().backward()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    torch_total_us = sum(
        e.self_device_time_total
        for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    )
    s = summarise_profile(averages)
    assert s["All kernels"]["GPU Time (ns)"] == pytest.approx(torch_total_us * 1000, rel=1e-6)
    assert s["All kernels"]["# Kernels"] > 0 and s["ranked_by"] == "gpu_time_ns"
