"""Your trainer, as it is and with one added line: ``FastTraining().attach(trainer, evaluator)``.

The trainer is written the way MONAI's spleen tutorial writes it, with nothing from monai-fast:
``Dataset`` + ``DataLoader(num_workers=4)`` over the tutorial's transform chain, a 3D ``UNet``,
``DiceLoss``, ``Adam(1e-4)``, a ``SupervisedEvaluator`` with sliding-window inference and
``MeanDice``, validation every epoch. Both variants run from the same seed for the same number of
epochs, taking turns repeat by repeat (plain, fast, plain, fast, ...), so a slow spell of a
shared machine hits both. The table gives per-epoch training and validation seconds, set-up
seconds (cache filling counts), the whole run from building the trainer to its end, the
validation Dice after the last epoch, the time to a Dice target where reached, and the ratios per
epoch and per whole run; the JSON keeps every epoch. ``--compile`` adds a third variant,
``FastTraining(compile=True)``: the compile lever forced on, beside the default (``"auto"``, which
compiles only a run long enough to repay it).

    python benchmarks/your_trainer.py                       # about 6 minutes on 2 CPU cores
    python benchmarks/your_trainer.py --epochs 6 --repeats 3 --device cuda --channels 16 32 64 128 256
    python benchmarks/your_trainer.py --floor    # also the same compute alone: the most any lever can give here
    python benchmarks/your_trainer.py --compile --epochs 6   # also with torch.compile forced on
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import (
    AsDiscreted,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ScaleIntensityRanged,
    Spacingd,
    SpatialPadd,
)
from monai.utils import set_determinism

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.handlers import FastTraining
from monai_fast.telemetry import cuda_available, device_description
from monai_fast.telemetry.precision import autocast_for, cpu_has_bf16_hardware


def tutorial_chain(patch: tuple[int, int, int], random: bool) -> Compose:
    """MONAI's spleen tutorial chain (validation: without the random part)."""
    keys = ["image", "label"]
    t = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=(1.5, 1.5, 2.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys=["image"], a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image", allow_smaller=True),
    ]
    if random:
        t += [
            SpatialPadd(keys=keys, spatial_size=patch),
            RandCropByPosNegLabeld(
                keys=keys,
                label_key="label",
                spatial_size=patch,
                pos=1,
                neg=1,
                num_samples=4,
                image_key="image",
                image_threshold=0,
            ),
            RandFlipd(keys=keys, spatial_axis=[0], prob=0.10),
            RandRotate90d(keys=keys, prob=0.10, max_k=3),
            RandShiftIntensityd(keys=["image"], offsets=0.10, prob=0.50),
        ]
    return Compose(t)


def build(files, args, device: str) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    """The user's trainer and evaluator, as the tutorial builds them."""
    set_determinism(args.seed)
    train_files, val_files = files
    patch = tuple(args.patch)
    train_loader = DataLoader(
        Dataset(train_files, tutorial_chain(patch, True)), batch_size=2, shuffle=True, num_workers=args.workers
    )
    val_loader = DataLoader(Dataset(val_files, tutorial_chain(patch, False)), batch_size=1, num_workers=args.workers)
    net = UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=2,
        channels=tuple(args.channels),
        strides=(2,) * (len(args.channels) - 1),
        num_res_units=2,
        norm="batch",
    ).to(device)
    post = Compose([AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)])
    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=val_loader,
        network=net,
        inferer=SlidingWindowInferer(patch, sw_batch_size=4),
        postprocessing=post,
        key_val_metric={
            "val_mean_dice": MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))
        },
    )
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=args.epochs,
        train_data_loader=train_loader,
        network=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-4),
        loss_function=DiceLoss(to_onehot_y=True, softmax=True),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    return trainer, evaluator


#: the variants a repeat runs, in turn: the user's trainer, FastTraining's defaults, FastTraining compiling
VARIANTS = {"plain": None, "fast": {}, "compiled": {"compile": True}}


def run_once(files, args, device: str, variant: str) -> dict:
    """One run; per epoch: training seconds (iterations only), validation seconds, Dice."""
    t0 = time.perf_counter()
    trainer, evaluator = build(files, args, device)
    options = VARIANTS[variant]
    ft = FastTraining(progress=False, **options) if options is not None else None
    if ft is not None:
        ft.attach(trainer, evaluator)
    setup_s = time.perf_counter() - t0
    epochs: list[dict] = []
    marks: dict = {}
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: marks.update(start=time.perf_counter()))
    evaluator.add_event_handler(Events.STARTED, lambda e: marks.update(val=time.perf_counter()))

    def epoch_done(_):
        now = time.perf_counter()
        epochs.append(
            {
                "epoch": trainer.state.epoch,
                "train_s": marks["val"] - marks["start"],
                "val_s": now - marks["val"],
                "dice": float(evaluator.state.metrics["val_mean_dice"]),
                "elapsed_s": now - t0,
            }
        )

    evaluator.add_event_handler(Events.COMPLETED, epoch_done)
    trainer.run()
    applied = {str(k): v["setting"] if v["applied"] else None for k, v in ft.applied.items()} if ft is not None else {}
    return {"variant": variant, "setup_s": setup_s, "epochs": epochs, "applied": applied}


