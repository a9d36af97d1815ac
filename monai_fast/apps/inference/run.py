"""Sliding-window inference of a trained checkpoint over a data list, predictions as NIfTI (docs/inference.md)."""

from __future__ import annotations

import gzip
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from monai.data import DataLoader, Dataset, NibabelWriter, decollate_batch
from monai.data.utils import to_affine_nd
from monai.inferers import SlidingWindowInferer
from monai.transforms import AsDiscreted, Compose, Invertd
from monai.utils import convert_data_type

from monai_fast.apps.inference.backends import build_predictor, precision_of, require
from monai_fast.apps.inference.checkpoint import ChainError, CheckpointError, InferenceError, build_chain, load_model
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.transforms import recipe_chain
from monai_fast.data.items import NamedItemsCompose
from monai_fast.data.preflight import PreflightError, scan_file
from monai_fast.files import ensure_free_space, write_bytes
from monai_fast.handlers.prediction_layout import argmax_gain, classes_innermost
from monai_fast.openmp import main_thread_core, on_core
from monai_fast.progress import progress_bar, show_progress
from monai_fast.telemetry import synchronize

__all__ = [
    "SPLITS",
    "InferenceResult",
    "check_images",
    "data_list",
    "infer",
    "inference_transforms",
    "output_name",
    "tuned_window",
]

logger = logging.getLogger(__name__)

#: what an MSD folder's cases are inferred: the validation split of training, the training split, both, or imagesTs
SPLITS = ("val", "train", "all", "test")


@dataclass
class InferenceResult:
    """What `infer()` did.

    Attributes:
        backend, detail: the backend and what ran (``"bf16 autocast"``...).
        device: where the network ran.
        inputs, outputs: each image and its prediction file, in order.
        seconds: per volume, sliding-window inference (network and stitching) in seconds.
        prepare_s: building the backend (compilation, export).
        total_s: the whole call.
    """

    backend: str
    detail: str
    device: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    prepare_s: float = 0.0
    total_s: float = 0.0

    @property
    def volumes_per_s(self) -> float:
        """Volumes per second of sliding-window inference (loading and writing left out)."""
        return len(self.seconds) / sum(self.seconds) if self.seconds and sum(self.seconds) > 0 else 0.0


def data_list(
    data: str | os.PathLike | Sequence, split: str = "val", val_fraction: float = 0.25, seed: int = 0
) -> list[str]:
    """The image files of ``data``: an MSD folder's ``split`` (see `SPLITS`), one image file, or a list of them.

    The ``val`` split is `load_msd_datalist()`'s with the same ``val_fraction`` and ``seed``.
    """
    from monai_fast.apps.sources.remote_io import is_url

    if url := next((d for d in ([data] if isinstance(data, (str, os.PathLike)) else data) if is_url(d)), None):
        raise InferenceError(f"{url}: infer reads local files; copy the images to this machine first")
    if isinstance(data, (str, os.PathLike)):
        root = Path(data)
        if not root.is_dir():
            return [str(root)]
        from monai_fast.apps.sources.msd import load_msd_datalist, read_dataset_json

        if split not in SPLITS:
            raise InferenceError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        if split == "test":
            tests = read_dataset_json(root).get("test") or []
            if not tests:
                raise InferenceError(f"{root / 'dataset.json'} lists no test images; use split 'val', 'train' or 'all'")
            return [str((root / (t["image"] if isinstance(t, dict) else t)).resolve()) for t in tests]
        train, val = load_msd_datalist(root, val_fraction=val_fraction, seed=seed)
        chosen = {"val": val, "train": train, "all": train + val}[split]
        return [d["image"] for d in chosen]
    return [str(d["image"]) if isinstance(d, dict) else str(d) for d in data]


def check_images(paths: Sequence[str]) -> None:
    """Every image readable, 3D and finite (`scan_file()`), else one error naming each.

    Raises:
        PreflightError: listing ``(path, reason)`` for every bad image.
    """
    problems = []
    for path in paths:
        if not os.path.isfile(path):
            problems.append((path, "no such file"))
            continue
        scan = scan_file(path)
        if "error" in scan:
            problems.append((path, f"cannot read the image: {scan['error']}"))
        elif len(scan["shape"]) < 3 or min(scan["shape"][:3]) < 2:
            problems.append((path, f"image is not a 3D volume (shape {tuple(scan['shape'])})"))
        elif not scan["finite"]:
            problems.append((path, "image has NaN or Inf values"))
    if problems:
        raise PreflightError(problems, len(paths))


def output_name(image: str | os.PathLike) -> str:
    """The prediction's file name for ``image``, without the extension: ``case_1.nii.gz`` -> ``case_1_seg``."""
    name = Path(image).name
    return (name.removesuffix(".nii.gz") if name.endswith(".nii.gz") else Path(name).stem) + "_seg"


