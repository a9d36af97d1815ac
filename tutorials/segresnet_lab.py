"""Lab: a SegResNet on one GPU (or a CPU), watched in TensorBoard, its performance table measured by the run.

MONAI's ``SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=16, dropout_prob=0.2)``
learns the spleen-like synthetic set (or your MSD folder) in monai-fast's ``fast`` recipe: a MONAI
``SupervisedTrainer`` + ``SupervisedEvaluator`` with ``FastTraining`` (cache, precision, layout) and
the telemetry handlers (``TimeBreakdown``, ``ThroughputMonitor``, ``RecordHandler``, ``GPUSampler``
on a GPU). The run folder then holds:

* TensorBoard events (``<run-dir>/<recipe>/``): loss per iteration and epoch, validation Dice,
  samples/s, data-wait share, GPU utilisation and memory when there is a GPU, and at every
  validation the first case's input, label and prediction as 3D image summaries (animated along
  the axial axis, MONAI's ``plot_2d_or_3d_image``);
* ``prediction.png``: input, ground truth and prediction on the axial slice with the most spleen;
* ``performance.md`` and ``performance.json``: the lab's expected-performance table, measured:
  time per epoch, final and best Dice, peak GPU memory (peak RSS on a CPU), GPU utilisation;
* the run record and the doctor's ``report.md`` (``monai-fast doctor <run-dir>/<recipe>``).

    python tutorials/segresnet_lab.py                          # spleen-scale on a GPU, small on a CPU
    python tutorials/segresnet_lab.py --data-dir /data/Task09_Spleen --max-epochs 300
    python tutorials/segresnet_lab.py --tiny                   # seconds on a CPU: a smoke test
    tensorboard --logdir runs/segresnet-lab

The notebook ``segresnet_lab.ipynb`` is the same lab, cell by cell (both call ``monai_fast.apps.demo.lab``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from pathlib import Path

import torch

from monai_fast.apps.demo.lab import lab_data, run_lab
from monai_fast.apps.recipes import RECIPES
from monai_fast.extras import MissingExtraError
from monai_fast.handlers.preemption import stop_signals_caught
from monai_fast.report.doctor import doctor
from monai_fast.telemetry import cuda_available


def _options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="MSD folder with dataset.json; default: a synthetic spleen-like set (cached)")
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument(
        "--recipe", choices=RECIPES, default="fast", help="the recipe around the network (default %(default)s)"
    )
    p.add_argument("--max-epochs", type=int, help="default 100 on a GPU, 20 on a CPU, 2 with --tiny")
    p.add_argument("--target", type=float, default=1.0, help="stop at this validation Dice (default: run every epoch)")
    p.add_argument("--run-dir", help="default runs/segresnet-lab-<time>")
    p.add_argument("--tiny", action="store_true", help="tiny data, 2 epochs: a smoke test in seconds on a CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (one log line per epoch)")
    args = p.parse_args()
    if args.max_epochs is not None and args.max_epochs < 1:
        p.error(f"--max-epochs {args.max_epochs}: at least 1")
    return args


def main() -> None:
    """Run the lab; a SIGTERM/SIGUSR1 before training starts stops it there with a message (exit 143)."""
    try:
        with stop_signals_caught():  # first: a signal while the data are written and cached, the recipe built: kept
            _lab(_options())  # its first epoch ends the set-up (TargetRun.segment): a signal kept stops it there
    except MissingExtraError as e:  # the plots extra, named before any data are written
        raise SystemExit(f"segresnet_lab: {e}") from None


def _lab(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    device = torch.device(args.device)
    size = "tiny" if args.tiny else "gpu" if device.type == "cuda" else "cpu"
    train_files, val_files, config = lab_data(size, args.data_dir, args.max_epochs, progress=not args.no_progress)
    run_dir = Path(args.run_dir or f"runs/segresnet-lab-{dt.datetime.now():%Y%m%d-%H%M%S}")
    lab = run_lab(
        train_files,
        val_files,
        config,
        device,
        run_dir,
        recipe=args.recipe,
        target=args.target,
        progress=not args.no_progress,
    )
    diagnosis = doctor(lab.record_dir)
    print(lab.table)
    print(f"doctor: {diagnosis.verdict}; figure: {run_dir / 'prediction.png'}; table: {run_dir / 'performance.md'}")
    print(f"tensorboard --logdir {run_dir}")


if __name__ == "__main__":
    main()
