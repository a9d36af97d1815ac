"""Tutorial: add monai-fast handlers to a MONAI training script you already have.

The script below is an ordinary MONAI spleen training set-up written by hand (no monai-fast
recipe). Two lines of monai-fast are added to it (marked ``# monai-fast``): ``TimeBreakdown``
reports each epoch's data-wait share and warns when the loader starves the model, and
``TimeToTarget`` stops training at a target Dice or after a time budget and says when it got there.

Run it on synthetic data (written on first use) or on your own MSD folder::

    python tutorials/attach_to_your_trainer.py                      # synthetic spleen-like set
    python tutorials/attach_to_your_trainer.py --data-dir /data/Task09_Spleen --device cuda
    python tutorials/attach_to_your_trainer.py --tiny               # a few seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch
from monai.data import CacheDataset, ThreadDataLoader
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, StatsHandler, ValidationHandler, from_engine
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.optimizers import Novograd
from monai.transforms import (
    AsDiscreted,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.handlers import TimeBreakdown, TimeToTarget
from monai_fast.handlers.preemption import catch_stop_signals, end_of_setup


def main() -> None:
    catch_stop_signals()  # first: a SIGTERM/SIGUSR1 during set-up is reported, not a silent death
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="MSD folder with dataset.json; default: write a synthetic spleen-like set")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target", type=float, default=0.9, help="validation mean Dice to stop at")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds before giving up")
    p.add_argument("--max-epochs", type=int, default=100)
    p.add_argument("--tiny", action="store_true", help="tiny data and 2 epochs: a smoke test")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)

    t0 = time.perf_counter()  # monai-fast: start the clock before caching, so caching counts
    if args.data_dir:
        root = args.data_dir
    else:
        shape = (48, 48, 32) if args.tiny else (128, 128, 64)
        root = generate_msd(tempfile.mkdtemp(prefix="spleen_like_"), num_cases=5 if args.tiny else 16, shape=shape)
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25)
    patch = (32, 32, 32) if args.tiny else (64, 64, 64)
    max_epochs = 2 if args.tiny else args.max_epochs
    device = torch.device(args.device)

    keys = ["image", "label"]
    deterministic = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
        Spacingd(keys=keys, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image", allow_smaller=True),
        SpatialPadd(keys=keys, spatial_size=patch),
    ]
    crop = RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=patch, num_samples=4, image_key="image")
    train_ds = CacheDataset(train_files, Compose([*deterministic, crop]), cache_rate=1.0, progress=False)
    val_ds = CacheDataset(val_files, Compose(deterministic), cache_rate=1.0, progress=False)
    net = UNet(3, 1, 2, channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=1).to(device)

    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=ThreadDataLoader(val_ds, batch_size=1),
        network=net,
        inferer=SlidingWindowInferer(roi_size=patch, sw_batch_size=4),
        postprocessing=Compose(
            [AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)]
        ),
        key_val_metric={
            "val_mean_dice": MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))
        },
    )
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=max_epochs,
        train_data_loader=ThreadDataLoader(train_ds, batch_size=2, shuffle=True),
        network=net,
        optimizer=Novograd(net.parameters(), lr=2e-3),
        loss_function=DiceCELoss(to_onehot_y=True, softmax=True),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1), StatsHandler(iteration_log=False)],
    )

    TimeBreakdown(warn_threshold=0.2).attach(trainer)  # monai-fast
    stopper = TimeToTarget(args.target, "val_mean_dice", time_budget_s=args.time_budget, start_time=t0)  # monai-fast
    stopper.attach(trainer, evaluator)

    end_of_setup()  # a signal during set-up stops here with a message (a Preemption attached above would take it over)
    trainer.run()

    for ep in trainer.state.time_breakdown:
        print(
            f"epoch {ep.epoch}: {ep.iterations} iterations, "
            f"data wait {100 * ep.data_share:.1f}% of {ep.data_s + ep.compute_s:.2f} s"
        )
    if stopper.reached_s is not None:
        print(f"reached Dice {args.target} after {stopper.reached_s:.1f} s (epoch {stopper.reached_epoch})")
    else:
        print(f"best Dice {stopper.best or 0:.3f}; target {args.target} not reached in {stopper.elapsed():.0f} s")


if __name__ == "__main__":
    main()