def inference_transforms(config: RecipeConfig, chain: Sequence[dict] | None = None) -> Compose:
    """The preprocessing of an ``{"image": path}`` item, invertible by ``Invertd``: ``chain`` (a validation chain
    record), by default the recipes' validation chain for ``config``."""
    return build_chain(chain if chain is not None else recipe_chain(config))


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _outputs(paths: Sequence[str], out_dir: Path, overwrite: bool = False) -> list[Path]:
    """Each image's prediction path, checked first: no clash, no input replaced, no file unless ``overwrite``."""
    inputs = {os.path.realpath(p): p for p in paths}
    inodes = {ident: p for p in paths if (ident := _identity(p)) is not None}
    outs, seen, existing = [], {}, []
    for p in paths:
        out = out_dir / (output_name(p) + ".nii.gz")
        if out in seen:
            raise InferenceError(f"{seen[out]} and {p} would both be written to {out}: give images distinct file names")
        seen[out] = p
        clash = inputs.get(os.path.realpath(out)) or inodes.get(_identity(out))  # the same file by another path
        if clash is not None:
            raise InferenceError(
                f"the prediction of {p} would be written to {out}, which is the input image {clash}: "
                "choose an output folder that holds none of the inputs"
            )
        if out.exists() or out.is_symlink():
            existing.append(out)
        outs.append(out)
    if existing and not overwrite:
        shown = ", ".join(map(str, existing[:3])) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise InferenceError(
            f"{len(existing)} prediction file(s) exist already: {shown}; pass --overwrite "
            "(overwrite=True) to replace them, or choose another output folder"
        )
    return outs


