"""Tutorial: one training script for one process, torchrun (DDP), srun / sbatch (SLURM) and horovodrun.

The training function below builds monai-fast's ``fast`` recipe (a MONAI ``SupervisedTrainer`` +
``SupervisedEvaluator``) and runs it. ``monai_fast.apps.launch.run`` makes it distributed without
changing it: each rank sets its device and seed, takes its share of the files (so it caches only
that share, as in MONAI's BraTS multi-GPU example), trains a DDP model (gradients averaged over
ranks) and validates its share of the cases; MONAI's Dice metric gathers all ranks' cases, so every
rank reports the same validation Dice. Handlers that print or write run on rank 0 only.

    python tutorials/distributed_train.py --tiny                          # 1 process
    monai-fast launch --nproc 2 tutorials/distributed_train.py --tiny     # 2 local processes (torchrun)
    # on each of 2 nodes:
    monai-fast launch --nnodes 2 --node-rank I --master-addr NODE0 --nproc 4 tutorials/distributed_train.py
    torchrun --nproc-per-node 4 tutorials/distributed_train.py            # 4 GPUs: NCCL
    srun -n 2 python tutorials/distributed_train.py --tiny                # SLURM (also inside sbatch)
    horovodrun -np 2 --gloo python tutorials/distributed_train.py --tiny  # Horovod

Each rank writes ``rank<R>.json`` into ``--out`` (its device, its share, final validation Dice and
a hash of its final weights), so you can check that the ranks agree; ``--save-weights`` also writes
the final weights (``weights_rank<R>.pt``, a CPU state dict) for comparisons within a tolerance,
as on a GPU, where cuDNN is not bit-exact.

With ``--checkpoint-dir`` the run is preemption-safe (``monai_fast.handlers.Preemption``): on
SIGTERM or SIGUSR1 it finishes the iteration, checkpoints, requeues itself under SLURM and stops;
started again (or requeued), it resumes at the next iteration. Started again after it finished,
it trains nothing (raise ``--max-epochs`` to continue from the last checkpoint)::

    sbatch --requeue --signal=USR1@120 --wrap "srun python tutorials/distributed_train.py --checkpoint-dir ckpt"

(``--signal=USR1@120`` without ``B:``: SLURM sends it to the ``srun`` tasks, the training processes;
``B:`` would signal only the batch shell, which does not pass it on. ``monai-fast sbatch`` writes
the same flag.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from ignite import distributed as idist
from ignite.engine import Events
from monai.handlers import StatsHandler

from monai_fast.apps.launch import run
from monai_fast.apps.recipes import RecipeConfig, build_recipe
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.distributed import detect
from monai_fast.handlers import Preemption, RecordHandler, TimeBreakdown
from monai_fast.handlers.preemption import catch_stop_signals, end_of_setup


def weights_digest(network: torch.nn.Module) -> str:
    """SHA-1 of all parameters' bytes: equal on every rank when DDP keeps them in sync."""
    h = hashlib.sha1()
    for p in getattr(network, "module", network).parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(local_rank: int, args: argparse.Namespace) -> None:
    catch_stop_signals()  # first: SIGTERM/SIGUSR1 while data are written and cached are kept for the run's start
    rank = idist.get_rank()
    data_dir = Path(args.data_dir) if args.data_dir else Path(args.out) / "data"
    if not args.data_dir:
        if rank == 0 and not (data_dir / "dataset.json").exists():
            shape = (48, 48, 32) if args.tiny else (128, 128, 64)
            generate_msd(data_dir, num_cases=6 if args.tiny else 16, shape=shape, progress=False)
        idist.barrier()  # the others wait until rank 0 has written the data
    train_files, val_files = load_msd_datalist(data_dir, val_fraction=0.34 if args.tiny else 0.25)
    config = RecipeConfig(
        patch_size=(32, 32, 32) if args.tiny else (64, 64, 64),
        num_samples=2 if args.tiny else 4,
        max_epochs=args.max_epochs,
        batch_size=args.batch_size,
        cache_threads=1 if args.tiny else None,
        precision="fp32" if args.fp32 else "auto",
    )
    recipe = build_recipe(args.recipe, train_files, val_files, config, idist.device(), progress=False)
    if args.run_dir:  # every rank writes its record (record.rank<R>.jsonl) for `monai-fast doctor RUN_DIR`
        record = RecordHandler(args.run_dir)
        record.attach(recipe.trainer)
        record.attach(recipe.evaluator)
    TimeBreakdown().attach(recipe.trainer)  # every rank: its own data-wait share
    preemption = None
    if args.checkpoint_dir:
        preemption = Preemption(
            {"trainer": recipe.trainer, "model": recipe.network, "optimizer": recipe.optimizer},
            args.checkpoint_dir,
            save_every=args.save_every,
        )
        preemption.attach(recipe.trainer)  # takes over a signal caught during set-up: the run stops at its start
        preemption.resume()  # no-op on the first start
    else:
        end_of_setup()  # no checkpoint folder: a signal during set-up stops here, with a message (exit 143)
    if args.progress_file and rank == 0:
        progress = Path(args.progress_file)

        @recipe.trainer.on(Events.ITERATION_COMPLETED)
        def _progress(engine) -> None:  # one line per completed iteration, for monitoring (and the tests)
            with progress.open("a") as f:
                f.write(f"{engine.state.iteration}\n")

    if rank == 0:  # printing handlers on one rank only
        StatsHandler(name="train", output_transform=lambda out: None, iteration_log=False).attach(recipe.trainer)
        StatsHandler(name="val", output_transform=lambda out: None, iteration_log=False).attach(recipe.evaluator)
    recipe.trainer.run()
    if preemption is not None:
        preemption.exit_if_preempted()  # checkpointed (and requeued under SLURM): nothing more to do now
    result = {
        "rank": rank,
        "world_size": idist.get_world_size(),
        "backend": idist.backend(),
        "device": str(idist.device()),
        "launcher": detect().launcher,
        "train_items": len(recipe.train_loader.dataset),
        "val_items": len(recipe.val_loader.dataset),
        "iterations": recipe.trainer.state.iteration,
        "resumed_from": preemption.resumed_from if preemption is not None else None,
        "val_mean_dice": recipe.evaluator.state.metrics.get("val_mean_dice"),
        "weights_sha1": weights_digest(recipe.network),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.save_weights:
        state = {k: v.detach().cpu() for k, v in getattr(recipe.network, "module", recipe.network).state_dict().items()}
        torch.save(state, Path(args.out) / f"weights_rank{rank}.pt")
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    logging.getLogger("tutorial").info("rank %d: %s", rank, result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="MSD folder with dataset.json; default: a synthetic set written into --out")
    p.add_argument(
        "--out", default=os.path.join(tempfile.gettempdir(), "monai-fast-distributed"), help="where rank<R>.json go"
    )
    p.add_argument("--recipe", default="fast", choices=("fast", "monai_tutorial", "baseline"))
    p.add_argument("--max-epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2, help="volumes per batch and rank")
    p.add_argument("--nproc", type=int, help="spawn this many local processes here (instead of a launcher)")
    p.add_argument("--tiny", action="store_true", help="tiny data and patches: a smoke test in seconds")
    p.add_argument("--fp32", action="store_true", help="no mixed precision (bit-reproducible runs on a CPU)")
    p.add_argument("--checkpoint-dir", help="make the run preemption-safe, checkpointing here (and resume from here)")
    p.add_argument("--save-every", type=int, help="with --checkpoint-dir: also checkpoint every N iterations")
    p.add_argument("--run-dir", help="write each rank's run record here (read it with: monai-fast doctor RUN_DIR)")
    p.add_argument("--progress-file", help="rank 0 appends each completed iteration number to this file")
    p.add_argument(
        "--save-weights", action="store_true", help="also write each rank's final weights (weights_rank<R>.pt)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    run(train, args, nproc_per_node=args.nproc)


if __name__ == "__main__":
    main()
