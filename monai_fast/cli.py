"""``monai-fast``: the command line.

``monai-fast demo``   race the fast recipe against the plain-MONAI baseline to a target Dice.
``monai-fast bench``  the same race with all three recipes and repeats; JSON for benchmarks/results.
``monai-fast synth``  write a synthetic data set in Medical Segmentation Decathlon layout.
``monai-fast doctor`` name a run's bottleneck from its record, with evidence and the fix.
``monai-fast tune``   pick batch size, sliding-window batch, validation device, precision by throughput.
``monai-fast launch`` run a training script on N local processes (torchrun, DDP).
``monai-fast sbatch`` write an sbatch script (ranks per GPU, requeue, USR1 before the time limit).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from monai_fast.data.synthetic import synthetic_dataset

__all__ = ["main", "race"]

logger = logging.getLogger("monai_fast")

_DEMO_DEFAULTS = {"cases": 16, "shape": (128, 128, 64)}


def _resolve_device(name: str) -> str:
    from monai_fast.telemetry import cuda_available

    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name.startswith("cuda") and not cuda_available():
        raise SystemExit(f"--device {name}: this torch build sees no CUDA device (use --device cpu)")
    return name


def _config_from_args(args: argparse.Namespace, seed: int):
    from monai_fast.recipes import RecipeConfig

    kw = {"seed": seed}
    for name in ("max_epochs", "val_interval", "batch_size", "num_samples"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if args.patch_size:
        kw["patch_size"] = tuple(args.patch_size)
    if args.channels:
        kw["channels"] = tuple(args.channels)
        kw["strides"] = (2,) * (len(args.channels) - 1)
    if getattr(args, "workers", None) is not None:
        kw["num_workers"] = args.workers
    if getattr(args, "fp32", False):
        kw["amp"] = False
    kw["compile"] = getattr(args, "compile", False)
    try:
        return RecipeConfig(**kw)
    except ValueError as e:
        raise SystemExit(f"bad option: {e}") from e


def _meta(args: argparse.Namespace, data_root: Path, device: str) -> dict:
    import ignite
    import monai
    import torch

    from monai_fast import __version__
    from monai_fast.telemetry import device_description

    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "device": device_description(device),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {"monai_fast": __version__, "torch": torch.__version__, "monai": monai.__version__, "ignite": ignite.__version__},
        "data": str(data_root),
        "command": " ".join(sys.argv),
        "options": {k: v for k, v in vars(args).items() if k != "func"},
    }


def race(args: argparse.Namespace, recipes: Sequence[str], run_dir: Path, train_seed: int | None = None):
    """Generate or read the data, run each recipe to the target, and return the results.

    ``args.seed`` fixes the data and the split; ``train_seed`` (default: the same) the weights and crops.
    """
    from monai_fast.data.msd import load_msd_datalist
    from monai_fast.recipes.runner import run_to_target

    progress = not args.no_progress
    if args.data_dir:
        data_root = Path(args.data_dir)
    else:
        data_root = synthetic_dataset("spleen-like", args.cases, args.shape, args.seed, progress)
    train_files, val_files = load_msd_datalist(data_root, val_fraction=args.val_fraction, seed=args.seed)
    device = _resolve_device(args.device)
    config = _config_from_args(args, args.seed if train_seed is None else train_seed)
    logger.info("%d training / %d validation cases from %s on %s", len(train_files), len(val_files), data_root, device)
    configs = dict.fromkeys(recipes, config)
    tuned = None
    if getattr(args, "tune", False) and "fast" in recipes:
        tuned = _tune(args, config, train_files, val_files, device)
        configs["fast"] = tuned.apply(config)
        print(f"-- tuned fast: batch_size={tuned.batch_size}, sw_batch_size={tuned.sw_batch_size}, "
              f"val_device={tuned.val_device}, precision={tuned.precision}"
              + ("" if tuned.cache_where is None else f", cache {tuned.cache_where} ({tuned.cache_budget_mib:.0f} MiB left for it)")
              + (" (from the tuning cache)" if tuned.from_cache else f" (tuning took {tuned.tuning_s:.1f} s, not counted below)"),
              flush=True)
    results = []
    for name in recipes:
        print(f"-- {name}: training to Dice {args.target} (budget {args.time_budget:.0f} s)", flush=True)
        r = run_to_target(
            name, train_files, val_files, configs[name], device, args.target, args.time_budget, run_dir, progress=progress
        )
        state = f"reached in {r.time_to_target_s:.1f} s" if r.reached else f"not reached in {r.total_s:.0f} s"
        print(f"   {name}: {state}, best Dice {r.best_dice or 0:.3f}, {r.epochs_run} epochs", flush=True)
        if r.run_dir is not None and r.epochs:
            from monai_fast.report.doctor import doctor

            r.diagnosis = doctor(r.run_dir).to_dict()
        results.append(r)
    meta = _meta(args, data_root, device)
    if tuned is not None:
        meta["tuning"] = {**tuned.to_dict(), "from_cache": tuned.from_cache}
    return results, meta


def _space_from_args(args: argparse.Namespace, device: str):
    from monai_fast.tune import default_space

    try:
        return default_space(
            device, search_amp=args.search_amp, amp=False if getattr(args, "fp32", False) else None, batch_range=tuple(args.batch_range), sw_batch_range=tuple(args.sw_range),
            max_trials=args.trials, margin=args.margin,
        )
    except ValueError as e:
        raise SystemExit(f"bad tuning option: {e}") from e


def _tune(args: argparse.Namespace, config, train_files: Sequence[dict], val_files: Sequence[dict], device: str):
    from monai_fast.tune import TuningError, tune_recipe, typical_val_shape

    val_shape = typical_val_shape(val_files, config)
    try:
        return tune_recipe(
            config, val_shape, device, space=_space_from_args(args, device), memory_cap_mib=args.memory_cap_mib,
            store=args.tune_cache, force=args.retune, progress=not args.no_progress,
            train_files=train_files if args.place_cache else None, cache_tradeoff=args.cache_tradeoff,
        )
    except (TuningError, ValueError) as e:
        raise SystemExit(f"monai-fast: tuning failed: {e}") from e


def _cmd_demo(args: argparse.Namespace) -> int:
    from monai_fast.report.compare import format_table, write_race

    run_dir = Path(args.run_dir or f"runs/demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    results, meta = race(args, args.recipes, run_dir)
    write_race(results, run_dir, meta)
    print()
    print(format_table(results))
    for r in results:
        if r.diagnosis:
            print(f"doctor, {r.recipe}: {r.diagnosis['verdict']}: {r.diagnosis['evidence'][0]}; "
                  f"next: {r.diagnosis['fixes'][0]}  (report: {r.run_dir}/report.md)")
    print(f"\nrun folder: {run_dir}  (results.json, epochs.csv, dice_vs_time.png, TensorBoard events per recipe)")
    print(f"tensorboard --logdir {run_dir}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from monai_fast.report.compare import (
        format_table,
        speedup,
        write_json,
        write_race,
    )

    stamp = _dt.datetime.now()
    base_dir = Path(args.run_dir or f"runs/bench-{stamp:%Y%m%d-%H%M%S}")
    repeats = []
    meta: dict = {}
    for i in range(args.repeats):
        print(f"== repeat {i + 1}/{args.repeats}", flush=True)
        # repeats differ in weights and crops, not in data or split
        results, meta = race(args, args.recipes, base_dir / f"repeat{i + 1}", train_seed=args.seed + i)
        write_race(results, base_dir / f"repeat{i + 1}", meta)
        print(format_table(results), flush=True)
        repeats.append(results)
    summary = {}
    for name in args.recipes:
        runs = [next(r for r in rs if r.recipe == name) for rs in repeats]
        times = [r.time_to_target_s for r in runs if r.reached]
        summary[name] = {
            "reached": f"{len(times)}/{len(runs)}",
            "median_time_to_target_s": statistics.median(times) if times else None,
            "median_epochs_to_target": statistics.median([r.epochs_to_target for r in runs if r.reached]) if times else None,
            "median_train_s_per_epoch": statistics.median(r.train_s_per_epoch for r in runs),
            "median_data_wait_share": statistics.median(r.data_wait_share for r in runs),
        }
        for ref in ("baseline", "monai_tutorial"):  # same-run ratios against each reference
            if ref in args.recipes and name != ref:
                pairs = [(next(r for r in rs if r.recipe == name), next(r for r in rs if r.recipe == ref)) for rs in repeats]
                summary[name][f"speedup_over_{ref}"] = [
                    {"factor": f, "lower_bound": lb} for f, lb in (speedup(a, b) for a, b in pairs)
                ]
    doc = {**meta, "benchmark": "time_to_dice", "repeats": [[r.to_dict() for r in rs] for rs in repeats], "summary": summary}
    out = Path(args.out) / f"time_to_dice_{stamp:%Y%m%d-%H%M%S}.json"
    write_json(doc, out)
    print("\nsummary (medians over repeats):")
    print(json.dumps(summary, indent=2))
    print(f"\nwrote {out}")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from monai_fast.data.msd import load_msd_datalist

    if args.data_dir:
        data_root = Path(args.data_dir)
    else:
        data_root = synthetic_dataset("spleen-like", args.cases, args.shape, args.seed, not args.no_progress)
    train_files, val_files = load_msd_datalist(data_root, val_fraction=args.val_fraction, seed=args.seed)
    device = _resolve_device(args.device)
    config = _config_from_args(args, args.seed)
    result = _tune(args, config, train_files, val_files, device)
    print(result.table())
    if result.from_cache:
        print("(from the tuning cache; --retune to measure again)")
    print("\nuse it: monai-fast demo --tune ...   or in Python: tune_recipe(...).apply(RecipeConfig(...))")
    if args.out:
        from monai_fast.files import write_json

        write_json({**_meta(args, data_root, device), "tuning": result.to_dict()}, Path(args.out))
        print(f"wrote {args.out}")
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    import subprocess

    if args.nproc < 1:
        raise SystemExit("--nproc must be >= 1")
    if not Path(args.script).is_file():
        raise SystemExit(f"monai-fast launch: script {args.script} not found")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--max-restarts=0", "--monitor-interval=1", args.script, *args.script_args]
    logger.info("running %s", " ".join(cmd))
    return subprocess.call(cmd)


def _cmd_sbatch(args: argparse.Namespace) -> int:
    from monai_fast.distributed.sbatch import SbatchSpec, render_sbatch

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        spec = SbatchSpec(
            command, nodes=args.nodes, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
            cpus_per_task=args.cpus_per_task, time=args.time, requeue=not args.no_requeue,
            signal_lead_s=args.signal_lead, job_name=args.job_name, partition=args.partition, account=args.account,
            mem=args.mem,
        )
    except ValueError as e:
        raise SystemExit(f"monai-fast sbatch: {e}") from e
    script = render_sbatch(spec)
    if args.out:
        Path(args.out).write_text(script)
        print(f"wrote {args.out}; submit with: sbatch {args.out}")
    else:
        print(script, end="")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from monai_fast.report.doctor import doctor

    try:
        diagnosis = doctor(args.run_dir, data_threshold=args.data_threshold, util_low=args.util_low)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from e
    except ValueError as e:
        raise SystemExit(f"{args.run_dir}: {e}") from e
    print(diagnosis.text())
    print(f"\nreport: {Path(args.run_dir) / 'report.md'}")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from monai_fast.data.synthetic import generate_msd

    root = generate_msd(args.out, kind=args.kind, num_cases=args.cases, shape=args.shape, seed=args.seed, progress=not args.no_progress)
    print(f"wrote {args.cases} {args.kind} cases in MSD layout to {root}")
    return 0


def _add_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", help="an MSD-layout folder with dataset.json (e.g. Task09_Spleen); default: synthetic spleen-like data")
    g.add_argument("--cases", type=int, default=_DEMO_DEFAULTS["cases"], help="synthetic cases to generate (default %(default)s)")
    g.add_argument("--shape", type=int, nargs=3, default=_DEMO_DEFAULTS["shape"], metavar=("X", "Y", "Z"), help="synthetic volume size in voxels (default %(default)s)")
    g.add_argument("--val-fraction", type=float, default=0.25, help="share of cases held out for validation (default %(default)s)")
    g.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:1' (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of data, split, weights and crops (default %(default)s)")


def _add_model_options(p: argparse.ArgumentParser, race: bool) -> None:
    g = p.add_argument_group("model and batches")
    g.add_argument("--patch-size", type=int, nargs=3, metavar=("X", "Y", "Z"), help="training patch / sliding-window ROI (default 64 64 64)")
    if race:
        g.add_argument("--batch-size", type=int, help="volumes per batch (default: the recipe's own; fast 1, the others 2)")
    g.add_argument("--num-samples", type=int, help="random crops per volume (default: the recipe's own; fast 2, the others 4)")
    g.add_argument("--channels", type=int, nargs="+", help="UNet channels per level (default 8 16 32 64)")
    if race:
        g.add_argument("--workers", type=int, help="DataLoader worker processes of the baseline (default min(4, CPUs))")
        g.add_argument("--fp32", action="store_true", help="no mixed precision in any recipe (default: fast picks bf16/fp16 where it pays)")
        g.add_argument("--compile", action="store_true", help="torch.compile the network (slower first iterations)")


def _add_tuning_options(p: argparse.ArgumentParser, race: bool) -> None:
    g = p.add_argument_group("auto-tuning" + (" (with --tune)" if race else ""))
    if race:
        g.add_argument("--tune", action="store_true", help="tune fast's batch size, sliding-window batch, validation device "
                       "and precision first (cached per machine and model; see 'monai-fast tune --help')")
    g.add_argument("--batch-range", type=int, nargs=2, default=(1, 8), metavar=("LO", "HI"), help="training batch sizes (volumes) to search (default %(default)s)")
    g.add_argument("--sw-range", type=int, nargs=2, default=(1, 16), metavar=("LO", "HI"), help="sliding-window batch sizes to search (default %(default)s)")
    g.add_argument("--trials", type=int, default=8, help="most candidates run per search (default %(default)s)")
    g.add_argument("--memory-cap-mib", type=float, help="most memory a candidate may use (default: the GPU's memory; on a CPU, this process's RAM plus what is free)")
    g.add_argument("--margin", type=float, default=0.1, help="share of the cap kept free for the data cache and spikes (default %(default)s)")
    g.add_argument("--search-amp", action="store_true", help="also compare fp32 with the automatic mixed precision")
    g.add_argument("--place-cache", action="store_true", help="also place the training cache: in device memory (GPU on CUDA, "
                   "RAM on a CPU) when it fits beside the pick's measured peak, else beside a smaller batch within "
                   "--cache-tradeoff of its throughput, else where the cache planner sends it")
    g.add_argument("--cache-tradeoff", type=float, default=0.05, help="largest share of training throughput given up "
                   "to fit the cache in device memory (default %(default)s)")
    g.add_argument("--retune", action="store_true", help="tune again even when the cache holds a result")
    g.add_argument("--tune-cache", help="the JSON file of tuning results (default $MONAI_FAST_CACHE/tuning.json or ~/.cache/monai-fast/tuning.json)")


def _add_race_options(p: argparse.ArgumentParser, budget: float, recipes: Sequence[str]) -> None:
    from monai_fast.recipes import RECIPES

    _add_data_options(p)
    g = p.add_argument_group("race")
    g.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(recipes), help="recipes to run, in this order (default %(default)s)")
    g.add_argument("--target", type=float, default=0.9, help="validation mean Dice (no background) to reach (default %(default)s)")
    g.add_argument("--time-budget", type=float, default=budget, help="seconds each recipe may run before it is stopped (default %(default)s)")
    g.add_argument("--max-epochs", type=int, default=200, help="epoch limit per recipe (default %(default)s)")
    g.add_argument("--val-interval", type=int, default=1, help="validate every N epochs (default %(default)s)")
    _add_model_options(p, race=True)
    _add_tuning_options(p, race=True)
    g = p.add_argument_group("output")
    g.add_argument("--run-dir", help="where results.json, epochs.csv, the PNG and TensorBoard events go (default runs/<command>-<time>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (for logs and CI)")


def build_parser() -> argparse.ArgumentParser:
    """The ``monai-fast`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="monai-fast",
        description="Fast 3D medical-image training with MONAI and PyTorch-Ignite: recipes, handlers, benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'monai-fast COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "demo",
        help="race the fast recipe against a plain-MONAI baseline to a target Dice (about 5 min on 2 CPU cores)",
        description=(
            "Generate (once, then reuse) a synthetic spleen-like CT set in MSD layout, train the 'fast' and the "
            "'baseline' recipe on it until validation mean Dice reaches --target or --time-budget runs out, and print "
            "time to target, epochs, train/val seconds per epoch, data-wait share and the speed-up. Writes a run "
            "folder with results.json, epochs.csv, dice_vs_time.png and TensorBoard events. When the baseline does not "
            "reach the target within its budget, the speed-up is shown as a lower bound ('>=')."
        ),
    )
    _add_race_options(p, budget=210.0, recipes=("fast", "baseline"))
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "bench",
        help="time-to-Dice benchmark of all three recipes with repeats; writes JSON to benchmarks/results/",
        description="The demo's race with every recipe (baseline, monai_tutorial, fast), repeated, with a longer budget; "
        "writes one JSON with all epochs, the machine and package versions, and medians.",
    )
    _add_race_options(p, budget=1200.0, recipes=("baseline", "monai_tutorial", "fast"))
    p.add_argument("--repeats", type=int, default=1, help="repeats with different seeds for weights and crops (default %(default)s)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the result JSON (default %(default)s)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "tune",
        help="pick fast's batch size, sliding-window batch, validation device and precision by measured throughput",
        description="Search the training batch size (volumes per batch), the sliding-window batch size and where the "
        "validation output is stitched (GPU or CPU), and optionally fp32 against mixed precision and where the "
        "training cache goes (--place-cache), for the fast recipe's UNet on this device. Each candidate runs real "
        "iterations after a warm-up and is scored by patches/s (training) or volumes/s (validation) within a memory "
        "budget (cap minus margin). Out-of-memory candidates are recorded as infeasible and the search goes on. "
        "A range no longer than --trials is tried value by value; a longer one by doubling from the low end until a "
        "candidate does not fit or two doublings in a row gain under 5 %, then bisecting. The three best are then measured "
        "again in a short race. Results are cached per device, memory, model, patch and volume size; "
        "'monai-fast demo --tune' applies them.",
    )
    _add_data_options(p)
    _add_model_options(p, race=False)
    _add_tuning_options(p, race=False)
    p.add_argument("--out", help="also write the result (with every trial) to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser(
        "launch",
        help="run a training script on N local processes through torchrun (DDP: gloo on CPU, NCCL on GPUs)",
        description="Start SCRIPT N times on this machine with torchrun (--standalone rendezvous on a free port, no "
        "restarts) so a script that calls monai_fast.distributed.run(train) trains with DDP. The same script also "
        "runs unchanged under plain python, torchrun, srun/sbatch and horovodrun. If one process dies, torchrun stops "
        "the others and this command exits non-zero.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes to start (default %(default)s; one per GPU on a GPU machine)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser(
        "sbatch",
        help="write an sbatch script for a training script: ranks per GPU, requeue, USR1 before the time limit",
        description="Print (or --out) an sbatch script that starts COMMAND once per rank with srun: one rank per GPU "
        "(or --tasks-per-node on CPU nodes), requeue on preemption, SIGUSR1 --signal-lead seconds before the end so "
        "a script with monai_fast.handlers.Preemption checkpoints and requeues itself, and a log that survives "
        "restarts. Example: monai-fast sbatch --nodes 2 --gpus-per-node 4 --time 08:00:00 -- python train.py "
        "--checkpoint-dir ckpt",
    )
    p.add_argument("--nodes", type=int, default=1, help="(default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="one rank per GPU; 0 for CPU nodes (default %(default)s)")
    p.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node when --gpus-per-node is 0 (default %(default)s)")
    p.add_argument("--cpus-per-task", type=int, default=8, help="cores per rank for loading and caching (default %(default)s)")
    p.add_argument("--time", default="04:00:00", help="wall-clock limit (default %(default)s)")
    p.add_argument("--signal-lead", type=int, default=120, help="seconds before the limit to send SIGUSR1; 0: none (default %(default)s)")
    p.add_argument("--no-requeue", action="store_true", help="do not let SLURM requeue the job")
    p.add_argument("--job-name", default="monai-fast", help="(default %(default)s)")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--account", help="SLURM account")
    p.add_argument("--mem", help="memory per node, e.g. 64G")
    p.add_argument("--out", help="write the script here instead of printing it")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after '--'")
    p.set_defaults(func=_cmd_sbatch)

    p = sub.add_parser(
        "doctor",
        help="name a run's bottleneck (data-bound, compute-bound, GPU under-filled, balanced) from its record",
        description="Read a run folder's monai-fast record (record.rank*.jsonl, written by RecordHandler + TimeBreakdown, "
        "GPUSampler, ThroughputMonitor) and print the verdict, the numbers behind it and what to change. Writes "
        "report.md with PNG plots into the run folder. Needs only the record: diagnose a cluster run on a laptop.",
    )
    p.add_argument("run_dir", help="a run folder holding record.rank*.jsonl (for the demo: runs/demo-*/<recipe>)")
    p.add_argument("--data-threshold", type=float, default=0.2, help="data-wait share that makes a run data-bound (default %(default)s)")
    p.add_argument("--util-low", type=float, default=60.0, help="mean GPU utilisation %% below which a GPU counts as idle (default %(default)s)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("synth", help="write a synthetic data set in Medical Segmentation Decathlon layout",
                       description="Write imagesTr/, labelsTr/ and dataset.json like an MSD task.")
    p.add_argument("out", help="output folder")
    p.add_argument("--kind", choices=("spleen-like", "brats-like"), default="spleen-like", help="(default %(default)s)")
    p.add_argument("--cases", type=int, default=16, help="(default %(default)s)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), metavar=("X", "Y", "Z"), help="(default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_synth)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``monai-fast`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("ignite").setLevel(logging.WARNING)
    for name in ("cases", "repeats"):
        if getattr(args, name, 1) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    if getattr(args, "time_budget", 1) <= 0:
        raise SystemExit("--time-budget must be > 0")
    from monai_fast.data.msd import MSDDataError

    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, MSDDataError) as e:  # bad input: one clear line, no traceback
        raise SystemExit(f"monai-fast {args.command}: {e}") from e


if __name__ == "__main__":
    sys.exit(main())
