"""Tutorial: profile a MONAI trainer with monai-fast's telemetry, then ask the doctor.

Attaches to the trainer (and evaluator) of any recipe, or of your own MONAI engines:

* ``RecordHandler``: the run record every handler writes to (``record.rank0.jsonl``);
* ``NVTXHandler``: NVTX ranges per epoch, data fetch, iteration, forward / loss / backward / step;
* ``GPUSampler``: NVML sampling on a background thread (on a CPU machine: one warning, then off);
* ``TimeBreakdown``: data wait vs compute per iteration;
* ``ThroughputMonitor``: samples/s, voxels/s, ETA;
* ``KernelProfiler``: torch.profiler over iterations 3-5: chrome trace + DLProf-style JSON.

Then ``monai-fast doctor RUN_DIR`` (or the ``doctor()`` call at the end) names the bottleneck.

    python tutorials/profile_a_trainer.py --recipe baseline --run-dir runs/profile
    # with Nsight Systems on a GPU machine, to see the NVTX ranges on the timeline:
    nsys profile -t cuda,nvtx,osrt -o runs/profile/nsys --force-overwrite true \\
        python tutorials/profile_a_trainer.py --device cuda --run-dir runs/profile
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch

from monai_fast.apps.recipes import RECIPES, RecipeConfig, build_recipe
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.handlers import GPUSampler, KernelProfiler, NVTXHandler, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.handlers.preemption import catch_stop_signals, end_of_setup
from monai_fast.report.doctor import doctor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=RECIPES, default="baseline")
    p.add_argument("--data-dir", help="MSD folder; default: a synthetic spleen-like set")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--run-dir", default="runs/profile")
    p.add_argument("--tiny", action="store_true", help="tiny data: a smoke test in seconds")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)

    catch_stop_signals()  # from here: a SIGTERM/SIGUSR1 during set-up is reported, not a silent death
    shape, cases = ((48, 48, 32), 5) if args.tiny else ((128, 128, 64), 16)
    root = args.data_dir or generate_msd(tempfile.mkdtemp(prefix="spleen_like_"), num_cases=cases, shape=shape)
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25)
    cfg = RecipeConfig(max_epochs=args.epochs, **({"patch_size": (32, 32, 32), "num_samples": 2} if args.tiny else {}))
    recipe = build_recipe(args.recipe, train_files, val_files, cfg, args.device)

    record = RecordHandler(args.run_dir)
    record.attach(recipe.trainer)
    record.attach(recipe.evaluator)
    NVTXHandler().attach(recipe.trainer)
    NVTXHandler().attach(recipe.evaluator)
    GPUSampler(interval_s=0.5).attach(recipe.trainer)
    TimeBreakdown().attach(recipe.trainer)
    ThroughputMonitor().attach(recipe.trainer)
    KernelProfiler(args.run_dir, wait=2, warmup=1, active=3).attach(recipe.trainer)
    end_of_setup()  # a signal during set-up stops here with a message
    recipe.trainer.run()

    print(doctor(args.run_dir).text())
    print(
        f"report: {args.run_dir}/report.md; trace: {args.run_dir}/trace_rank0.json; "
        f"kernels: {args.run_dir}/kernels_rank0.json"
    )


if __name__ == "__main__":
    main()
