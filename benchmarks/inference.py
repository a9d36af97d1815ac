"""Sliding-window inference per backend: latency per volume, volumes/s, peak memory, agreement with eager fp32.

One network (``--checkpoint``, or the ``fast`` recipe trained ``--train-epochs`` on the data, or
random weights) infers every validation volume with each backend of
:data:`monai_fast.apps.inference.BACKENDS` that this machine can run: eager fp32, autocast (bf16 on a
CPU with bf16 hardware, fp16 on CUDA), ``torch.compile``, ONNX Runtime, TensorRT. The volumes
are loaded and preprocessed once; each backend is built and warmed up once (``prepare s``:
compilation, export) before the rounds. The rounds are interleaved (round 1: every backend in
turn, round 2: again, in rotated order), so a slow spell of the machine hits them all. Latency
is MONAI's sliding window over one whole volume (network and stitching); peak memory is the
device's over each backend's pass (:class:`~monai_fast.telemetry.memory.DeviceMemory`: CUDA's
allocator, or this process's peak RSS on a CPU). Every backend's label maps are compared with
eager fp32's: mean foreground Dice >= 0.99 agrees (with random weights the logits are near-tied,
so a reduced-precision backend's agreement is shown but not judged; fp32 backends still must
agree). A backend this machine cannot run is listed with what it lacks. Prints a table and writes
``<out>/inference_<time>.json``::

    python benchmarks/inference.py --train-epochs 5 --rounds 3      # the real numbers (device auto)
    python benchmarks/inference.py --tiny --out /tmp/inf            # toy size: proves it runs
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from monai.inferers import SlidingWindowInferer

from monai_fast.apps.inference import BACKENDS, BackendUnavailable, agreement, build_predictor, load_checkpoint, missing
from monai_fast.apps.inference.backends import MIN_DICE, precision_of
from monai_fast.apps.inference.run import inference_transforms
from monai_fast.apps.recipes import RecipeConfig, build_recipe
from monai_fast.apps.recipes.parts import build_network
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.telemetry import cuda_available, device_description, synchronize
from monai_fast.telemetry.memory import DeviceMemory

TINY = {
    "cases": 4,
    "shape": (32, 32, 24),
    "patch": (16, 16, 16),
    "channels": (4, 8, 16),
    "rounds": 1,
    "sw_batch_size": 2,
}


def network_and_config(
    args: argparse.Namespace, train: list[dict], val: list[dict], device: str
) -> tuple[torch.nn.Module, RecipeConfig, str]:
    """The network to time, its config, and where its weights came from."""
    if args.checkpoint:
        net, config = load_checkpoint(args.checkpoint, device=device)
        return net, config, f"checkpoint {args.checkpoint}"
    config = RecipeConfig(
        patch_size=tuple(args.patch),
        channels=tuple(args.channels),
        strides=(2,) * (len(args.channels) - 1),
        sw_batch_size=args.sw_batch_size,
        max_epochs=max(1, args.train_epochs),
        seed=0,
    )
    if args.train_epochs < 1:
        return (
            build_network(config, torch.device(device)).eval(),
            config,
            "random weights (no --checkpoint, --train-epochs 0)",
        )
    recipe = build_recipe("fast", train, val, config, device, progress=False)
    recipe.trainer.run()
    dice = recipe.evaluator.state.metrics.get("val_mean_dice")
    net = getattr(recipe.network, "module", recipe.network).eval()
    return net, config, f"fast recipe, {args.train_epochs} epochs (val Dice {dice})"


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=1)[0].to(torch.uint8).cpu()


def time_rounds(
    predictors: dict, volumes: list[torch.Tensor], inferer: SlidingWindowInferer, rounds: int, device: str
) -> tuple[dict[str, list[float]], dict[str, tuple[int, int]], dict[str, list[torch.Tensor]]]:
    """Per backend: each volume's latency over all rounds, the peak memory and its growth over the memory in use
    before the pass (bytes, the largest of the rounds), and the first round's label maps."""
    times: dict[str, list[float]] = {b: [] for b in predictors}
    peaks: dict[str, tuple[int, int]] = dict.fromkeys(predictors, (0, 0))
    labels: dict[str, list[torch.Tensor]] = {b: [] for b in predictors}
    memory = DeviceMemory(device)
    order = list(predictors)
    for r in range(rounds):
        for backend in order[r % len(order) :] + order[: r % len(order)]:  # interleaved, rotated each round
            memory.release(full=False)
            before = memory.live_bytes()
            with memory.peak() as peak, torch.no_grad():
                for x in volumes:
                    t = time.perf_counter()
                    logits = inferer(x, predictors[backend])
                    synchronize(device)
                    times[backend].append(time.perf_counter() - t)
                    if r == 0:
                        labels[backend].append(_argmax(logits))
            peaks[backend] = (max(peaks[backend][0], peak.peak_bytes), max(peaks[backend][1], peak.peak_bytes - before))
            print(
                f"round {r + 1}/{rounds} {backend:<9} median {statistics.median(times[backend]):.3f} s/volume",
                flush=True,
            )
    return times, peaks, labels


