"""``monai-fast launch | sbatch | k8s | doctor | synth``: parse, call the library, print."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from monai_fast.apps.cli import add_options

if TYPE_CHECKING:
    from monai_fast.apps.launch.torchrun import LaunchSpec

__all__ = ["add_tool_commands"]

logger = logging.getLogger("monai_fast")


def _launch_spec(args: argparse.Namespace) -> LaunchSpec:
    """The launch options checked together: every bad one named in one line, before anything starts."""
    from monai_fast.apps.launch.torchrun import LaunchSpec

    if getattr(args, "module", False):
        from monai_fast.extras import available

        problems = [] if available(args.script) else [f"module {args.script} not found (-m)"]
    else:
        problems = [] if Path(args.script).is_file() else [f"script {args.script} not found"]
    if args.grace_s < 0:
        problems.append(f"--grace-s must be >= 0, got {args.grace_s}")
    spec = None
    try:
        spec = LaunchSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LaunchSpec)})
    except ValueError as e:
        problems.insert(0, str(e))
    if problems or spec is None:
        raise SystemExit("monai-fast launch: " + "; ".join(problems))
    return spec


def _cmd_launch(args: argparse.Namespace) -> int:
    import math
    import os
    import tempfile

    from monai_fast.apps.launch import torchrun
    from monai_fast.apps.launch.launched import STOPPED_DIR
    from monai_fast.apps.launch.supervise import NoRankStarted, supervise
    from monai_fast.distributed.env import LAUNCHED_BY
    from monai_fast.handlers.preemption import STOPPED_EXIT

    spec = _launch_spec(args)
    # each rank runs the script through monai_fast.apps.launch.launched, which stops a second spawn
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun.torchrun_args(spec)]
    cmd += ["-m", "monai_fast.apps.launch.launched", *(["-m"] if args.module else []), args.script, *args.script_args]
    shutdown = str(math.ceil(args.grace_s))  # torchrun's own shutdown wait
    env = {**os.environ, LAUNCHED_BY: str(args.nproc), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": shutdown}
    env.update(torchrun.torchrun_env(spec))
    logger.info("running %s", " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="monai-fast-launch-") as tmp:
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(tmp, "torchrun-error.json")  # torchrun's own (ranks get theirs)
        env[STOPPED_DIR] = tmp  # where ranks stopped by a signal say so
        if wait_line := torchrun.rendezvous_wait_line(spec):
            logger.info("%s", wait_line)
        if held := torchrun.unanswered_endpoint_message(spec):
            raise SystemExit(f"monai-fast launch: {held}")
        try:
            status = supervise(cmd, grace_s=args.grace_s, env=env, start_timeout_s=spec.rdzv_timeout_s)
        except NoRankStarted:
            raise SystemExit(f"monai-fast launch: {torchrun.rendezvous_timeout_message(spec)}") from None
        why = torchrun.rendezvous_failure(env["TORCHELASTIC_ERROR_FILE"], spec) if status else None
        stopped = len(list(Path(tmp).glob("stopped.*")))
    if status and stopped == args.nproc:  # torchrun reports a failure; every rank checkpointed and stopped
        print(f"monai-fast launch: the {stopped} ranks stopped for a signal (exit {STOPPED_EXIT})", file=sys.stderr)
        return STOPPED_EXIT
    if why:
        logger.error("monai-fast launch: %s", why)
    return status


def _write_job(args: argparse.Namespace, spec_type: type, words: list[str], render, command: str, submit: str) -> int:
    """Build ``spec_type`` from the options named as its fields and the command ``words`` (less a leading ``--``),
    then print what ``render`` makes of it or write it atomically to ``--out``."""
    from monai_fast.files import write_text

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(spec_type)[1:] if hasattr(args, f.name)}
    try:
        spec = spec_type(words[1:] if words[:1] == ["--"] else list(words), **options)
    except ValueError as e:
        raise SystemExit(f"monai-fast {command}: {e}") from e
    if args.out:
        write_text(render(spec), args.out)
        print(f"wrote {args.out}; submit with: {submit} {args.out}")
    else:
        print(render(spec), end="")
    return 0


def _cmd_sbatch(args: argparse.Namespace) -> int:
    from monai_fast.apps.launch.jobs import SbatchSpec, render_sbatch

    return _write_job(args, SbatchSpec, args.command, render_sbatch, "sbatch", "sbatch")


def _cmd_k8s(args: argparse.Namespace) -> int:
    from monai_fast.apps.launch.jobs import PyTorchJobSpec, render_pytorchjob

    return _write_job(args, PyTorchJobSpec, args.script, render_pytorchjob, "k8s", "kubectl apply -f")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from monai_fast.report.doctor import doctor

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise SystemExit(f"monai-fast doctor: {run_dir}: no such folder")
    try:
        diagnosis = doctor(run_dir, data_threshold=args.data_threshold, util_low=args.util_low)
    except FileNotFoundError as e:
        below = sorted({p.parent.name for p in run_dir.glob("*/record.rank*.jsonl")})
        if below:  # a demo's or a race's folder: one record per recipe, in its own folder
            raise SystemExit(
                f"monai-fast doctor: {run_dir} holds no record itself; its runs' records are in "
                + ", ".join(below)
                + f": monai-fast doctor {run_dir / below[0]}"
            ) from e
        raise SystemExit(
            f"monai-fast doctor: {e}: FastTraining().attach(trainer, evaluator) alone writes none; for a record, "
            f"attach RecordHandler('{run_dir}') and TimeBreakdown() to the trainer (and the same RecordHandler to "
            "the evaluator) before FastTraining; monai-fast train and demo write one in <run folder>/<recipe>"
        ) from e
    except ValueError as e:
        raise SystemExit(f"{args.run_dir}: {e}") from e
    print(diagnosis.text())
    print(f"\nreport: {diagnosis.report}" if diagnosis.report else "\nreport: not written (see the warning above)")
    if args.apply:
        from monai_fast.report.doctor import prescribe
        from monai_fast.telemetry.record import load_record

        print("\nto apply (add before trainer.run()):\n" + prescribe(load_record(args.run_dir)[0], diagnosis))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from monai_fast.apps.sources.synthetic import generate_msd
    from monai_fast.apps.sources.wsi import generate_wsi

    wsi = args.kind == "wsi"
    shape = args.shape or ((4096, 4096) if wsi else (128, 128, 64))
    if len(shape) != (2 if wsi else 3):
        raise SystemExit(
            f"monai-fast synth: --shape: --kind {args.kind} takes "
            f"{'2 sizes (rows columns)' if wsi else '3 sizes (X Y Z)'}, got {len(shape)}"
        )
    cases = args.cases if args.cases is not None else (4 if wsi else 16)
    common = {"seed": args.seed, "progress": not args.no_progress}
    try:
        if wsi:
            tiles = {"tile": args.tile, "levels": args.levels, "patch_size": args.patch}
            root = generate_wsi(args.out, num_slides=cases, size=shape, **tiles, **common)
        else:
            root = generate_msd(args.out, kind=args.kind, num_cases=cases, shape=shape, **common)
    except ValueError as e:  # a bad size, named by the generator
        raise SystemExit(f"monai-fast synth: {e}") from e
    print(
        f"wrote {cases} {args.kind} "
        f"{'slides (pyramidal TIFF, masks, patches.csv, dataset.json)' if wsi else 'cases in MSD layout'} to {root}"
    )
    return 0


_LAUNCH_TEXT = (
    "Start SCRIPT --nproc times on this machine with torchrun so a script that calls monai_fast.apps.launch.run(train) "
    "trains with DDP (docs/distributed.md). One node: a --standalone rendezvous on a free port. Several nodes without "
    "SLURM: run the same command on each node with --nnodes N and either --master-addr HOST --master-port P "
    "--node-rank I (static: node 0 is HOST) or --rdzv-endpoint HOST:PORT --rdzv-id JOB (c10d: torchrun numbers the "
    "nodes). Every option is checked before anything starts; it says where it waits for the other nodes, and stops "
    "with one line naming that endpoint when no rendezvous forms within --rdzv-timeout seconds. If a rank dies, "
    "torchrun stops the others on its node; with --max-restarts K it starts all ranks again (a script with "
    "monai_fast.handlers.Preemption resumes from its latest checkpoint), else this command exits non-zero. SIGTERM, "
    "SIGINT and SIGUSR1 are passed on to every rank of this node, which get --grace-s to checkpoint and stop; it exits "
    "with the job's status (128+N for a death by signal N). A script that spawns its own processes "
    "(idist.Parallel(nproc_per_node=N)) is stopped with a message to drop nproc_per_node."
)
_LAUNCH_HELP = (
    "run a training script on N processes per node through torchrun, on one node or several (DDP: gloo on CPU, NCCL on "
    "GPUs)"
)
_SBATCH_TEXT = (
    "Print (or --out) an sbatch script that starts COMMAND once per rank with srun: one rank per GPU (or "
    "--tasks-per-node on CPU nodes), requeue on preemption, SIGUSR1 --signal-lead seconds before the end so a script "
    "with monai_fast.handlers.Preemption checkpoints and requeues itself, and a log that survives restarts. Example: "
    "monai-fast sbatch --nodes 2 --gpus-per-node 4 --time 08:00:00 -- python train.py --checkpoint-dir ckpt"
)
_SBATCH_HELP = "write an sbatch script for a training script: ranks per GPU, requeue, USR1 before the time limit"
_SBATCH_OPTIONS = (
    ("--job-name", None, "monai-fast", "(default %(default)s)"),
    ("--partition", None, None, "SLURM partition"),
    ("--account", None, None, "SLURM account"),
    ("--mem", None, None, "memory per node, e.g. 64G"),
    ("--out", None, None, "write the script here instead of printing it"),
)

_LAUNCH_OPTIONS = (
    ("--nproc", int, 2, "processes to start (default %(default)s; one per GPU on a GPU machine)"),
    ("--nnodes", int, 1, "nodes in the job; run this command on each (default %(default)s)"),
    ("--node-rank", int, None, "static rendezvous: this node's index, 0 to NNODES-1 (0 on --master-addr)"),
    ("--master-addr", None, None, "static rendezvous: node 0's address, reachable from every node"),
    ("--master-port", int, None, "static rendezvous: a free port on node 0 (default 29500, torchrun's)"),
    ("--rdzv-endpoint", None, None, "c10d rendezvous: HOST:PORT every node reaches (instead of --master-addr)"),
    ("--rdzv-id", None, None, "c10d rendezvous: the job's name, the same on every node"),
)


def _add_job_shape(p: argparse.ArgumentParser, nodes: int, cpu_ranks_flag: str, nodes_help: str) -> None:
    """Nodes and ranks per node, the same for every job writer (sbatch, k8s); ``nodes_help``: what a node is."""
    add_options(
        p,
        (
            ("--nodes", int, nodes, f"{nodes_help} (default %(default)s)"),
            ("--gpus-per-node", int, 1, "one rank per GPU; 0 for CPU nodes (default %(default)s)"),
            (cpu_ranks_flag, int, 1, "ranks per node when --gpus-per-node is 0 (default %(default)s)"),
        ),
    )


_K8S_TEXT = (
    "Print (or --out) a Kubernetes PyTorchJob (Kubeflow training operator) that runs SCRIPT on --nodes pods with "
    "monai-fast launch: one rank per GPU (or --procs-per-node on CPU pods). On an eviction the ranks get SIGTERM and "
    "--grace-s to checkpoint; a failed or evicted pod restarts (at most --backoff-limit times) and the job resumes "
    "from the checkpoints on --volume-claim. Example: monai-fast k8s --image me/monai-fast:1 --nodes 2 "
    "--gpus-per-node 4 --volume-claim runs -- train.py --checkpoint-dir /workspace/run/ckpt"
)
_K8S_HELP = "write a Kubernetes PyTorchJob manifest for a training script: pods per node, GPUs, SIGTERM grace"
_K8S_OPTIONS = (
    ("--cpus-per-node", int, 8, "CPU cores per pod (default %(default)s)"),
    ("--memory", None, None, "memory per pod, e.g. 64Gi"),
    ("--job-name", None, "monai-fast", "(default %(default)s)"),
    ("--namespace", None, None, "Kubernetes namespace (default: kubectl's current one)"),
    ("--grace-s", int, 120, "seconds the ranks get to checkpoint after SIGTERM (default %(default)s)"),
    ("--backoff-limit", int, 3, "pod restarts before the job fails (default %(default)s)"),
    ("--volume-claim", None, None, "PersistentVolumeClaim (ReadWriteMany) for data, checkpoints and records"),
    ("--mount-path", None, "/workspace/run", "where --volume-claim is mounted (default %(default)s)"),
    ("--out", None, None, "write the manifest here instead of printing it"),
)


_DOCTOR_HELP = "name a run's bottleneck (data-bound, compute-bound, GPU under-filled, balanced) from its record"
_DOCTOR_TEXT = (
    "Read a run folder's monai-fast record (record.rank*.jsonl, written by RecordHandler + TimeBreakdown, GPUSampler, "
    "ThroughputMonitor) and print the verdict, the numbers behind it and what to change. Writes report.md with PNG "
    "plots (the plots extra) into the run folder. Needs only the record: diagnose a cluster run on a laptop."
)
_DOCTOR_OPTIONS = (
    ("--data-threshold", float, 0.2, "data-wait share that makes a run data-bound (default %(default)s)"),
    ("--util-low", float, 60.0, "mean GPU utilisation %% below which a GPU counts as idle (default %(default)s)"),
)
_SYNTH_HELP = "write a synthetic data set: MSD layout (3D) or Camelyon-like whole-slide images (--kind wsi)"
_SYNTH_TEXT = (
    "Write imagesTr/, labelsTr/ and dataset.json like an MSD task; or, with --kind wsi, pyramidal tiled TIFF slides "
    "with tumour regions, their tissue and tumour masks, patches.csv and a dataset.json of patch locations and labels "
    "for MONAI's PatchWSIDataset."
)
_SYNTH_SHAPE = "volume size X Y Z (default 128 128 64); wsi: level-0 rows columns (default 4096 4096)"
_SYNTH_OPTIONS = (
    ("--kind", None, "spleen-like", "(default %(default)s)", {"choices": ("spleen-like", "brats-like", "wsi")}),
    ("--cases", int, None, "cases, or slides for wsi (default 16; wsi: 4)"),
    ("--shape", int, None, _SYNTH_SHAPE, {"nargs": "+", "metavar": "N"}),
    ("--tile", int, 256, "wsi: TIFF tile size (default %(default)s)"),
    ("--levels", int, 3, "wsi: pyramid levels (default %(default)s)"),
    ("--patch", int, 96, "wsi: patch size of the patch grid (default %(default)s)"),
    ("--seed", int, 0, "(default %(default)s)"),
)


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``launch``, ``sbatch``, ``k8s``, ``doctor`` and ``synth`` to the sub-command parsers ``sub``."""
    from monai_fast.apps.launch.torchrun import DEFAULT_RDZV_TIMEOUT_S, STORE_ANSWER_S

    p = sub.add_parser("launch", description=_LAUNCH_TEXT, help=_LAUNCH_HELP)
    rdzv = (
        "seconds to wait for the rendezvous (every node met, ranks started) before stopping with one line naming the "
        "endpoint (default %(default)g, torchrun's); an endpoint that accepts connections but does not answer as a "
        f"rendezvous store within {STORE_ANSWER_S:g} s stops the launch at once"
    )
    restarts = "a script with Preemption(save_every=N) resumes from its latest checkpoint (default %(default)s)"
    stop = "on SIGTERM, SIGINT or SIGUSR1 (passed on to every rank), seconds the ranks may take to checkpoint"
    add_options(
        p,
        (
            *_LAUNCH_OPTIONS,
            ("--rdzv-timeout", float, DEFAULT_RDZV_TIMEOUT_S, rdzv, {"dest": "rdzv_timeout_s", "metavar": "S"}),
            ("--max-restarts", int, 0, f"when a rank dies, restart all ranks up to this many times; {restarts}"),
            ("--grace-s", float, 120.0, f"{stop} and stop before they are killed (default %(default)s)"),
        ),
    )
    module = "SCRIPT is a module, run as python -m SCRIPT (e.g. -m monai_fast bundle run BUNDLE_DIR)"
    p.add_argument("-m", "--module", action="store_true", help=module)
    p.add_argument("script", help="the training script (or, with -m, the module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("sbatch", description=_SBATCH_TEXT, help=_SBATCH_HELP)
    _add_job_shape(p, nodes=1, cpu_ranks_flag="--tasks-per-node", nodes_help="nodes to allocate (#SBATCH --nodes)")
    lead = "seconds before the limit to send SIGUSR1; 0: none (default %(default)s)"
    add_options(
        p,
        (
            ("--cpus-per-task", int, 8, "cores per rank for loading and caching (default %(default)s)"),
            ("--time", None, "04:00:00", "wall-clock limit (default %(default)s)"),
            ("--signal-lead", int, 120, lead, {"dest": "signal_lead_s", "metavar": "SIGNAL_LEAD"}),
        ),
    )
    p.add_argument("--no-requeue", dest="requeue", action="store_false", help="do not let SLURM requeue the job")
    add_options(p, _SBATCH_OPTIONS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after '--'")
    p.set_defaults(func=_cmd_sbatch)

    p = sub.add_parser("k8s", description=_K8S_TEXT, help=_K8S_HELP)
    p.add_argument("--image", required=True, help="container image with monai-fast installed")
    _add_job_shape(p, nodes=2, cpu_ranks_flag="--procs-per-node", nodes_help="nodes, one pod each")
    add_options(p, _K8S_OPTIONS)
    script = "the training script (in the image) and its arguments, after '--'"
    p.add_argument("script", nargs=argparse.REMAINDER, help=script)
    p.set_defaults(func=_cmd_k8s)

    p = sub.add_parser("doctor", help=_DOCTOR_HELP, description=_DOCTOR_TEXT)
    p.add_argument("run_dir", help="a run folder holding record.rank*.jsonl (for the demo: runs/demo-*/<recipe>)")
    add_options(p, _DOCTOR_OPTIONS)
    apply = "also print the exact FastTraining(...) line for this run, and the code changes it cannot make"
    p.add_argument("--apply", action="store_true", help=apply)
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("synth", help=_SYNTH_HELP, description=_SYNTH_TEXT)
    p.add_argument("out", help="output folder")
    add_options(p, _SYNTH_OPTIONS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_synth)
