"""Tutorial: BraTS-like multi-GPU training with a per-rank cache in GPU memory, as in MONAI's guide.

MONAI's fast-training guide trains BraTS on 8 GPUs with each rank caching *its share* of the
volumes in *its GPU's* memory (``CacheDataset`` ending in ``ToDeviced``), so random crops and
augmentation run on the GPU and no rank holds the whole set. This script is that set-up written
out by hand (no monai-fast recipe), with monai-fast doing the distributed parts:
``monai_fast.apps.launch.run`` (launcher, backend, device, seeds), ``rank_share`` (each rank's
files) and ``distribute`` (DDP, or Horovod's optimizer). Three sigmoid outputs: tumour core (TC),
whole tumour (WT), enhancing tumour (ET) from MSD Task01's labels 1 (edema), 2 (non-enhancing),
3 (enhancing).

    monai-fast launch --nproc 8 tutorials/brats_distributed.py --data-dir /data/Task01_BrainTumour
    monai-fast launch --nproc 2 tutorials/brats_distributed.py --tiny     # CPU smoke test, seconds
    srun -n 16 python tutorials/brats_distributed.py --data-dir ...      # 2 nodes x 8 GPUs

On a CPU the cache simply stays in RAM (``ToDeviced`` is left out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from ignite import distributed as idist
from monai.data import CacheDataset, ThreadDataLoader
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, StatsHandler, ValidationHandler, from_engine
from monai.inferers import SimpleInferer, SlidingWindowInferer
from monai.losses import DiceLoss
from monai.networks.nets import SegResNet
from monai.optimizers import Novograd
from monai.transforms import (
    Activationsd,
    AsDiscreted,
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    MapTransform,
    NormalizeIntensityd,
    Orientationd,
    RandFlipd,
    RandScaleIntensityd,
    RandShiftIntensityd,
    RandSpatialCropd,
    Spacingd,
    SpatialPadd,
    ToDeviced,
)

from monai_fast.apps.launch import run
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.distributed.model import distribute, rank_share
from monai_fast.handlers import TimeBreakdown
from monai_fast.handlers.preemption import catch_stop_signals, end_of_setup


class MSDBratsToChannels(MapTransform):
    """MSD Task01 labels (1 edema, 2 non-enhancing, 3 enhancing) -> channels TC, WT, ET."""

    def __call__(self, data):
        d = dict(data)
        for key in self.keys:
            lab = d[key][0] if d[key].shape[0] == 1 else d[key]
            d[key] = torch.stack([(lab == 2) | (lab == 3), lab > 0, lab == 3]).float()
        return d


def train(local_rank: int, args: argparse.Namespace) -> None:
    catch_stop_signals()  # first: a SIGTERM/SIGUSR1 during set-up is reported, not a silent death
    rank, device = idist.get_rank(), idist.device()
    data_dir = Path(args.data_dir) if args.data_dir else Path(args.out) / "data"
    if not args.data_dir:
        if rank == 0 and not (data_dir / "dataset.json").exists():
            shape = (40, 40, 32) if args.tiny else (128, 128, 96)
            generate_msd(data_dir, kind="brats-like", num_cases=6 if args.tiny else 24, shape=shape, progress=False)
        idist.barrier()
    train_files, val_files = load_msd_datalist(data_dir, val_fraction=0.34 if args.tiny else 0.2)
    train_files, val_files = rank_share(train_files), rank_share(val_files, even=False)  # this rank's share
    roi = (32, 32, 32) if args.tiny else (128, 128, 96)
    keys = ("image", "label")
    cached = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
        Spacingd(keys=keys, pixdim=(1.0, 1.0, 1.0), mode=("bilinear", "nearest")),
        EnsureTyped(keys=keys, track_meta=False),  # plain tensors: cheaper to cache, copy and augment
        MSDBratsToChannels(keys="label"),
        NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True),
        SpatialPadd(keys=keys, spatial_size=roi),
    ]
    if device.type == "cuda":
        cached.append(ToDeviced(keys=keys, device=device))  # the rank's cache lives on its GPU
    augment = [
        RandSpatialCropd(keys=keys, roi_size=roi, random_size=False),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=1),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=2),
        RandScaleIntensityd(keys="image", factors=0.1, prob=1.0),
        RandShiftIntensityd(keys="image", offsets=0.1, prob=1.0),
    ]
    workers = 1 if args.tiny else max(1, (os.cpu_count() or 2) // max(1, idist.get_nproc_per_node()))
    train_ds = CacheDataset(train_files, Compose(cached + augment), cache_rate=1.0, num_workers=workers, progress=False)
    val_ds = CacheDataset(val_files, Compose(cached), cache_rate=1.0, num_workers=workers, progress=False)
    train_loader = ThreadDataLoader(train_ds, num_workers=0, batch_size=1, shuffle=True)
    val_loader = ThreadDataLoader(val_ds, num_workers=0, batch_size=1)

    channels = 8 if args.tiny else 16
    network = SegResNet(
        blocks_down=(1, 2, 2, 4),
        blocks_up=(1, 1, 1),
        init_filters=channels,
        in_channels=4,
        out_channels=3,
        dropout_prob=0.2,
    ).to(device)
    optimizer = Novograd(network.parameters(), lr=1e-4 * 10)
    network, optimizer = distribute(network, optimizer)  # DDP (or Horovod) for this job
    amp = device.type == "cuda"
    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=val_loader,
        network=getattr(network, "module", network),
        inferer=SlidingWindowInferer(roi_size=roi, sw_batch_size=4, overlap=0.5),
        postprocessing=Compose([Activationsd(keys="pred", sigmoid=True), AsDiscreted(keys="pred", threshold=0.5)]),
        key_val_metric={
            "val_mean_dice": MeanDice(include_background=True, output_transform=from_engine(["pred", "label"]))
        },
        amp=amp,
    )
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=args.max_epochs,
        train_data_loader=train_loader,
        network=network,
        optimizer=optimizer,
        loss_function=DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, to_onehot_y=False, sigmoid=True),
        inferer=SimpleInferer(),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
        amp=amp,
        optim_set_to_none=True,
    )
    TimeBreakdown().attach(trainer)
    if rank == 0:
        StatsHandler(name="val", output_transform=lambda out: None, iteration_log=False).attach(evaluator)
    end_of_setup()  # a signal during set-up stops here with a message
    trainer.run()
    result = {
        "rank": rank,
        "world_size": idist.get_world_size(),
        "cached_items": len(train_ds) + len(val_ds),
        "cache_device": str(train_ds[0]["image"].device) if len(train_ds) else None,
        "val_mean_dice": evaluator.state.metrics.get("val_mean_dice"),
        "param_sum": float(sum(p.detach().double().sum() for p in getattr(network, "module", network).parameters())),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"brats_rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data-dir", help="MSD Task01_BrainTumour-layout folder; default: a synthetic brats-like set in --out"
    )
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "monai-fast-brats"))
    p.add_argument("--max-epochs", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="tiny volumes and network: a smoke test")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    run(train, args)


if __name__ == "__main__":
    main()