def floor_once(files, args, device: str, applied: dict, epochs: int = 2) -> dict:
    """The same epoch's compute alone: the training steps on a fixed batch and the validation's sliding windows.

    The network, loss and optimizer are built as in :func:`build`, in the precision and layout
    FastTraining chose in the same repeat; no data is loaded, no handler runs; every batch is taken
    as full. An accelerated epoch should not take much less than this (it is itself a measurement,
    so a ratio just under 1 can occur), so plain epoch / floor epoch is about the most any data,
    loader or handler lever can give on the machine it runs on.
    """
    trainer, evaluator = build(files, args, device)
    net, optimizer, loss_fn, inferer = trainer.network, trainer.optimizer, trainer.loss_function, evaluator.inferer
    precision = applied.get("precision") or "fp32"
    last = applied.get("memory_format") == "channels_last_3d"
    fmt = torch.channels_last_3d if last else torch.contiguous_format
    net.to(memory_format=fmt)
    crops = trainer.data_loader.batch_size * 4  # RandCropByPosNegLabeld(num_samples=4)
    x = torch.rand(crops, 1, *args.patch, device=device).contiguous(memory_format=fmt)
    y = (torch.rand(crops, 1, *args.patch, device=device) > 0.7).float()
    chain = tutorial_chain(tuple(args.patch), random=False)
    volumes = [chain(f)["image"].as_tensor()[None].to(device) for f in files[1]]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step() -> float:
        t = time.perf_counter()
        net.train()
        optimizer.zero_grad(set_to_none=True)
        with autocast_for(precision, device):
            out = net(x)
        loss_fn(out.float(), y).backward()
        optimizer.step()
        sync()
        return time.perf_counter() - t

    def validate() -> float:
        t = time.perf_counter()
        net.eval()
        with torch.no_grad(), autocast_for(precision, device):
            for v in volumes:
                inferer(v, net)
        sync()
        return time.perf_counter() - t

    step(), step(), validate()  # warm-up
    per_epoch = [(sum(step() for _ in range(len(trainer.data_loader))), validate()) for _ in range(epochs)]
    train_s, val_s = statistics.median(t for t, _ in per_epoch), statistics.median(v for _, v in per_epoch)
    return {
        "variant": "floor",
        "precision": precision,
        "memory_format": "channels_last_3d" if last else "contiguous",
        "train_s": train_s,
        "val_s": val_s,
        "epoch_s": train_s + val_s,
    }


