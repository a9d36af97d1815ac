"""What the doctor advises: per verdict the fixes, each with the ``FastTraining`` lever that applies it."""

from __future__ import annotations

from monai_fast.report.applied import InEffect
from monai_fast.telemetry.chain import crop_indices_advised
from monai_fast.telemetry.record import Lever

__all__ = ["ATTACH", "FIXES", "fix_applies", "fixes_for", "unused_levers"]

#: per verdict: (the FastTraining lever that applies the fix, or None for a code change, the fix)
FIXES: dict[str, list[tuple[Lever | None, str]]] = {
    "data-bound": [
        (
            Lever.DATA,
            "cache the deterministic transforms: FastTraining(cache='auto') on your trainer (CacheDataset in RAM; "
            "on CUDA in GPU memory via ToDeviced, the random transforms then run there), or recipe 'fast'",
        ),
        (
            Lever.DATA,
            "once cached, load in a thread without worker processes: "
            "FastTraining(loader='auto') (SafeThreadDataLoader)",
        ),
        (
            Lever.DATA,
            "data larger than RAM: FastTraining(cache='disk', cache_dir=...) (a trusted disk cache) "
            "or cache='smartcache'",
        ),
        (
            None,
            "precompute foreground/background indices (FgBgToIndicesd) so RandCropByPosNegLabeld skips the label scan",
        ),
    ],
    "gpu-under-filled": [
        (
            None,
            "raise the batch size or crops per volume (your DataLoader's batch_size, RandCropByPosNegLabeld's "
            "num_samples; RecipeConfig.batch_size / num_samples in the recipes) until memory is used",
        ),
        (None, "raise the sliding-window batch (SlidingWindowInferer's sw_batch_size) for validation"),
        (Lever.PRECISION, "mixed precision so larger batches fit: FastTraining(precision='auto')"),
    ],
    "compute-bound": [
        (
            Lever.PRECISION,
            "mixed precision: FastTraining(precision='auto') (bf16 where supported, else fp16 + GradScaler)",
        ),
        (Lever.MEMORY_FORMAT, "channels_last_3d weights where they measure faster: FastTraining(memory_format='auto')"),
        (
            None,
            "more devices: data-parallel training over several GPUs (monai_fast.apps.launch.run, monai-fast launch)",
        ),
    ],
    "balanced": [
        (None, "no single bottleneck stands out; profile a window with KernelProfiler to find the costliest ops"),
    ],
}


def fix_applies(lever: Lever | None, text: str, run: InEffect) -> bool:
    """Whether a fix fits the run: a 3-D network for ``channels_last_3d``, several windows per volume for
    sliding-window settings, a chain that needs them for precomputed crop indices (unknown counts as fitting)."""
    if lever == Lever.MEMORY_FORMAT and run.spatial_dims is not None and run.spatial_dims != 3:
        return False
    if "FgBgToIndicesd" in text and not crop_indices_advised(run.transforms):
        return False
    return not (("sliding-window" in text or "sw_batch_size" in text) and not run.batches_windows)


def fixes_for(verdict: str, applied: dict[str, dict], run: InEffect | None = None) -> list[str]:
    """The verdict's fixes that fit the run, without those it has on already (said once instead): what
    ``FastTraining`` applied, and the precision the run trained in however it was set."""
    run = run or InEffect(None, None, None, None, None)
    fixes, already, on_in_run = [], [], []
    for lever, text in FIXES[verdict]:
        if not fix_applies(lever, text, run):
            continue
        on = applied.get(lever) if lever is not None else None
        if on is not None and on.get("applied"):
            already.append(f"{lever} ({on.get('setting')})")
        elif lever == Lever.PRECISION and run.precision is not None:
            on_in_run.append(f"precision ({run.precision}, set by {run.precision_by})")
        elif lever == Lever.DATA and run.data_cached and "cache" in text:
            on_in_run.append("data (the training data set is a cache)")
        else:
            fixes.append(text)
    if already:
        fixes.append("already applied by FastTraining: " + ", ".join(dict.fromkeys(already)))
    if on_in_run:
        fixes.append("already on in this run: " + ", ".join(dict.fromkeys(on_in_run)))
    return fixes


#: the line that puts every FastTraining lever on a user's own trainer and evaluator
ATTACH = "FastTraining().attach(trainer, evaluator)"


def unused_levers(applied: dict[str, dict], run: InEffect) -> list[str]:
    """The ``FastTraining`` levers a run without it left unused (fp32 on a GPU or a bf16 CPU, a data set that is not
    a cache), each with its evidence; empty for a run with ``FastTraining``."""
    if applied:
        return []
    out = []
    device = run.device or ""
    if run.precision is None and (device.startswith("cuda") or (device.startswith("cpu") and run.cpu_bf16)):
        where = "a GPU" if device.startswith("cuda") else "a CPU with bf16 instructions"
        out.append(f"precision (the trainer ran in fp32 on {where})")
    if run.data_cached is False:
        out.append("data (the training data set is not a cache: every epoch repeats its deterministic transforms)")
    return out
