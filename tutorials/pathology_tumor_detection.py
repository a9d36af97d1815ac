"""Tutorial: tumour detection on whole-slide images, the plain MONAI pipeline against the fast one.

After MONAI's pathology tumour-detection example: patches from Camelyon-like slides (pyramidal
tiled TIFF, written once by ``monai-fast synth --kind wsi`` or by this script into the cache)
read by MONAI's WSI reader through ``PatchWSIDataset``, a 2D ``DenseNet`` classifier, ROC AUC on
the validation slides. The ``fast`` pipeline (:mod:`monai_fast.apps.recipes.pathology`) uses the
guide's levers: the WSI backend chosen by what is installed (cuCIM on a GPU; here without it a
tile-aware tifffile reader), ``ThreadDataLoader``, colour jitter, flips and rotations on whole
batches on the device (cuCIM's GPU kernels through MONAI's ``RandCuCIM`` where cuCIM and CUDA
are present; the same as torch operations otherwise, and one line says why), ``AMPToggle``,
Novograd, and monai-fast's ``TimeBreakdown``, ``ThroughputMonitor``, ``TimeToTarget`` and
``RecordHandler``. ``--variant both`` also trains the ``plain`` pipeline on the same patches and
prints patches/s and time to the target AUC of both.

    python tutorials/pathology_tumor_detection.py                        # full size: gpu layout on CUDA,
                                                                         # cpu size otherwise
    python tutorials/pathology_tumor_detection.py --variant both --target 0.95
    python tutorials/pathology_tumor_detection.py --data-dir /data/wsi_like  # a folder from monai-fast synth --kind wsi
    python tutorials/pathology_tumor_detection.py --tiny                 # seconds on a CPU: a smoke test
    monai-fast doctor runs/pathology-<time>/fast                         # where the time went
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
from pathlib import Path

import torch

from monai_fast.apps.recipes.pathology import SIZES, VARIANTS, results_table, run_pathology
from monai_fast.apps.recipes.pathology_augment import cucim_status
from monai_fast.apps.sources.wsi import load_wsi_datalist, synthetic_wsi_dataset
from monai_fast.apps.sources.wsi_reader import BACKENDS, choose_wsi_backend
from monai_fast.files import write_json
from monai_fast.handlers.preemption import stop_signals_caught
from monai_fast.telemetry import cuda_available


def _options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument("--size", choices=SIZES, help="tiny, cpu or gpu (default: gpu on CUDA, else cpu)")
    p.add_argument("--tiny", action="store_true", help="same as --size tiny: a smoke test in seconds on a CPU")
    p.add_argument(
        "--data-dir", help="a folder with dataset.json from 'monai-fast synth --kind wsi'; default: synthetic, cached"
    )
    p.add_argument("--variant", choices=(*VARIANTS, "both"), default="fast", help="(default %(default)s)")
    p.add_argument("--target", type=float, default=0.95, help="validation ROC AUC to stop at (default %(default)s)")
    p.add_argument("--max-epochs", type=int, help="default: the size's")
    p.add_argument("--time-budget", type=float, help="seconds per pipeline (default: none)")
    p.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="fast pipeline's WSI reader (default %(default)s)"
    )
    p.add_argument(
        "--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto", help="(default %(default)s)"
    )
    p.add_argument("--run-dir", help="default runs/pathology-<time>")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train the pathology variants; bad slides or a short epoch end in one line naming them (exit 1).

    A stop signal (``SIGTERM``, ``SIGUSR1``) from the first line until training starts ends in one
    line naming it (exit 143), before training.
    """
    from monai_fast.apps.sources.wsi import WSIDataError
    from monai_fast.apps.sources.wsi_reader import WSIBackendError
    from monai_fast.data.items import DataItemError
    from monai_fast.data.preflight import PreflightError
    from monai_fast.handlers import ShortEpochError

    try:
        with stop_signals_caught():  # first: a SIGTERM/SIGUSR1 during set-up is kept; run_pathology stops there
            return _main(argv)
    except (PreflightError, DataItemError, ShortEpochError, WSIDataError, WSIBackendError) as e:
        print(f"pathology_tumor_detection: {e}", file=sys.stderr, flush=True)
        return 1


def _main(argv: list[str] | None = None) -> int:
    args = _options(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    device = torch.device(args.device)
    size = SIZES["tiny" if args.tiny else args.size or ("gpu" if device.type == "cuda" else "cpu")]
    run_dir = Path(args.run_dir or f"runs/pathology-{dt.datetime.now():%Y%m%d-%H%M%S}")

    # the one line on what this machine can use, before any work
    cucim = cucim_status(device)
    reader = choose_wsi_backend(args.backend, device, quiet=True)
    print(f"GPU levers: cuCIM {'on' if cucim is None else 'off: ' + cucim}; WSI reader {reader.name}")

    root = args.data_dir or synthetic_wsi_dataset(
        size.slides, size.shape, size.patch_size, tile=size.tile, levels=size.levels
    )
    train, val = load_wsi_datalist(root)
    print(f"{len(train)} training and {len(val)} validation patches from {root}")
    labelled = json.loads((Path(root) / "dataset.json").read_text()).get("monai_fast", {}).get("patch_size")
    config = size.config(
        max_epochs=args.max_epochs, backend=args.backend, precision=args.precision, patch_size=labelled
    )  # the patch size the labels were made for, when the folder says
    variants = VARIANTS if args.variant == "both" else (args.variant,)
    # each run checks the slides and builds its data sets and engines, then ends the set-up (end_of_setup):
    # a signal since the first line stops the tutorial there, before training, with a message (exit 143)
    results = [
        run_pathology(
            v, train, val, config, device, target=args.target, time_budget_s=args.time_budget, run_dir=run_dir
        )
        for v in variants
    ]
    write_json({"device": str(device), "data": str(root), "results": results}, run_dir / "results.json")
    print(results_table(results))
    for r in results:
        print(f"{r['variant']}: reader {r['reader']}; augmentation {r['augment']}; {r['optimizer']}, {r['precision']}")
    print(f"results: {run_dir / 'results.json'}; doctor: monai-fast doctor {run_dir / variants[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
