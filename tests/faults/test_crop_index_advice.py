"""Precomputed crop indices (``FgBgToIndicesd``) are advised only to a chain that crops by label without them.

A data-bound run whose chain has no ``RandCropByPosNegLabeld`` (a 2-D classifier, a patch data set), or
one that precomputes the indices already, must not be told to precompute them: neither by
``TimeBreakdown``'s warning nor by the doctor.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from monai.data import CacheDataset, DataLoader
from monai.engines import SupervisedTrainer
from monai.transforms import Compose, FgBgToIndicesd, RandCropByPosNegLabeld, RandLambdad

from monai_fast.handlers import RecordHandler, TimeBreakdown
from monai_fast.report.doctor import diagnose
from monai_fast.telemetry.record import load_record

SLOW = RandLambdad(keys="image", func=lambda x: (time.sleep(0.03), x)[1], prob=1.0)  # after the cache: data-bound
CROP = RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=(8, 8, 8), num_samples=1)
CHAINS = {
    "no label crop": ([SLOW], False),
    "a label crop": ([CROP, SLOW], True),
    "a label crop on precomputed indices": (
        [
            FgBgToIndicesd(keys="label"),
            RandCropByPosNegLabeld(
                ["image", "label"],
                "label",
                (8, 8, 8),
                1,
                1,
                1,
                fg_indices_key="label_fg_indices",
                bg_indices_key="label_bg_indices",
            ),
            SLOW,
        ],  # noqa: E501
        False,
    ),
}


def _items(n: int) -> list[dict]:
    label = torch.zeros(1, 12, 12, 12)
    label[:, 3:9, 3:9, 3:9] = 1
    return [{"image": torch.rand(1, 12, 12, 12), "label": label.clone()} for _ in range(n)]


@pytest.mark.parametrize("case", sorted(CHAINS))
def test_crop_indices_are_advised_only_where_the_chain_crops_by_label(case, tmp_path, caplog):
    chain, advised = CHAINS[case]
    net = torch.nn.Conv3d(1, 1, 1)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=DataLoader(CacheDataset(_items(4), Compose(chain), progress=False), batch_size=1),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
    )
    RecordHandler(tmp_path).attach(trainer)
    TimeBreakdown(warn_threshold=0.2).attach(trainer)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        trainer.run()
    warned = [r.getMessage() for r in caplog.records if "waiting for data" in r.getMessage()]
    assert warned, "the epoch was not data-bound: the test checks nothing"
    assert ("FgBgToIndicesd" in warned[0]) is advised, warned[0]
    rows, _ = load_record(tmp_path)
    diagnosis = diagnose(rows, data_threshold=0.05)
    assert diagnosis.verdict == "data-bound", diagnosis.evidence
    assert any("FgBgToIndicesd" in fix for fix in diagnosis.fixes) is advised, diagnosis.fixes


def test_reading_the_chain_leaves_its_random_state_alone():
    # MONAI's Compose.flatten() builds a new Compose, which re-seeds the chain's random transforms: a resumed
    # run would then crop otherwise than the run it continues
    import numpy as np

    from monai_fast.telemetry.chain import transform_names

    crop = RandCropByPosNegLabeld(keys=["image", "label"], label_key="label", spatial_size=(8, 8, 8), num_samples=1)
    chain = Compose([Compose([SLOW]), crop])
    chain.set_random_state(seed=3)
    before = crop.R.get_state()[1].copy()
    assert transform_names(chain) == ["RandLambdad", "RandCropByPosNegLabeld"]
    assert np.array_equal(crop.R.get_state()[1], before)
