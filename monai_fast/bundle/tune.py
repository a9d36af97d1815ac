"""Bundle-aware tuning: measure a bundle's batch sizes on this device and write an override file (docs/bundles.md)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shlex
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ignite import distributed as idist

from monai_fast.bundle.checks import (
    TRAIN_CONFIG_NAMES,
    BundleError,
    bundle_config_files,
    check_config_files,
    check_overrides,
)
from monai_fast.bundle.pieces import (
    AUTO3DSEG_KEYS,
    ZOO_KEYS,
    TunerPieces,
    auto3dseg_config_files,
    auto3dseg_pieces,
    is_auto3dseg_algorithm,
    parsed,
    read_config,
    reads_as_auto3dseg,
    zoo_pieces,
)
from monai_fast.files import write_json
from monai_fast.telemetry.precision import REQUESTS, choose_precision
from monai_fast.tune.result import trial_setting, trial_throughput

__all__ = ["BundleTuning", "bundle_run_command", "run_precision", "tune_bundle"]

logger = logging.getLogger("monai_fast.bundle")


@dataclass
class BundleTuning:
    """What `tune_bundle()` measured and wrote.

    Attributes:
        overrides: config id -> value, as written to the override file.
        path: the override file.
        result: the tuner's full result (every trial) as a dict.
        layout: ``"zoo"`` or ``"auto3dseg"``: which keys were used.
        config_files: the config files read, in merge order.
        precision: the precision the trials ran in (the one the run trains in).
        not_written: config id -> why it was not written (with the value measured for it).
        table: every trial as a text table, the pick marked.
    """

    overrides: dict[str, Any]
    path: Path
    result: dict = field(default_factory=dict)
    layout: str = "zoo"
    config_files: list[Path] = field(default_factory=list)
    precision: str = "fp32"
    not_written: dict[str, str] = field(default_factory=dict)
    table: str = ""


def tune_bundle(
    bundle_dir: str | os.PathLike,
    config_files: str | Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    out: str | os.PathLike | None = None,
    batch_range: tuple[int, int] = (1, 16),
    sw_batch_range: tuple[int, int] = (1, 32),
    precision: str = "auto",
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    max_trials: int = 8,
    memory_cap_mib: float | None = None,
    margin: float = 0.1,
    new_keys: Sequence[str] = (),
    **timing: float,
) -> BundleTuning:
    """Measure a bundle's batch sizes on its device and write the override file; returns a `BundleTuning`.

    What stops the tuning raises a `BundleError` before any trial (a YAML config without pyyaml: `MissingExtraError`).

    Args:
        bundle_dir: a Model Zoo bundle, or an algorithm folder Auto3DSeg generated.
        config_files: as for `run_bundle()`; default the train config, or an Auto3DSeg algorithm's.
        overrides: config overrides (data lists, device, ...), as for `run_bundle()`.
        out: the override file; default ``<bundle_dir>/configs/tuned.json``.
        batch_range: training batch sizes to search; its top is capped by one rank's share of the training set.
        sw_batch_range: sliding-window batch sizes to search.
        precision: as ``bundle run --precision`` takes it; trials run in what the run resolves (`run_precision()`).
        progress: a progress bar over the trials (on a terminal only).
        say: where the progress lines go; default the ``monai_fast.bundle`` logger at INFO.
        max_trials: most candidates run per search (`SearchSpace`).
        memory_cap_mib: most memory a candidate may use (`Tuner`).
        margin: share of the memory cap kept free (`SearchSpace`).
        new_keys: override ids the config lacks that the user adds on purpose; any other is refused.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` per trial, passed to the tuner.
    """
    from monai_fast.tune import SearchSpace, Tuner

    tell = say if say is not None else logger.info
    root = Path(bundle_dir).resolve()
    if not root.is_dir():
        raise BundleError(f"bundle folder {root} does not exist")
    if precision not in REQUESTS:
        raise BundleError(f"precision must be one of {', '.join(REQUESTS)}, got {precision!r}")
    try:  # the search options checked before anything is read
        space = SearchSpace(
            batch_range=batch_range, sw_batch_range=sw_batch_range, max_trials=max_trials, margin=margin
        )
    except ValueError as err:
        raise BundleError(str(err)) from err
    if memory_cap_mib is not None and not memory_cap_mib > 0:
        raise BundleError(f"memory_cap_mib must be > 0, got {memory_cap_mib}")
    path = Path(out) if out is not None else root / "configs" / "tuned.json"
    files = _config_files(root, config_files, path)
    check_config_files(files)
    _check_writable(path)
    tell(f"reading {', '.join(f.name for f in files)} of {root} (the network, the crop, one validation volume)")
    try:
        parser = read_config(root, files, overrides or {})
    except KeyError as err:  # an override under an id the config lacks (MONAI's update): named, nearest ids first
        check_overrides(files, overrides or {}, new_keys, exempt=("bundle_root",))
        raise BundleError(f"an override's id is not in the config: {err.args[0]}") from None
    auto3dseg = reads_as_auto3dseg(parser)
    if not auto3dseg:  # an Auto3DSeg algorithm's runner takes keys its templates lack (data_list_file_path, ...)
        check_overrides(files, overrides or {}, new_keys, exempt=("bundle_root",))
    pieces = auto3dseg_pieces(parser) if auto3dseg else zoo_pieces(parser)
    not_written = _unwritable_keys(files, pieces.keys)
    for cid, why in not_written.items():
        tell(f"{cid} will not be written: {why}")
    if all(pieces.keys[k] in not_written for k in ("batch", "sw_batch") if k in pieces.keys):
        raise BundleError(
            f"none of the tuned keys can be merged into the bundle's config: {'; '.join(not_written.values())}"
        )
    batch_range = _capped(batch_range, pieces, tell)
    trained_in, because = run_precision(parser, pieces, precision)
    tuner = Tuner(
        copy.deepcopy(pieces.network).to(pieces.device),
        pieces.loss,
        pieces.optimizer,
        patch_size=pieces.patch,
        val_shape=pieces.val_shape,
        device=pieces.device,
        num_samples=pieces.num_samples,
        in_channels=pieces.in_channels,
        out_channels=pieces.out_channels,
        overlap=pieces.overlap,
        space=dataclasses.replace(space, batch_range=batch_range, precisions=[trained_in]),
        memory_cap_mib=memory_cap_mib,
        **timing,
    )
    most = tuner.most_trials()
    patch, volume = "x".join(map(str, pieces.patch)), "x".join(map(str, pieces.val_shape))
    tell(
        f"tuning on {pieces.device} in {trained_in} ({because}): at most {most} trials: training batch "
        f"{batch_range[0]}-{batch_range[1]} (patch {patch} x {pieces.num_samples} crops), "
        f"sliding-window batch {sw_batch_range[0]}-{sw_batch_range[1]} on a {volume} volume; "
        f"each trial {tuner.timing['warmup']} warm-up step(s), then at least {tuner.timing['min_iters']} timed ones "
        f"and {tuner.timing['min_time_s']:g} s"
    )
    result = tuner.run(progress=progress, on_trial=_trial_printer(tell, most))
    tuned, unset = _tuned_values(result, pieces, auto3dseg)
    for cid, why in not_written.items():
        if cid in tuned:
            not_written[cid] = f"{why}; set it to {tuned.pop(cid)!r} yourself"
    every = AUTO3DSEG_KEYS if auto3dseg else ZOO_KEYS
    absent = [every[k] for k in every if k not in pieces.keys]
    write_json(tuned, path)
    what = f"patch {patch} x {pieces.num_samples} crops, validation volume {volume}, {trained_in} on {pieces.device}"
    no_key = f"; the config has no key for {', '.join(absent)}" if absent else ""
    logger.info("bundle tuning: %s -> %s (%s)%s", tuned, path, what, no_key)
    return BundleTuning(
        overrides=tuned,
        path=path,
        result=result.to_dict(),
        layout=pieces.layout,
        config_files=list(files),
        precision=trained_in,
        not_written={cid: why for cid, why in not_written.items() if cid not in unset},
        table=result.table(),
    )


def run_precision(parser: Any, pieces: TunerPieces, requested: str = "auto") -> tuple[str, str]:
    """The precision the bundle's run trains in, and why: the trials run in it (the rules: docs/bundles.md).

    Raises:
        BundleError: ``requested`` cannot run on the bundle's device (fp16 on a CPU).
    """
    device = pieces.device
    if pieces.layout == "auto3dseg":
        if requested != "auto":
            return _checked(requested, device), f"requested {requested}"
        if pieces.amp and device.type == "cuda":
            return "fp16", "the algorithm's amp on CUDA"
        return "fp32", "the algorithm's script autocasts on CUDA only, with amp"
    if pieces.amp and device.type == "cuda":
        dtype = parsed(parser, "train#trainer#amp_kwargs#dtype")  # autocast's, float16 unless the trainer names another
        return "bf16" if dtype == torch.bfloat16 else "fp16", "the trainer's amp=True on CUDA, which FastTraining keeps"
    if requested == "fp32":
        return "fp32", "requested fp32"
    return _checked(requested, device), f"what FastTraining picks for {requested} on {device.type}"


def _checked(requested: str, device: torch.device) -> str:
    try:
        return choose_precision(requested, device)
    except ValueError as err:
        raise BundleError(f"precision {requested}: {err}") from err


def bundle_run_command(
    tuning: BundleTuning, bundle_dir: str | os.PathLike, overrides: Mapping[str, Any], precision: str = "auto"
) -> str:
    """The ``monai-fast bundle run`` command line that trains the bundle as it was tuned: the config files read,
    the override file, and the tuning's overrides less those of the keys the override file sets.

    Examples:
        >>> t = BundleTuning({"train#dataloader#batch_size": 4}, Path("/b/tuned.json"), config_files=[Path("/b/a")])
        >>> print(bundle_run_command(t, "/b", {"patch_size": [64, 64, 64], "train#dataloader#batch_size": 2}))
        monai-fast bundle run /b --config_file '["/b/a", "/b/tuned.json"]' 'patch_size=[64, 64, 64]'
    """
    files = list(dict.fromkeys(str(f) for f in [*tuning.config_files, tuning.path]))
    words = ["monai-fast", "bundle", "run", str(bundle_dir), "--config_file", json.dumps(files)]
    words += ["--precision", precision] if precision != "auto" else []
    words += [
        f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items() if k not in tuning.overrides
    ]
    return shlex.join(words)


def _config_files(root: Path, config_files: str | Sequence[str] | None, out: Path) -> list[Path]:
    """The config files to read: as given, the Auto3DSeg algorithm's, or the Model Zoo's train config."""
    if config_files is not None:
        return bundle_config_files(root, config_files)
    if is_auto3dseg_algorithm(root):
        return auto3dseg_config_files(root, skip=[out])
    configs = root / "configs"
    if not any((configs / n).is_file() for n in TRAIN_CONFIG_NAMES):
        inside = sorted(str(d) for d in root.iterdir() if (d / "configs" / "hyper_parameters.yaml").is_file())
        hint = f"; the algorithms Auto3DSeg generated here are {', '.join(inside)}: tune one with --bundle"
        raise BundleError(
            f"{configs} has no train.json or train.yaml (a Model Zoo bundle) and no hyper_parameters.yaml "
            f"(an Auto3DSeg algorithm): name the bundle's config file(s) with --bundle-config{hint if inside else ''}"
        )
    return bundle_config_files(root, None)


def _check_writable(path: Path) -> None:
    """Make the override file's folder and write a scratch file there, before any trial is lost to it."""
    if path.is_dir():
        raise BundleError(f"the override file {path} is a folder: name a file with --bundle-out")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise BundleError(
            f"cannot write the override file {path}: {err.strerror or err} (name a writable one with --bundle-out)"
        ) from err


def _unwritable_keys(files: Sequence[Path], keys: Mapping[str, str]) -> dict[str, str]:
    """The tuned config ids that a later config file cannot set (inside a ``$`` expression, a reference or a
    macro), and why."""
    from monai.bundle import ConfigParser

    merged = ConfigParser.load_config_files([str(f) for f in files])
    why: dict[str, str] = {}
    for cid in keys.values():
        probe = ConfigParser(copy.deepcopy(merged))
        try:
            probe[cid] = 1
        except (KeyError, IndexError, TypeError, ValueError):
            why[cid] = _why_not(merged, cid)
    return why


def _why_not(merged: dict, cid: str) -> str:
    """Why ``cid`` cannot be set in ``merged``: what its parent holds."""
    from monai.bundle import ConfigParser

    parent = cid.rsplit("#", 1)[0]
    try:
        held = ConfigParser(merged)[parent]
    except (KeyError, IndexError, ValueError):
        return f"the config has no {parent} to hold it"
    kinds = {"$": "a $ expression", "@": "a reference", "%": "a macro"}
    if isinstance(held, str) and held[:1] in kinds:
        text = held if len(held) <= 60 else held[:57] + "..."
        return f"{parent} is {kinds[held[0]]} ({text!r}), not a config dict a key can be set in"
    return f"{parent} is {type(held).__name__}, not a config dict a key can be set in"


def _capped(batch_range: tuple[int, int], pieces: TunerPieces, tell: Callable[[str], None]) -> tuple[int, int]:
    """``batch_range`` with its top at one rank's share of the training set (an empty set is refused)."""
    lo, hi = batch_range
    n = pieces.train_items
    if n is None:
        tell(f"the training batch is not capped by the training set's size ({pieces.train_items_from})")
        return lo, hi
    if n == 0:
        raise BundleError(
            f"the training set is empty ({pieces.train_items_from} has no items): check the data overrides"
        )
    ranks = idist.get_world_size()
    share = math.ceil(n / ranks)
    if hi <= share:
        return lo, hi
    per = f", {share} per rank on {ranks} ranks" if ranks > 1 else ""
    cost = (
        "with drop_last a larger batch trains no iteration"
        if pieces.drop_last
        else "a larger batch is the same one step over the whole set"
    )
    tell(f"training batch capped at {share}: the training set has {n} volumes ({pieces.train_items_from}){per}; {cost}")
    return min(lo, share), share


def _trial_printer(tell: Callable[[str], None], most: int) -> Callable[[dict], None]:
    """One line per trial as it ends: the setting, what it measured, and a bound on the time left."""
    done: list[float] = []

    def line(t: dict) -> None:
        done.append(t["cost_s"])
        got = trial_throughput(t) if t["feasible"] else f"infeasible ({t['reason']})"
        peak = f", peak {t['peak_mib']:.0f} MiB" if t["peak_mib"] is not None else ""
        left = max(most - len(done), 0)
        eta = f"; at most {left} more, about {left * sum(done) / len(done):.0f} s" if left else ""
        tell(f"trial {len(done)}/{most}: {t['phase']} {trial_setting(t)}: {got}{peak}, {t['cost_s']:.1f} s{eta}")

    return line


def _tuned_values(result: Any, pieces: TunerPieces, auto3dseg: bool) -> tuple[dict[str, Any], set[str]]:
    """Config id -> tuned value, and the ids left unset because the pick is the bundle's own setting."""
    keys = pieces.keys
    tuned: dict[str, Any] = {keys["batch"]: int(result.batch_size)}
    if "sw_batch" in keys:
        tuned[keys["sw_batch"]] = int(result.sw_batch_size)
    unset: set[str] = set()
    if "val_device" in keys:
        if torch.device(result.val_device) != pieces.device:
            # the Model Zoo names the device; Auto3DSeg says whether the volume stays on the CPU
            tuned[keys["val_device"]] = (
                torch.device(result.val_device).type == "cpu" if auto3dseg else f"$torch.device('{result.val_device}')"
            )
        else:
            unset.add(keys["val_device"])
    return tuned, unset
