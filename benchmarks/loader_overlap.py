"""Make the next batch during the step, or when the step asks for it? ``FastTraining(prefetch=...)`` on a CPU.

The trainer is ``your_trainer.py``'s (MONAI's spleen tutorial: UNet 8-16-32-64, DiceLoss, Adam,
batch 2 x 4 crops of 64^3, a sliding-window evaluator) with ``FastTraining`` attached, once with
``prefetch=True`` (the loader thread makes the next batch while the step computes) and once with
``prefetch=False`` (each batch is made in the training thread when the step asks for it). Each run is its own process;
the variants take turns, each one first in turn from repeat to repeat. Conditions:

* ``chain``: ``tutorial`` (the tutorial's random crops, flips, rotations and intensity shift) or
  ``heavy`` (the same plus a ``RandAffined`` on every item: rotation and scaling, resampled);
* ``isa``: ``native`` or ``avx2`` (oneDNN and ATen limited to AVX2, which is how this project
  emulates a CPU without bf16 hardware; FastTraining then measures bf16 as slower and trains in fp32).

A third variant, ``prefetch="auto"`` (FastTraining's default), lets
:class:`~monai_fast.handlers.prefetch.PrefetchChoice` time both over the first iterations and keep
the faster. A fourth, ``prefetch_team``, is ``prefetch=True`` with the loader thread running torch's
parallel code on its own OpenMP team, as torch does by default, instead of on the loader thread alone
(:func:`~monai_fast.openmp.serial_openmp_here`): the ratio prefetch_team / prefetch says what that costs
the step. The table gives the medians over epochs 2.. of training seconds per epoch (the
iterations, data waits included), of the step alone, and of the data wait; below each condition,
the ratios prefetch / on demand and prefetch / auto per repeat (above 1: faster than prefetch) and
what auto chose. All variants draw the same crops, so their
losses must be equal wherever FastTraining's measured precision and layout came out the same; the
script reports the largest difference over those pairs (0 expected). The JSON keeps
every iteration.

    python benchmarks/loader_overlap.py                      # about 20 minutes on 2 CPU cores
    python benchmarks/loader_overlap.py --repeats 2 --chains tutorial --isa native
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("prefetch", "on_demand", "auto", "prefetch_team")
ISA_LIMITS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def child(spec: dict) -> dict:
    """One run in this process: build the tutorial trainer, attach FastTraining, train, time every iteration."""
    import torch
    from ignite.engine import Events
    from monai.transforms import Compose, RandAffined
    from your_trainer import build

    from monai_fast.apps.sources.msd import load_msd_datalist
    from monai_fast.apps.sources.synthetic import synthetic_dataset
    from monai_fast.handlers import FastTraining

    if spec["variant"] == "prefetch_team":  # the loader thread keeps torch's own team (the variant compared)
        import monai_fast.data.loaders as loaders

        loaders.serial_openmp_here = lambda: False

    root = synthetic_dataset("spleen-like", spec["cases"], tuple(spec["shape"]), 0, progress=False)
    files = load_msd_datalist(root, val_fraction=0.25, seed=0)
    args = argparse.Namespace(seed=0, patch=spec["patch"], channels=spec["channels"], workers=0, epochs=spec["epochs"])
    trainer, evaluator = build(files, args, "cpu")
    if spec["chain"] == "heavy":
        ds = trainer.data_loader.dataset
        ds.transform = Compose(
            list(ds.transform.transforms)
            + [
                RandAffined(
                    keys=["image", "label"],
                    prob=1.0,
                    rotate_range=(0.26, 0.26, 0.26),
                    scale_range=(0.1, 0.1, 0.1),
                    mode=("bilinear", "nearest"),
                    padding_mode="zeros",
                )
            ]
        )
    fast = FastTraining(
        prefetch={"prefetch": True, "on_demand": False, "auto": "auto", "prefetch_team": True}[spec["variant"]],
        progress=False,
    )
    fast.attach(trainer, evaluator)
    it: list[dict] = []
    marks: dict = {}
    epochs: list[dict] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: marks.update(epoch=time.perf_counter()))
    trainer.add_event_handler(Events.GET_BATCH_STARTED, lambda e: marks.update(get=time.perf_counter()))
    trainer.add_event_handler(
        Events.GET_BATCH_COMPLETED, lambda e: marks.update(wait=time.perf_counter() - marks["get"])
    )
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: marks.update(step=time.perf_counter()))

    def iteration_done(e):
        it.append(
            {
                "epoch": e.state.epoch,
                "wait_s": marks["wait"],
                "step_s": time.perf_counter() - marks["step"],
                "loss": float(
                    e.state.output[0]["loss"] if isinstance(e.state.output, list) else e.state.output["loss"]
                ),
            }
        )

    trainer.add_event_handler(Events.ITERATION_COMPLETED, iteration_done)
    evaluator.add_event_handler(Events.STARTED, lambda e: marks.update(val=time.perf_counter()))

    def epoch_done(_):
        epochs.append(
            {
                "epoch": trainer.state.epoch,
                "train_s": marks["val"] - marks["epoch"],
                "val_s": time.perf_counter() - marks["val"],
                "dice": float(evaluator.state.metrics["val_mean_dice"]),
            }
        )

    evaluator.add_event_handler(Events.COMPLETED, epoch_done)
    trainer.run()
    return {
        "iterations": it,
        "epochs": epochs,
        "threads": torch.get_num_threads(),
        "applied": {k: v["setting"] if v["applied"] else None for k, v in fast.applied.items()},
        "prefetch": fast.applied["prefetch"],
    }


def run_child(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env.update(ISA_LIMITS[spec["isa"]])
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"run {spec} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(run: dict) -> dict:
    later = [e for e in run["epochs"] if e["epoch"] > 1]
    steps = [i for i in run["iterations"] if i["epoch"] > 1]
    per_epoch = {}
    for i in steps:
        d = per_epoch.setdefault(i["epoch"], {"step": 0.0, "wait": 0.0})
        d["step"] += i["step_s"]
        d["wait"] += i["wait_s"]
    return {
        "train_s": statistics.median(e["train_s"] for e in later),
        "step_s": statistics.median(d["step"] for d in per_epoch.values()),
        "wait_s": statistics.median(d["wait"] for d in per_epoch.values()),
        "val_s": statistics.median(e["val_s"] for e in later),
        "final_dice": run["epochs"][-1]["dice"],
    }


def report(runs: list[dict], isas: list[str], chains: list[str], repeats: int) -> list[dict]:
    """Print the table of ``runs`` and return its rows (ratios, what auto chose, the loss check)."""
    rows = []
    print(
        f"\n{'isa':<7}{'chain':<9}{'repeat':<7}{'variant':<11}{'train s/ep':>11}{'step s/ep':>10}{'wait s/ep':>10}"
        f"{'val s/ep':>9}{'precision':>10}{'layout':>17}"
    )
    for isa in isas:
        for chain in chains:
            ratios, gaps = [], []
            for r in range(1, repeats + 1):
                pair = {x["variant"]: x for x in runs if x["repeat"] == r and x["isa"] == isa and x["chain"] == chain}
                present = [v for v in VARIANTS if v in pair]  # a result from before prefetch_team has three
                for v in present:
                    s = pair[v]["summary"]
                    print(
                        f"{isa:<7}{chain:<9}{r:<7}{v:<11}{s['train_s']:>11.2f}{s['step_s']:>10.2f}{s['wait_s']:>10.2f}"
                        f"{s['val_s']:>9.2f}{pair[v]['applied'].get('precision') or 'fp32':>10}"
                        f"{pair[v]['applied'].get('memory_format') or 'contiguous':>17}"
                    )
                train = {v: pair[v]["summary"]["train_s"] for v in present}
                ratios.append(
                    {
                        "prefetch/on_demand": train["prefetch"] / train["on_demand"],
                        "prefetch/auto": train["prefetch"] / train["auto"],
                        "auto_chose": pair["auto"]["prefetch"]["setting"],
                    }
                )
                if "prefetch_team" in train:  # the layout each measured may differ, and with it the step
                    ratios[-1]["prefetch_team/prefetch"] = train["prefetch_team"] / train["prefetch"]
                    ratios[-1]["team_same_layout"] = pair["prefetch_team"]["applied"].get("memory_format") == pair[
                        "prefetch"
                    ]["applied"].get("memory_format")
                for other in present[1:]:  # FastTraining's measured layout may differ between runs, and the numerics
                    if all(
                        pair[other]["applied"].get(k) == pair["prefetch"]["applied"].get(k)
                        for k in ("precision", "memory_format")
                    ):
                        losses = zip(pair["prefetch"]["iterations"], pair[other]["iterations"])
                        gaps.append(max(abs(a["loss"] - b["loss"]) for a, b in losses))
            row = {
                "isa": isa,
                "chain": chain,
                "repeats": ratios,
                "median_on_demand": statistics.median(x["prefetch/on_demand"] for x in ratios),
                "median_auto": statistics.median(x["prefetch/auto"] for x in ratios),
                "median_team": statistics.median(teams)
                if (teams := [x["prefetch_team/prefetch"] for x in ratios if "prefetch_team/prefetch" in x])
                else None,
                "max_loss_difference": max(gaps) if gaps else None,
                "loss_pairs_compared": len(gaps),
            }
            rows.append(row)
            on_demand = " ".join(f"{x['prefetch/on_demand']:.2f}" for x in ratios)
            auto = " ".join(f"{x['prefetch/auto']:.2f}" for x in ratios)
            chose = ", ".join(x["auto_chose"] for x in ratios)
            team = " ".join(
                f"{x['prefetch_team/prefetch']:.2f}{'' if x['team_same_layout'] else ' (other layout)'}"
                for x in ratios
                if "prefetch_team/prefetch" in x
            )
            print(
                f"{isa:<7}{chain:<9}training s/epoch, prefetch over on demand: {on_demand} "
                f"(median {row['median_on_demand']:.2f}x); "
                f"prefetch over auto: {auto} (median {row['median_auto']:.2f}x; auto chose {chose}); "
                + (
                    f"the loader thread's own team over it alone: {team} (median {row['median_team']:.2f}x); "
                    if team
                    else ""
                )
                + f"largest loss difference {row['max_loss_difference']} over {len(gaps)} pairs "
                "with the same precision and layout"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per variant and condition, taking turns (default 2)")
    p.add_argument("--epochs", type=int, default=5, help="epochs per run; the first is left out as warm-up (default 5)")
    p.add_argument("--chains", nargs="+", choices=("tutorial", "heavy"), default=["tutorial", "heavy"])
    p.add_argument("--isa", nargs="+", choices=tuple(ISA_LIMITS), default=["avx2", "native"])
    p.add_argument(
        "--cases", type=int, default=16, help="synthetic spleen-like cases, a quarter for validation (default 16)"
    )
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument(
        "--patch", type=int, nargs=3, default=(64, 64, 64), help="training crop / sliding window (default 64^3)"
    )
    p.add_argument(
        "--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels (default 8 16 32 64)"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    p.add_argument(
        "--recompute", metavar="JSON", help="print the table of a saved run and rewrite its rows with this code"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.recompute:
        from monai_fast.files import write_json

        doc = json.loads(Path(args.recompute).read_text())
        o = doc["options"]
        doc["rows"] = report(doc["runs"], o["isa"], o["chains"], o["repeats"])
        print(f"rows rewritten: {write_json(doc, Path(args.recompute))}")
        return 0
    if args.repeats < 1 or args.epochs < 2:
        p.error("--repeats must be >= 1 and --epochs >= 2 (the first epoch is left out)")
    from monai_fast.files import write_json

    base = {
        "cases": args.cases,
        "shape": list(args.shape),
        "patch": list(args.patch),
        "channels": list(args.channels),
        "epochs": args.epochs,
    }
    runs = []
    for r in range(args.repeats):
        for isa in args.isa:
            for chain in args.chains:
                order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]  # each variant first in turn
                for variant in order:
                    spec = {**base, "chain": chain, "isa": isa, "variant": variant}
                    print(f"-- repeat {r + 1}, {isa}, {chain} chain: {variant}", flush=True)
                    result = run_child(spec)
                    runs.append({"repeat": r + 1, **spec, **result, "summary": summarise(result)})
    rows = report(runs, args.isa, args.chains, args.repeats)
    cpu = platform.processor() or platform.machine()
    doc = {
        "benchmark": "loader_overlap",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "processor": cpu,
            "cpus": os.cpu_count(),
            "threads": runs[0]["threads"],
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "options": {k: v for k, v in vars(args).items() if k != "child"},
        "rows": rows,
        "runs": runs,
    }
    out = write_json(doc, Path(args.out) / f"loader_overlap_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
