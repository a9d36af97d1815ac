"""``monai-fast infer`` runs the chain the network was validated with: its Dice on the input's grid is the evaluator's.

A recipe trains a small UNet on spleen-like volumes; MONAI's ``SupervisedEvaluator`` measures its
Dice on the validation cases through the recipe's validation chain (crop to the body and pad
included); ``monai-fast infer`` on the same cases, from the checkpoint alone, must give the same
Dice against the labels on each input's own grid. The recipe resamples to the data's own spacing,
so the evaluator's grid and the input's hold the same voxels and the two Dice agree to rounding.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from monai_fast.apps.cli import main
from monai_fast.apps.inference import CheckpointError, infer, load_model, save_checkpoint
from monai_fast.apps.inference.backends import agreement
from monai_fast.apps.inference.checkpoint import ChainError, build_chain, recipe_chain
from monai_fast.apps.recipes import VAL_METRIC, RecipeConfig, build_recipe
from monai_fast.apps.recipes.transforms import deterministic_transforms
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd

SPACING = (1.6, 1.6, 2.5)  # the synthetic data's, so that the recipe's Spacingd keeps every voxel


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A baseline recipe trained for a few epochs, its evaluator's Dice, its checkpoint and validation cases."""
    tmp = tmp_path_factory.mktemp("chain")
    root = generate_msd(tmp / "data", "spleen-like", num_cases=6, shape=(64, 64, 32), spacing=SPACING, progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.34, seed=0)
    config = RecipeConfig(
        patch_size=(32, 32, 32),
        channels=(8, 16, 32),
        strides=(2, 2),
        pixdim=SPACING,
        max_epochs=4,
        batch_size=2,
        num_samples=2,
        num_workers=0,
        optimizer="adamw",
        lr=3e-3,
        precision="fp32",
        seed=0,
    )
    recipe = build_recipe("baseline", train, val, config, "cpu", progress=False)
    recipe.trainer.run()  # the recipe's ValidationHandler validates; once more on the final weights:
    recipe.evaluator.run()
    model = save_checkpoint(tmp / "model.pt", recipe.network, recipe.config)
    return {
        "dice": float(recipe.evaluator.state.metrics[VAL_METRIC]),
        "model": model,
        "val": val,
        "network": recipe.network,
        "config": recipe.config,
    }


def _dice(outputs: list[Path], val: list[dict]) -> float:
    """Mean foreground Dice of each prediction against its label, both on the input's grid."""
    scores = []
    for out, case in zip(outputs, val):
        pred, label = nib.load(out), nib.load(case["label"])
        assert pred.shape == label.shape and np.allclose(pred.affine, label.affine, atol=1e-4)
        scores.append(agreement(np.asarray(pred.dataobj), np.asarray(label.dataobj))["dice"])
    return float(np.mean(scores))


def test_infer_gives_the_evaluators_dice_on_the_same_cases(trained, tmp_path, capsys):
    out = tmp_path / "predictions"
    images = [case["image"] for case in trained["val"]]
    assert main(["infer", str(trained["model"]), *images, "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    outputs = [out / Path(i).name.replace(".nii.gz", "_seg.nii.gz") for i in images]
    assert trained["dice"] > 0.1  # a network that finds the organ, so that the chain makes a difference
    assert _dice(outputs, trained["val"]) == pytest.approx(trained["dice"], abs=0.005)


def test_the_chain_without_the_crop_gives_another_dice(trained, tmp_path):
    """The test above can fail: the same network through the chain without crop and pad scores differently."""
    uncropped = [t for t in recipe_chain(trained["config"]) if t["_target_"] not in ("CropForegroundd", "SpatialPadd")]
    result = infer(
        trained["network"],
        [c["image"] for c in trained["val"]],
        tmp_path / "out",
        config=trained["config"],
        chain=uncropped,
        progress=False,
    )
    assert abs(_dice(result.outputs, trained["val"]) - trained["dice"]) > 0.01


def test_the_recorded_chain_is_the_recipes_validation_chain(trained):
    case = dict(trained["val"][0])
    config = trained["config"]
    record = load_model(trained["model"]).chain
    assert record == recipe_chain(config)
    assert [t["_target_"] for t in record] == [type(t).__name__ for t in deterministic_transforms(config)]
    from monai.transforms import Compose

    recipes = Compose(deterministic_transforms(config))(dict(case))
    rebuilt = build_chain(record)(dict(case))
    image_only = build_chain(record)({"image": case["image"]})
    assert torch.equal(recipes["image"], rebuilt["image"]) and torch.equal(recipes["label"], rebuilt["label"])
    assert torch.equal(recipes["image"], image_only["image"])


def test_a_checkpoint_without_a_chain_record_warns_once_and_uses_the_recipes_chain(trained, tmp_path, caplog):
    data = torch.load(trained["model"], weights_only=True)
    del data["chain"]
    old = tmp_path / "old.pt"
    torch.save(data, old)
    with caplog.at_level(logging.WARNING, logger="monai_fast.apps.inference"):
        result = infer(old, [trained["val"][0]["image"]], tmp_path / "out", progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(old) in warnings[0] and "no record of the chain" in warnings[0]
    assert "CropForegroundd" in warnings[0] and result.outputs[0].is_file()


@pytest.mark.parametrize(
    "entry, reason",
    [
        ({"_target_": "os.system", "command": "touch /tmp/never"}, "names 'os.system', which is not one of"),
        ({"_target_": "Spacingd", "keys": "image", "pixdim": {"x": 1}}, r"argument\(s\) \['pixdim'\] are not plain"),
        ({"_target_": "Spacingd", "keys": "image", "no_such_argument": 1}, r"\(Spacingd\) cannot be built"),
    ],
)
def test_a_chain_record_that_cannot_be_rebuilt_is_named_before_any_volume_is_read(trained, tmp_path, entry, reason):
    data = torch.load(trained["model"], weights_only=True)
    data["chain"] = [*data["chain"][:2], entry]
    bad = tmp_path / "bad.pt"
    torch.save(data, bad)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bad))}.*{reason}"):
        infer(bad, [str(tmp_path / "never-read.nii.gz")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_checkpoint_refuses_a_chain_it_could_not_rebuild(trained, tmp_path):
    with pytest.raises(ChainError, match="'Lambdad', which is not one of"):
        save_checkpoint(
            tmp_path / "m.pt", trained["network"], trained["config"], chain=[{"_target_": "Lambdad", "keys": "image"}]
        )
    assert not (tmp_path / "m.pt").exists()
