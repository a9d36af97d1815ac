"""MONAI's ``amp=True`` on a CPU trains in fp32: the doctor must not read it as reduced precision.

MONAI's trainers autocast for CUDA only, so a bundle's ``amp: true`` run on a CPU (FastTraining off)
computes in fp32; reading it as mixed precision would hide the doctor's precision advice.
"""

from __future__ import annotations

import torch
from monai.engines import SupervisedTrainer
from torch.utils.data import DataLoader

from monai_fast.handlers import RecordHandler
from monai_fast.report.applied import in_effect
from monai_fast.telemetry.record import load_record


def _run(tmp_path, amp: bool):
    net = torch.nn.Conv3d(1, 2, 3, padding=1)
    data = [{"image": torch.rand(1, 8, 8, 8), "label": torch.randint(0, 2, (2, 8, 8, 8)).float()} for _ in range(4)]
    trainer = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=1,
        train_data_loader=DataLoader(data, batch_size=2),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.BCEWithLogitsLoss(),
        amp=amp,
    )
    RecordHandler(tmp_path).attach(trainer)
    trainer.run()
    rows, _ = load_record(tmp_path)
    return rows


def test_monai_amp_on_a_cpu_is_fp32_in_effect(tmp_path):
    rows = _run(tmp_path / "amp", amp=True)
    engines = [r for r in rows if r.get("what") == "engine"]
    assert engines and all(r["amp"] is True and r["device"] == "cpu" for r in engines)
    assert in_effect(rows).precision is None  # fp32: MONAI's autocast did nothing on the CPU


def test_monai_amp_on_cuda_is_read_as_reduced_precision(tmp_path):
    rows = _run(tmp_path / "amp", amp=True)
    on_cuda = [{**r, "device": "cuda:0"} if r.get("what") == "engine" else r for r in rows]  # the CUDA case's rows
    effect = in_effect(on_cuda)
    assert (effect.precision, effect.precision_by) == ("amp", "MONAI amp=True")
