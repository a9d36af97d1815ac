"""The precision module: names, dtypes, and the CPU decision (hardware first, then interleaved timing)."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import platform

import pytest
import torch
from ignite import distributed as idist

from monai_fast.telemetry import precision as prec


def _no_timing(rounds: int = 3) -> float:
    raise AssertionError("bf16 was timed on a CPU without bf16 hardware")


def test_without_bf16_hardware_auto_is_fp32_with_one_info_line_and_no_timing(monkeypatch, caplog):
    monkeypatch.setattr(prec, "cpu_has_bf16_hardware", lambda flags=None: False)
    monkeypatch.setattr(prec, "cpu_bf16_speedup", _no_timing)
    with caplog.at_level(logging.INFO, logger="monai_fast.telemetry"):
        assert prec.choose_precision("auto", "cpu") == "fp32"
    lines = [r for r in caplog.records if r.name == "monai_fast.telemetry"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "no bf16 matrix hardware" in lines[0].getMessage()


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_onednn_limited_below_bf16_counts_as_no_bf16_hardware(monkeypatch, caplog, variable):
    # the flags may say avx512_bf16: with oneDNN held to AVX2 torch cannot use the units, as on an AVX2-only CPU
    monkeypatch.setattr(prec, "_cpu_flags", lambda: {"avx2": True, "avx512_bf16": True, "amx_bf16": True})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert prec.cpu_has_bf16_hardware() is True
    for isa in ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "ALL"):  # limits at or above the bf16 kernels
        monkeypatch.setenv(variable, isa)
        assert prec.cpu_has_bf16_hardware() is True, isa
    monkeypatch.setenv(variable, "avx2")
    assert prec.onednn_isa_limit() == "AVX2" and prec.cpu_has_bf16_hardware() is False
    assert prec.cpu_has_bf16_hardware({"avx512_bf16": True}) is True  # flags given: judged as given
    monkeypatch.setattr(prec, "cpu_bf16_speedup", _no_timing)
    with caplog.at_level(logging.INFO, logger="monai_fast.telemetry"):
        assert prec.choose_precision("auto", "cpu") == "fp32"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "monai_fast.telemetry"]
    assert "limited to AVX2 (ONEDNN_MAX_CPU_ISA)" in line, line


@pytest.mark.parametrize("gain, expected, level", [(2.0, "bf16", logging.INFO), (1.0, "fp32", logging.WARNING)])
def test_with_bf16_hardware_the_measurement_decides(monkeypatch, caplog, gain, expected, level):
    calls = []
    monkeypatch.setattr(prec, "cpu_has_bf16_hardware", lambda flags=None: True)
    monkeypatch.setattr(prec, "cpu_bf16_speedup", lambda rounds=3: calls.append(rounds) or gain)
    with caplog.at_level(logging.INFO, logger="monai_fast.telemetry"):
        assert prec.choose_precision("auto", "cpu") == expected
    assert len(calls) == 1
    lines = [r for r in caplog.records if r.name == "monai_fast.telemetry"]
    assert len(lines) == 1 and lines[0].levelno == level


def test_the_real_measurement_interleaves_fp32_and_bf16(monkeypatch):
    seen = []
    real = prec.autocast_for
    monkeypatch.setattr(prec, "autocast_for", lambda p, d: seen.append(p) or real(p, d))
    monkeypatch.setattr(prec, "cpu_has_bf16_hardware", lambda flags=None: True)
    gain = prec.cpu_bf16_speedup(rounds=3)
    assert gain > 0
    assert seen == ["fp32", "bf16"] * 4  # one warm-up each, then three interleaved rounds


def test_hardware_flags_are_read_from_the_cpu():
    assert prec.cpu_has_bf16_hardware({"avx512_f": True, "avx2": True}) is False
    assert prec.cpu_has_bf16_hardware({"amx_bf16": True}) is True
    assert prec.cpu_has_bf16_hardware({"avx512_bf16": True, "amx_bf16": False}) is True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is None:
        pytest.skip("no x86 /proc/cpuinfo flags to compare with")
    assert prec.cpu_has_bf16_hardware() == bool({"amx_bf16", "avx512_bf16"} & set(flags))


def test_several_ranks_take_rank_0s_choice(monkeypatch):
    sent = []
    monkeypatch.setattr(idist, "get_world_size", lambda: 2)
    monkeypatch.setattr(idist, "get_rank", lambda: 1)
    monkeypatch.setattr(idist, "broadcast", lambda value, src=0, safe_mode=False: sent.append((value, src)) or "bf16")
    monkeypatch.setattr(prec, "cpu_has_bf16_hardware", lambda flags=None: False)  # rank 1 alone would pick fp32
    monkeypatch.setattr(prec, "cpu_bf16_speedup", _no_timing)
    assert prec.choose_precision("auto", "cpu") == "bf16"
    assert sent == [(None, 0)]  # rank 1 decided nothing itself
    monkeypatch.setattr(idist, "get_rank", lambda: 0)
    monkeypatch.setattr(idist, "broadcast", lambda value, src=0, safe_mode=False: sent.append((value, src)) or value)
    assert prec.choose_precision("auto", "cpu") == "fp32"
    assert sent[-1] == ("fp32", 0)  # rank 0 sent its own decision


def test_names_dtypes_and_autocast():
    assert prec.autocast_dtype("bf16") == torch.bfloat16 and prec.autocast_dtype("fp16") == torch.float16
    assert prec.autocast_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="'bf16', 'fp16', 'fp32'"):
        prec.check_precision("auto")
    assert prec.check_precision("auto", allow_auto=True) == "auto"
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        prec.choose_precision("fp16", "cpu")
    conv = torch.nn.Conv3d(1, 2, 3)
    x = torch.rand(1, 1, 8, 8, 8)
    with prec.autocast_for("bf16", torch.device("cpu")):
        assert conv(x).dtype == torch.bfloat16
    with prec.autocast_for("fp32", torch.device("cpu")):
        assert conv(x).dtype == torch.float32


def test_the_measurement_counts_cpu_work_so_other_processes_cannot_flip_it(monkeypatch):
    # two busy processes on every core would slow fp32 and bf16 rounds by any amount; the thread's
    # CPU time, on one torch thread, only sees the work each precision does
    ctx = mp.get_context("spawn")
    spinners = [ctx.Process(target=_spin, daemon=True) for _ in range(2 * (torch.get_num_threads() or 1))]
    for p in spinners:
        p.start()
    threads = torch.get_num_threads()
    try:
        reads = []
        real = prec.time.thread_time
        monkeypatch.setattr(prec.time, "thread_time", lambda: reads.append(1) or real())
        gains = [prec.cpu_bf16_speedup(rounds=3) for _ in range(2)]
    finally:
        for p in spinners:
            p.terminate()
            p.join(timeout=30)
    assert reads, "the measurement must read the thread's CPU time"
    assert torch.get_num_threads() == threads  # put back
    if prec.cpu_has_bf16_hardware():
        assert all(g > prec.MIN_CPU_GAIN for g in gains), gains  # bf16 hardware measured faster, loaded or not


def _spin() -> None:
    while True:
        pass


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN's AVX2 limit is x86's")
def test_bf16_that_the_cpu_emulates_is_measured_once_not_for_every_round():
    # oneDNN limited to AVX2 (as on a CPU without bf16 units): bf16 is emulated, tens of times slower than fp32
    import subprocess
    import sys

    script = (
        "import json; from monai_fast.telemetry import precision as prec;"
        "reads = []; real = prec.time.thread_time;"
        "prec.time.thread_time = lambda: reads.append(1) or real();"
        "gain = prec.cpu_bf16_speedup(rounds=5); print(json.dumps([gain, len(reads)]))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    gain, reads = json.loads(out.stdout.splitlines()[-1])
    assert gain < 1 / prec.CLEAR_CPU_LOSS, gain
    assert reads == 2 * (2 + 2), reads  # two readings per pass: the warm-up's two passes and one round's two
