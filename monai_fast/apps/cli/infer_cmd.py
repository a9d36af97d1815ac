"""``monai-fast infer``: sliding-window inference of a checkpoint over an MSD folder or image files.

Parses, calls `monai_fast.apps.inference.infer()`, prints one line; a bad input or an unwritable output ends
in one line naming it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_infer_command"]

_TEXT = (
    "Run sliding-window inference of CHECKPOINT (written by monai_fast.apps.inference.save_checkpoint or monai-fast "
    "train) over DATA, an MSD folder (its --split) or NIfTI image files, and write OUT/<name>_seg.nii.gz label maps "
    "on each input's grid: the checkpoint's validation chain is inverted (docs/inference.md). A checkpoint of weights "
    "only needs --recipe-config. Every image and output path is checked first (none may exist without --overwrite). "
    "Backends: eager (fp32), autocast (bf16 on a CPU with bf16 hardware, fp16 on CUDA), compile (torch.compile), onnx "
    '(ONNX Runtime; pip install "monai-fast[onnx]"), tensorrt (torch-tensorrt and a CUDA GPU).'
)

_OPTION_HELP = {
    "--split": "an MSD folder's cases: the validation split of training (same --val-fraction and the checkpoint's "
    "seed), train, all, or the test images (default %(default)s)",
    "--sw-batch-size": "windows per network call, or 'auto' to measure it (and the stitching device) on the first "
    "image's size, cached in the tuning store (default: the checkpoint's config)",
    "--recipe-config": "the RecipeConfig the network was trained with, for a checkpoint that holds weights only (a "
    "MONAI CheckpointSaver or Preemption file): the recipe.json monai-fast train writes beside model.pth, or a JSON "
    "object of RecipeConfig options; it builds the network and its validation chain",
}
_HELP = "sliding-window inference of a checkpoint into NIfTI predictions (eager, autocast, compile, onnx, tensorrt)"


def _sw_batch(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or 'auto', got {value}")
    return value


def _cmd_infer(args: argparse.Namespace) -> int:
    from monai_fast.apps.inference import InferenceError, infer
    from monai_fast.apps.inference.checkpoint import read_recipe_config
    from monai_fast.apps.training.options import check_writable_dir, resolve_device
    from monai_fast.files import NoSpaceError

    device = resolve_device(args.device)
    data = args.data[0] if len(args.data) == 1 else args.data
    try:
        config = read_recipe_config(args.recipe_config) if args.recipe_config else None
        out = check_writable_dir(args.out, "out")
        result = infer(
            args.checkpoint,
            data,
            out,
            backend=args.backend,
            device=device,
            split=args.split,
            val_fraction=args.val_fraction,
            sw_batch_size=args.sw_batch_size,
            overlap=args.overlap,
            preflight=not args.no_preflight,
            progress=not args.no_progress,
            config=config,
            overwrite=args.overwrite,
        )
    except (InferenceError, NoSpaceError) as e:
        raise SystemExit(f"monai-fast infer: {e}") from e
    print(
        f"wrote {len(result.outputs)} predictions to {out} (backend {result.backend}: {result.detail} on "
        f"{result.device}; {result.volumes_per_s:.2f} volumes/s of inference, backend built in "
        f"{result.prepare_s:.1f} s)"
    )
    return 0


def add_infer_command(sub: argparse._SubParsersAction) -> None:
    """Add ``infer`` to the sub-command parsers ``sub``."""
    from monai_fast.apps.inference.backends import BACKENDS
    from monai_fast.apps.inference.run import SPLITS

    p = sub.add_parser("infer", description=_TEXT, help=_HELP)
    p.add_argument("checkpoint", help="the model file (monai_fast.apps.inference.save_checkpoint)")
    p.add_argument("data", nargs="+", help="an MSD folder with dataset.json, or NIfTI image files")
    p.add_argument("--out", default="predictions", help="folder for <name>_seg.nii.gz (default %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="eager", help="what runs the network (default %(default)s)")
    device = "'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:1' (default %(default)s)"
    p.add_argument("--device", default="auto", help=device)
    p.add_argument("--split", choices=SPLITS, default="val", help=_OPTION_HELP["--split"])
    p.add_argument("--val-fraction", type=float, default=0.25, help="as in training (default %(default)s)")
    p.add_argument("--sw-batch-size", type=_sw_batch, help=_OPTION_HELP["--sw-batch-size"])
    p.add_argument("--overlap", type=float, help="sliding-window overlap in [0, 1) (default: the checkpoint's config)")
    p.add_argument("--recipe-config", metavar="FILE", help=_OPTION_HELP["--recipe-config"])
    overwrite = "replace prediction files that exist already (an input image is never replaced)"
    p.add_argument("--overwrite", action="store_true", help=overwrite)
    p.add_argument("--no-preflight", action="store_true", help="skip the check of every image before inference")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (a log line per volume instead)")
    p.set_defaults(func=_cmd_infer)
