import csv
import logging
import threading
import time

import pytest
from ignite.engine import Engine

from monai_fast.handlers import GPUSampler, RecordHandler
from monai_fast.telemetry.nvml import FakeNvml, NvmlUnavailable, open_nvml


def _slow_engine(step_s=0.02):
    return Engine(lambda e, b: time.sleep(step_s))


def _sampler_threads():
    return [t for t in threading.enumerate() if t.name == "monai-fast-gpu-sampler"]


def test_samples_off_the_training_thread_and_writes_everything(tmp_path):
    fake = FakeNvml(count=2, util=[90.0, 95.0, 100.0])
    engine = _slow_engine()
    RecordHandler(tmp_path).attach(engine)
    sampler = GPUSampler(interval_s=0.02, gpus=[1], backend=fake)
    sampler.attach(engine)
    engine.run(list(range(10)), max_epochs=1)
    assert _sampler_threads() == []
    assert fake.samples >= 3 and threading.get_ident() not in fake.threads
    s = sampler.summary["gpu1"]
    assert s["name"] == "Fake GPU 1" and 90.0 <= s["gpu_util_mean"] <= 100.0 and s["gpu_util_peak"] <= 100.0
    with open(tmp_path / "gpu_rank0.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sampler.n_samples >= 3 and set(rows[0]) >= {"time", "gpu_util", "used", "total", "ratio"}
    assert all(r["gpu"] == "1" for r in rows)
    assert not list(tmp_path.glob("*.png")), "plots are the doctor's job (report/), not the sampler's"
    from monai_fast.telemetry.record import load_record

    rec_rows, summary = load_record(tmp_path)
    assert sum(1 for r in rec_rows if r["source"] == "gpu") == sampler.n_samples
    assert summary["gpu"]["gpu1"]["samples"] == sampler.n_samples


def test_thread_stops_when_the_run_raises():
    fake = FakeNvml()

    def step(e, b):
        time.sleep(0.02)
        if e.state.iteration == 3:
            raise ValueError("bad batch 3")

    engine = Engine(step)
    GPUSampler(interval_s=0.01, backend=fake).attach(engine)
    with pytest.raises(ValueError, match="bad batch 3"):
        engine.run(list(range(10)), max_epochs=1)
    assert _sampler_threads() == []
    assert fake.samples > 0


def test_without_nvml_one_warning_and_inert(caplog):
    try:
        open_nvml().shutdown()
        pytest.skip("NVML is available here; this checks the CPU-machine fallback")
    except NvmlUnavailable:
        pass
    engine = _slow_engine(0)
    sampler = GPUSampler(interval_s=0.01)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        sampler.attach(engine)
        engine.run(list(range(5)), max_epochs=2)
    assert caplog.text.count("GPU sampling is off") == 1
    assert not sampler.active and sampler.n_samples == 0 and _sampler_threads() == []
    assert engine.state.epoch == 2


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="interval_s"):
        GPUSampler(interval_s=0)
    with pytest.raises(ValueError, match="gpus"):
        GPUSampler(gpus=[])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="file"):
        GPUSampler(output_dir=blocker / "sub")
    s = GPUSampler(gpus=[3], backend=FakeNvml(count=2))
    with pytest.raises(ValueError, match=r"gpus \[3\] do not exist"):
        s.attach(_slow_engine(0))


@pytest.mark.gpu
def test_real_nvml_readings_on_a_gpu():
    import torch

    engine = Engine(
        lambda e, b: torch.randn(2048, 2048, device="cuda").matmul(torch.randn(2048, 2048, device="cuda")).sum().item()
    )
    sampler = GPUSampler(interval_s=0.05)
    sampler.attach(engine)
    engine.run(list(range(200)), max_epochs=1)
    (s,) = sampler.summary.values()
    assert s["samples"] > 0 and s["mem_total_mib"] > 1000 and s["gpu_util_peak"] > 0