def rows_of(
    predictors: dict,
    lacking: dict[str, str],
    times: dict,
    peaks: dict,
    labels: dict,
    unjudged: frozenset[str] = frozenset(),
) -> list[dict]:
    """One row per backend asked for: timing, memory and agreement with eager, or what it lacks.

    ``unjudged``: backends whose Dice vs eager is reported with ``agrees: None`` (reduced precision
    on random weights, whose near-tied logits make a few flipped voxels meaningless).
    """
    rows = []
    for backend, p in predictors.items():
        agree = [agreement(a, b) for a, b in zip(labels[backend], labels["eager"])]
        dice = statistics.mean(a["dice"] for a in agree)
        latency = statistics.median(times[backend])
        rows.append(
            {
                "backend": backend,
                "available": True,
                "detail": p.detail,
                "prepare_s": p.prepare_s,
                "latency_s": latency,
                "latency_all_s": times[backend],
                "volumes_per_s": 1.0 / latency if latency else None,
                "peak_mib": peaks[backend][0] / 2**20,
                "growth_mib": peaks[backend][1] / 2**20,
                "dice_vs_eager": dice,
                "voxels_equal": statistics.mean(a["voxels"] for a in agree),
                "agrees": None if backend in unjudged else dice >= MIN_DICE,
            }
        )
    rows += [{"backend": b, "available": False, "missing": why} for b, why in lacking.items()]
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| backend | runs as | prepare s | latency s/volume | volumes/s | peak MiB (+ during inference) "
        "| Dice vs eager | agrees |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["available"]:
            lines.append(f"| {r['backend']} | not available: {r['missing']} | | | | | | |")
            continue
        lines.append(
            f"| {r['backend']} | {r['detail']} | {r['prepare_s']:.1f} | {r['latency_s']:.3f} "
            f"| {r['volumes_per_s']:.2f} "
            f"| {r['peak_mib']:.0f} (+{r['growth_mib']:.0f}) | {r['dice_vs_eager']:.4f} "
            f"| {_verdict(r['agrees'])} |"
        )
    return "\n".join(lines)


def _verdict(agrees: bool | None) -> str:
    return "n/a (random weights)" if agrees is None else "yes" if agrees else "NO"


def _predictors(
    backends: list[str], net: torch.nn.Module, config: RecipeConfig, device: str
) -> tuple[dict, dict[str, str]]:
    predictors, lacking = {}, {}
    for backend in backends:
        why = missing(backend, device)
        if why is not None:
            lacking[backend] = f"needs {why}"
            print(f"{backend}: not available here: needs {why}", flush=True)
            continue
        try:
            predictors[backend] = build_predictor(net, backend, config.patch_size, config.sw_batch_size, device)
        except BackendUnavailable as e:
            lacking[backend] = str(e)
            print(f"{backend}: {e}", flush=True)
    return predictors, lacking


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="eager is always included")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="passes over the validation set per backend, interleaved (default %(default)s)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda (default %(default)s)")
    p.add_argument(
        "--checkpoint",
        help="a monai_fast.apps.inference.save_checkpoint file (default: --train-epochs or random weights)",
    )
    p.add_argument(
        "--train-epochs", type=int, default=0, help="without --checkpoint, train the fast recipe this long first"
    )
    p.add_argument("--data-dir", help="an MSD folder (default: synthetic spleen-like data)")
    p.add_argument("--cases", type=int, default=20, help="synthetic cases (default %(default)s)")
    p.add_argument(
        "--shape", type=int, nargs=3, default=(128, 128, 64), help="synthetic volume size (default %(default)s)"
    )
    p.add_argument("--patch", type=int, nargs=3, default=(64, 64, 64), help="sliding-window ROI (default %(default)s)")
    p.add_argument(
        "--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels (default %(default)s)"
    )
    p.add_argument("--sw-batch-size", type=int, default=4, help="windows per network call (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="toy size: " + ", ".join(f"{k} {v}" for k, v in TINY.items()))
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    logging.basicConfig(level=logging.WARNING)
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    root = (
        Path(args.data_dir)
        if args.data_dir
        else synthetic_dataset("spleen-like", args.cases, args.shape, 0, progress=False)
    )
    train, val = load_msd_datalist(root, val_fraction=0.25, seed=0)
    net, config, weights = network_and_config(args, train, val, device)
    pre = inference_transforms(config)
    volumes = [pre({"image": d["image"]})["image"].unsqueeze(0).to(device) for d in val]
    backends = ["eager"] + [b for b in args.backends if b != "eager"]
    predictors, lacking = _predictors(backends, net, config, device)
    inferer = SlidingWindowInferer(
        roi_size=config.patch_size, sw_batch_size=config.sw_batch_size, overlap=config.sw_overlap
    )
    times, peaks, labels = time_rounds(predictors, volumes, inferer, args.rounds, device)
    random_weights = args.checkpoint is None and args.train_epochs < 1
    unjudged = frozenset(b for b in predictors if random_weights and precision_of(b, device) != "fp32")
    rows = rows_of(predictors, lacking, times, peaks, labels, unjudged)
    print(f"\n{len(volumes)} validation volume(s) on {device_description(torch.device(device))}; weights: {weights}\n")
    print(table(rows))
    path = Path(args.out) / f"inference_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(
        {
            "machine": device_description(torch.device(device)),
            "command": " ".join(sys.argv),
            "options": vars(args),
            "weights": weights,
            "config": config.to_dict(),
            "volumes": len(volumes),
            "rows": rows,
        },
        path,
    )
    print(f"wrote {path}")
    return 0 if all(r.get("agrees") is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
