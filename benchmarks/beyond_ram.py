"""A data set beyond the RAM budget in a user's own trainer: the crop-reading disk tier against all-in-RAM.

The trainer is `your_trainer.py`'s (MONAI's spleen tutorial: ``Dataset`` + ``DataLoader``, the
tutorial's chain with ``RandCropByPosNegLabeld``, a 3D ``UNet``, validation every epoch). Three
variants take turns, repeat by repeat, from the same seed:

* ``ram``: ``FastTraining`` with RAM to spare: the deterministic prefix cached in RAM;
* ``disk``: the same with ``ram_budget_mib`` set to a third of the cached size: the planner picks the
  crop-reading disk tier (``CropCacheDataset`` in a fresh folder, so its fill is in the run);
* ``persistent``: the user's loader over MONAI's ``PersistentDataset`` in a fresh folder, what a MONAI
  user reaches for when the data do not fit, with ``FastTraining(cache=False)``.

Every other lever is the same in all three (precision from the device; memory layout, compile,
prefetch and the evaluator's levers off), so the ratios are the data path's. The table gives the
training seconds per epoch (epochs after the first), the share of the items each epoch trained on
(every item, every epoch, unless the user asked for a window), the whole run, and each variant's
per-epoch speed as a fraction of ``ram``'s measured in the same repeat.

    python benchmarks/beyond_ram.py                  # about 10 minutes on 2 CPU cores
    python benchmarks/beyond_ram.py --cases 24 --epochs 4 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from ignite.engine import Events
from monai.data import DataLoader, PersistentDataset
from your_trainer import build, tutorial_chain

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.handlers import FastTraining
from monai_fast.telemetry import device_description

VARIANTS = ("ram", "disk", "persistent")
#: the levers held the same in every variant, so that only the data path differs
SAME = {"memory_format": False, "compile": False, "prefetch": False, "evaluator": False, "progress": False}


def cached_mib(files: list[dict], patch: tuple[int, int, int]) -> float:
    """MiB of the deterministic prefix's output over ``files`` (what a RAM cache holds), from the first item."""
    item = tutorial_chain(patch, random=False)(files[0])
    per_item = sum(v.element_size() * v.numel() for v in item.values() if isinstance(v, torch.Tensor))
    return per_item * len(files) / 2**20


def run_once(files, args, variant: str, budget_mib: float, folder: Path) -> dict:
    """One run of ``variant``: per epoch the training seconds and the share of the items trained on."""
    t0 = time.perf_counter()
    trainer, evaluator = build(files, args, "cpu")
    if variant == "ram":
        fast = FastTraining(**SAME)
    elif variant == "disk":
        fast = FastTraining(ram_budget_mib=budget_mib, cache_dir=folder, **SAME)
    else:
        user = trainer.data_loader  # the same loader over a PersistentDataset, as the user would write it
        data = PersistentDataset(user.dataset.data, user.dataset.transform, cache_dir=folder)
        trainer.data_loader = DataLoader(data, batch_size=user.batch_size, shuffle=True, num_workers=args.workers)
        fast = FastTraining(cache=False, **SAME)
    fast.attach(trainer, evaluator)
    data = fast.applied["data"]
    setup_s = time.perf_counter() - t0
    epochs: list[dict] = []
    seen: set[str] = set()
    marks: dict = {}
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: (seen.clear(), marks.update(start=time.perf_counter())))
    evaluator.add_event_handler(Events.STARTED, lambda e: marks.update(val=time.perf_counter()))

    def note_items(engine) -> None:
        batch = engine.state.batch  # MONAI's trainer decollates it into a list of items
        for item in batch if isinstance(batch, list) else [batch]:
            names = getattr(item["image"], "meta", {}).get("filename_or_obj")  # PersistentDataset drops meta
            if names is not None:
                seen.update(names if isinstance(names, list) else [names])

    def epoch_done(engine) -> None:
        epochs.append(
            {
                "epoch": engine.state.epoch,
                "train_s": marks["val"] - marks["start"],  # the iterations, up to the validation
                "items_share": len(seen) / len(files[0]) if seen else None,
                "elapsed_s": time.perf_counter() - t0,
            }
        )

    trainer.add_event_handler(Events.ITERATION_COMPLETED, note_items)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, epoch_done)  # after the user's validation handler
    trainer.run()
    return {
        "variant": variant,
        "setup_s": setup_s,
        "run_s": time.perf_counter() - t0,
        "data": {"setting": data["setting"], "reason": data["reason"]},
        "epochs": epochs,
        "dice": float(evaluator.state.metrics["val_mean_dice"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=24, help="synthetic spleen-like cases (default 24)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument("--patch", type=int, nargs=3, default=(64, 64, 64), help="training crop (default 64^3)")
    p.add_argument("--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved (default 2)")
    p.add_argument("--fraction", type=float, default=1 / 3, help="RAM budget as a share of the cached size")
    p.add_argument("--workers", type=int, default=0, help="the user's DataLoader workers (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    root = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    files = load_msd_datalist(root, val_fraction=0.2, seed=0)
    total = cached_mib(files[0], tuple(args.patch))
    budget = total * args.fraction
    print(f"cached size {total:.0f} MiB; the disk variant's RAM budget {budget:.0f} MiB", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="beyond-ram-") as tmp:
        for r in range(args.repeats):
            for v in VARIANTS:
                print(f"-- repeat {r + 1}: {v}", flush=True)
                runs.append({"repeat": r + 1, **run_once(files, args, v, budget, Path(tmp) / f"{v}-{r}")})
    rows = []
    for run in runs:
        later = run["epochs"][1:] or run["epochs"]
        rows.append(
            {
                "repeat": run["repeat"],
                "variant": run["variant"],
                "tier": run["data"]["setting"],
                "train_s": statistics.median(e["train_s"] for e in later),
                "first_epoch_s": run["epochs"][0]["train_s"],
                "items_share_min": min((e["items_share"] for e in run["epochs"]), default=None)
                if all(e["items_share"] is not None for e in run["epochs"])
                else None,
                "run_s": run["run_s"],
                "dice": run["dice"],
            }
        )
    for row in rows:
        ram = next(x for x in rows if x["repeat"] == row["repeat"] and x["variant"] == "ram")
        row["speed_vs_ram"] = ram["train_s"] / row["train_s"]
    print(
        f"\n{'repeat':<7}{'variant':<12}{'tier':<12}{'epoch 1 s':>10}{'later s/ep':>11}{'items/ep':>9}"
        f"{'run s':>8}{'Dice':>7}{'x ram':>7}"
    )
    for row in rows:
        share = "-" if row["items_share_min"] is None else f"{row['items_share_min']:.0%}"
        print(
            f"{row['repeat']:<7}{row['variant']:<12}{row['tier'] or '-':<12}{row['first_epoch_s']:>10.2f}"
            f"{row['train_s']:>11.2f}{share:>9}{row['run_s']:>8.1f}{row['dice']:>7.3f}"
            f"{row['speed_vs_ram']:>6.2f}x"
        )
    medians = {v: statistics.median(r["speed_vs_ram"] for r in rows if r["variant"] == v) for v in VARIANTS[1:]}
    print("median per-epoch speed against all-in-RAM: " + ", ".join(f"{v} {q:.2f}x" for v, q in medians.items()))
    doc = {
        "benchmark": "beyond_ram",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform(), "torch": torch.__version__},
        "options": vars(args),
        "cached_mib": total,
        "ram_budget_mib": budget,
        "rows": rows,
        "runs": runs,
        "median_speed_vs_ram": medians,
    }
    out = write_json(doc, Path(args.out) / f"beyond_ram_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