def infer(
    model: str | os.PathLike | torch.nn.Module,
    data: str | os.PathLike | Sequence,
    out_dir: str | os.PathLike,
    backend: str = "eager",
    *,
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    split: str = "val",
    val_fraction: float = 0.25,
    sw_batch_size: int | str | None = None,
    overlap: float | None = None,
    preflight: bool = True,
    progress: bool = True,
    tune_store: str | os.PathLike | None = "default",
    sw_batch_range: tuple[int, int] = (1, 32),
    overwrite: bool = False,
    chain: Sequence[dict] | None = None,
) -> InferenceResult:
    """Run sliding-window inference of ``model`` over ``data`` and write one NIfTI prediction per image.

    Args:
        model: an inference checkpoint (`save_checkpoint()`), or a network (then ``config`` is needed).
        data: an MSD folder (its ``split``), an image file, or a list of image files / ``{"image": path}``.
        out_dir: where ``<name>_seg.nii.gz`` files go (created).
        backend, device: one of `BACKENDS`; where the network runs.
        config: the network's `RecipeConfig`; default the checkpoint's (window and sliding-window defaults).
        split, val_fraction: which of an MSD folder's cases (`data_list()`).
        sw_batch_size, overlap: override the config's; ``"auto"`` measures the batch (`tuned_window()`).
        tune_store, sw_batch_range: where ``"auto"`` keeps its measurement; the range it searches.
        preflight, progress: check every image first; a progress bar where one fits, else a log line per volume.
        overwrite: replace prediction files that exist already (an input is never replaced).
        chain: for a network, the chain record it was validated with; a checkpoint brings its own.

    Raises:
        CheckpointError: the checkpoint, named, before any volume is read.
        BackendUnavailable: the backend cannot run here; names what is missing.
        PreflightError: every bad image with its reason.
        InferenceError: a bad option, clashing output names, an output that is an input or exists.
        NoSpaceError: the output's file system is full (named); no prediction is half-written.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    require(backend, device)
    if isinstance(model, torch.nn.Module):
        if config is None:
            raise InferenceError(
                "infer(network, ...) needs config=RecipeConfig(...) of the network (patch size, spacing)"
            )
        network, source = model, "chain="
        chain = list(chain) if chain is not None else recipe_chain(config)
    else:
        loaded = load_model(model, config=config)  # on the CPU; build_predictor moves it
        network, config, chain, source = loaded.network, loaded.config, loaded.chain, f"checkpoint {model}"
    try:
        pre = inference_transforms(config, chain)
    except ChainError as e:
        raise CheckpointError(f"the validation chain of {source} cannot be rebuilt: {e}") from e
    auto = sw_batch_size == "auto"
    sw_batch_size = config.sw_batch_size if sw_batch_size is None or auto else sw_batch_size
    overlap = config.sw_overlap if overlap is None else overlap
    if not isinstance(sw_batch_size, int) or sw_batch_size < 1 or not 0.0 <= overlap < 1.0:
        raise InferenceError(
            f"sw_batch_size must be an int >= 1 or 'auto', and overlap in [0, 1); got {sw_batch_size!r} and {overlap}"
        )
    paths = data_list(data, split=split, val_fraction=val_fraction, seed=config.seed)
    if not paths:
        raise InferenceError(f"no images to infer in {data}")
    out_dir = Path(out_dir)
    outputs = _outputs(paths, out_dir, overwrite)
    if preflight:
        check_images(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    stitch = torch.device(config.val_device) if config.val_device else device
    if auto:
        sw_batch_size, stitch = tuned_window(
            network, config, paths[0], backend, device, overlap, tune_store, sw_batch_range, pre
        )
    predictor = build_predictor(network, backend, config.patch_size, sw_batch_size, device)
    result = InferenceResult(
        backend, predictor.detail, str(device), list(paths), outputs, prepare_s=predictor.prepare_s
    )
    inferer = SlidingWindowInferer(
        roi_size=config.patch_size, sw_batch_size=sw_batch_size, overlap=overlap, sw_device=device, device=stitch
    )
    plain_s, inner_s = argmax_gain()  # PyTorch's CPU argmax over a dimension that is not innermost (pytorch#140000)
    innermost = [_pred_classes_innermost] if plain_s >= 1.2 * inner_s else []
    post = Compose(
        [
            Invertd(keys="pred", transform=pre, orig_keys="image", nearest_interp=False, to_tensor=True),
            *innermost,
            AsDiscreted(keys="pred", argmax=True),
        ]
    )
    loader = DataLoader(
        Dataset([{"image": p} for p in paths], transform=NamedItemsCompose.of(pre)), batch_size=1, num_workers=0
    )
    bars = show_progress(progress)
    core = main_thread_core()  # with OpenMP's workers pinned, the main thread computes the windows on the free core
    for i, batch in enumerate(
        progress_bar(loader, enabled=progress, desc=f"infer ({backend})", unit="volume", total=len(paths))
    ):
        t = time.perf_counter()
        with torch.no_grad(), on_core(core):
            batch["pred"] = inferer(batch["image"].to(device), predictor)
        synchronize(device)
        result.seconds.append(time.perf_counter() - t)
        item = post(decollate_batch(batch)[0])
        _save(item["pred"], outputs[i])
        if not bars:
            logger.info("infer %d/%d: %s -> %s in %.2f s", i + 1, len(paths), paths[i], outputs[i], result.seconds[-1])
    result.total_s = time.perf_counter() - t0
    took = (backend, len(paths), result.total_s, result.volumes_per_s, result.prepare_s, out_dir)
    logger.info("infer %s: %d volumes in %.1f s (%.2f volumes/s of inference; backend built in %.1f s) -> %s", *took)
    return result


def tuned_window(
    network: torch.nn.Module,
    config: RecipeConfig,
    image: str,
    backend: str,
    device: torch.device,
    overlap: float,
    store: str | os.PathLike | None = "default",
    sw_batch_range: tuple[int, int] = (1, 32),
    pre: Compose | None = None,
) -> tuple[int, torch.device]:
    """The fastest ``sw_batch_size`` and stitching device for ``network`` on volumes of ``image``'s size after ``pre``,
    measured by `tune_validation()` at the backend's precision and kept in the tuning store."""
    from monai_fast.tune.tuner import tune_validation  # the tuner loads only when asked for

    pre = pre if pre is not None else inference_transforms(config)
    shape = tuple(pre({"image": image})["image"].shape[1:])
    precision = precision_of(backend, device)
    pick = tune_validation(
        network.to(device),
        config.patch_size,
        shape,
        device,
        precision,
        overlap=overlap,
        sw_batch_range=sw_batch_range,
        store=store,
    )
    found = (pick.sw_batch_size, pick.val_device, "x".join(map(str, shape)), precision, pick.val_volumes_per_s)
    logger.info("infer: sw_batch_size %d, stitching on %s, measured on %s volumes at %s (%.2f volumes/s)", *found)
    return pick.sw_batch_size, torch.device(pick.val_device)


def _pred_classes_innermost(item: dict) -> dict:
    """The item with its CPU prediction's classes innermost (a vectorised argmax), outside ``applied_operations``."""
    pred = item["pred"]
    return {**item, "pred": classes_innermost(pred, dim=0)} if pred.device.type == "cpu" else item


def _save(prediction: torch.Tensor, path: Path) -> None:
    """Write a ``(1, *spatial)`` label map as ``uint8`` NIfTI, whole or not at all (`write_bytes()`).

    ``SaveImage`` writes in place and hides a full disk; here `NoSpaceError` names the file before a byte is written.
    """
    writer = NibabelWriter(output_dtype=np.uint8)
    writer.set_data_array(prediction, channel_dim=0, squeeze_end_dims=True)
    writer.set_metadata(meta_dict=getattr(prediction, "meta", None), resample=False)
    affine = np.eye(4) if writer.affine is None else convert_data_type(writer.affine, np.ndarray)[0]
    image = writer.create_backend_obj(writer.data_obj, affine=affine, dtype=writer.output_dtype)
    affine = to_affine_nd(r=3, affine=affine)
    image.set_sform(affine, code=1)
    image.set_qform(affine, code=1)
    data = image.to_bytes()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=1)
    ensure_free_space(path, len(data), what="prediction")
    write_bytes(data, path)