class _Writer:
    def __init__(self):
        self.steps = {}

    def add_scalar(self, tag, value, step, walltime=None):
        self.steps.setdefault(tag, []).append(step)


def test_tensorboard_steps_keep_rising_one_per_sampling_round():
    writer = _Writer()
    engine = _slow_engine(0.01)
    sampler = GPUSampler(interval_s=0.002, backend=FakeNvml(count=2), gpus=[0, 1], writer=writer)
    sampler.attach(engine)
    engine.run(list(range(30)), max_epochs=1)
    assert sampler.n_samples > 16
    for tag, steps in writer.steps.items():
        assert steps == sorted(set(steps)) and len(steps) > 8, tag


def test_a_rerun_cell_replaces_the_sampler_and_stops_its_thread():
    fake = FakeNvml(count=1)
    engine = _slow_engine(0.01)
    old = GPUSampler(interval_s=0.005, backend=fake)
    old.attach(engine)
    new = GPUSampler(interval_s=0.005, backend=fake)
    new.attach(engine)  # the same cell run again
    engine.run(list(range(10)), max_epochs=1)
    assert old.n_samples == 0 and new.n_samples > 0
    assert _sampler_threads() == []


@pytest.mark.parametrize(
    ("visible", "local_rank", "cuda_uuid", "expected"),
    [
        (None, 1, None, [1]),  # one GPU per local rank
        ("3,2", 1, None, [2]),  # indices
        ("GPU-00000000-0000-0000-0000-000000000003,GPU-00000000-0000-0000-0000-000000000000", 0, None, [3]),  # UUIDs
        ("GPU-00000000-0000-0000-0000-000000000002", 0, None, [2]),
        ("0,1", 0, "GPU-00000000-0000-0000-0000-000000000001", [1]),  # the CUDA device's UUID wins
    ],
)
def test_the_sampled_gpu_is_the_one_this_rank_uses(monkeypatch, visible, local_rank, cuda_uuid, expected):
    from monai_fast.telemetry.nvml import visible_gpu_indices

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpu_indices(local_rank, FakeNvml(count=4), cuda_uuid) == expected


def test_gpu_sampler_follows_a_uuid_in_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-0000-0000-0000-000000000002")
    sampler = GPUSampler(interval_s=0.01, backend=FakeNvml(count=3))
    sampler.attach(_slow_engine(0))
    assert sampler.gpus == [2]


@pytest.mark.gpu
def test_cuda_device_uuid_is_known_to_nvml():
    from monai_fast.telemetry.cuda import cuda_device_uuid
    from monai_fast.telemetry.nvml import visible_gpu_indices

    backend = open_nvml()
    uuid = cuda_device_uuid("cuda:0")
    assert uuid and uuid.startswith("GPU-")
    (index,) = visible_gpu_indices(0, backend, uuid)
    assert backend.uuid(index) == uuid


@pytest.mark.gpu
def test_the_sampler_reads_the_gpu_this_process_computes_on():
    import torch

    from monai_fast.telemetry.cuda import cuda_device_uuid

    backend = open_nvml()
    uuid = cuda_device_uuid("cuda:0")
    (ours,) = [i for i in range(backend.device_count()) if backend.uuid(i) == uuid]  # NVML's index of CUDA's device 0
    held = torch.empty(1024 * 2**20, dtype=torch.uint8, device="cuda:0")  # 1 GiB this process holds on it
    engine = Engine(lambda e, b: (held.add_(1), torch.cuda.synchronize(), time.sleep(0.01)))
    sampler = GPUSampler(interval_s=0.02)
    sampler.attach(engine)
    engine.run(list(range(60)), max_epochs=1)
    assert sampler.gpus == [ours]
    (summary,) = sampler.summary.values()
    assert summary["samples"] > 0 and summary["mem_used_peak_mib"] >= 1024  # our gigabyte shows on the sampled GPU