def summarise(run: dict, target: float) -> dict:
    ep = run["epochs"]
    later = ep[1:] if len(ep) > 1 else ep  # the first epoch carries warm-up
    reached = next((e for e in ep if e["dice"] >= target), None)
    return {
        "train_s": statistics.median(e["train_s"] for e in later),
        "val_s": statistics.median(e["val_s"] for e in later),
        "epoch_s": statistics.median(e["train_s"] + e["val_s"] for e in later),
        "setup_s": run["setup_s"],
        "run_s": ep[-1]["elapsed_s"],  # from building the trainer to the last validation's end
        "final_dice": ep[-1]["dice"],
        "time_to_target_s": reached["elapsed_s"] if reached else None,
        "epochs_to_target": reached["epoch"] if reached else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--epochs", type=int, default=4, help="epochs per run (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved (default 2)")
    p.add_argument("--cases", type=int, default=16, help="synthetic spleen-like cases (default 16)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument(
        "--patch", type=int, nargs=3, default=(64, 64, 64), help="training crop / sliding window (default 64^3)"
    )
    p.add_argument(
        "--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels (default 8 16 32 64)"
    )
    p.add_argument(
        "--workers", type=int, default=4, help="DataLoader worker processes of the plain trainer (default 4)"
    )
    p.add_argument("--target", type=float, default=0.9, help="Dice target for the time-to-target column (default 0.9)")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time the same epoch's compute alone (training steps on a "
        "fixed batch, the validation's sliding windows) in FastTraining's precision and layout: the most any "
        "lever that keeps the user's computation can give",
    )
    p.add_argument(
        "--compile", action="store_true", help="also run FastTraining(compile=True) (torch.compile forced on)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu' or 'cuda'")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    root = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    files = load_msd_datalist(root, val_fraction=0.25, seed=0)
    variants = ["plain", "fast", *(["compiled"] if args.compile else [])]
    runs = []
    for r in range(args.repeats):
        for variant in variants:
            print(f"-- repeat {r + 1}: {variant}", flush=True)
            runs.append({"repeat": r + 1, **run_once(files, args, device, variant)})
        if args.floor:
            print(f"-- repeat {r + 1}: the same compute alone (floor)", flush=True)
            fast_applied = next(x["applied"] for x in runs if x["repeat"] == r + 1 and x["variant"] == "fast")
            runs.append({"repeat": r + 1, **floor_once(files, args, device, fast_applied)})
    rows = []
    for r in range(1, args.repeats + 1):
        got = {
            v: summarise(next(x for x in runs if x["repeat"] == r and x["variant"] == v), args.target) for v in variants
        }
        plain = got["plain"]
        row = {"repeat": r, **got}
        for v in variants[1:]:
            row[v + "_ratio"] = {
                "epoch": plain["epoch_s"] / got[v]["epoch_s"],
                "train": plain["train_s"] / got[v]["train_s"],
                "val": plain["val_s"] / got[v]["val_s"],
                "run": plain["run_s"] / got[v]["run_s"],
                "dice_gap": got[v]["final_dice"] - plain["final_dice"],
            }
        row.update(
            epoch_ratio=row["fast_ratio"]["epoch"],
            train_ratio=row["fast_ratio"]["train"],
            val_ratio=row["fast_ratio"]["val"],
            run_ratio=row["fast_ratio"]["run"],
            dice_gap=row["fast_ratio"]["dice_gap"],
        )
        rows.append(row)
        floor = next((x for x in runs if x["repeat"] == r and x["variant"] == "floor"), None)
        if floor is not None:  # the most any lever that keeps the user's computation could give, and how near fast is
            rows[-1].update(
                floor=floor,
                floor_ratio=plain["epoch_s"] / floor["epoch_s"],
                fast_over_floor=got["fast"]["epoch_s"] / floor["epoch_s"],
            )
    print(
        f"\n{'repeat':<7}{'variant':<10}{'setup s':>9}{'train s/ep':>12}{'val s/ep':>10}{'epoch s':>9}{'run s':>8}"
        f"{'Dice@' + str(args.epochs):>9}"
        f"{'to ' + str(args.target):>10}"
    )
    for row in rows:
        for name in variants:
            s = row[name]
            tt = f"{s['time_to_target_s']:.0f} s" if s["time_to_target_s"] else "-"
            print(
                f"{row['repeat']:<7}{name:<10}{s['setup_s']:>9.1f}{s['train_s']:>12.2f}{s['val_s']:>10.2f}"
                f"{s['epoch_s']:>9.2f}{s['run_s']:>8.1f}{s['final_dice']:>9.3f}{tt:>10}"
            )
        for name in variants[1:]:
            q = row[name + "_ratio"]
            print(
                f"{'':<7}{'x ' + name:<10}{'':>9}{q['train']:>11.2f}x{q['val']:>9.2f}x{q['epoch']:>8.2f}x"
                f"{q['run']:>7.2f}x{q['dice_gap']:>+9.3f}"
            )
        if "floor" in row:
            f = row["floor"]
            print(
                f"{'':<7}{'floor':<10}{'':>9}{f['train_s']:>12.2f}{f['val_s']:>10.2f}{f['epoch_s']:>9.2f}   "
                f"plain/floor {row['floor_ratio']:.2f}x, fast/floor {row['fast_over_floor']:.2f}x ({f['precision']}, "
                f"{f['memory_format']})"
            )
    bf16 = cpu_has_bf16_hardware() if device == "cpu" else None
    applied = next(x["applied"] for x in runs if x["variant"] == "fast")
    print(f"\nFastTraining applied: {applied}")
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")  # set to emulate an older CPU on this one
    print(
        f"device: {device_description(device)}"
        + ("" if bf16 is None else f"; CPU bf16 hardware: {'yes' if bf16 else 'no'}")
        + (f"; oneDNN limited to {limit}" if limit else "")
    )
    doc = {
        "benchmark": "your_trainer",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "device": device_description(device),
            "cpu_bf16_hardware": bf16,
            "onednn_max_cpu_isa": limit,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "options": vars(args),
        "rows": rows,
        "runs": runs,
        "applied": applied,
        "median_epoch_ratio": statistics.median(r["epoch_ratio"] for r in rows),
        "median_run_ratio": statistics.median(r["run_ratio"] for r in rows),
        **(
            {
                "median_compiled_epoch_ratio": statistics.median(r["compiled_ratio"]["epoch"] for r in rows),
                "median_compiled_run_ratio": statistics.median(r["compiled_ratio"]["run"] for r in rows),
            }
            if args.compile
            else {}
        ),
    }
    out = write_json(doc, Path(args.out) / f"your_trainer_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(
        f"median ratio per epoch {doc['median_epoch_ratio']:.2f}x, per whole run {doc['median_run_ratio']:.2f}x"
        + (
            f"; compiled {doc['median_compiled_epoch_ratio']:.2f}x per epoch, {doc['median_compiled_run_ratio']:.2f}x "
            "per whole run"
            if args.compile
            else ""
        )
        + f"; results: {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
