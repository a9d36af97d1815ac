"""Run a MONAI bundle as ``python -m monai.bundle run`` does, with ``FastTraining`` on its engines.

A bundle (the Model Zoo's layout: ``configs/train.json`` or ``.yaml``, ``configs/metadata.json``,
``configs/logging.conf``) builds its ``SupervisedTrainer`` and ``SupervisedEvaluator`` from its
config. :func:`run_bundle` builds them the same way, through MONAI's public ``ConfigWorkflow``
(several config files merged as MONAI merges them, ``key=value`` overrides, the config's
``initialize`` / ``run`` / ``finalize`` sections), then, between ``initialize`` and ``run``,
attaches a :class:`~monai_fast.handlers.RecordHandler`, a
:class:`~monai_fast.handlers.TimeBreakdown` and :class:`~monai_fast.FastTraining` to the
trainer and evaluator it finds by the bundle conventions (``train#trainer``,
``validate#evaluator``) or by the ids given. With ``fast=False`` the bundle runs as published, with
the record only, for a side-by-side. The config's own objects are the ones attached to: the
``run`` section's ``$@train#trainer.run()`` resolves to the same trainer.

FastTraining's decisions are returned and printed by the command line whatever logging set-up the
bundle brings, and the doctor reads the record at the end.

Parsing a config runs the code in it (``_target_`` callables, ``$`` expressions), as MONAI's own
runner does: run bundles you trust.

Example:
    >>> from monai_fast.bundle import run_bundle
    >>> result = run_bundle("spleen_ct_segmentation", overrides={"dataset_dir": "/data/Task09"})  # doctest: +SKIP
    >>> result.applied["precision"]["setting"]  # doctest: +SKIP
    'bf16'
"""

from __future__ import annotations

import ast
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BundleError", "BundleResult", "bundle_config_files", "parse_overrides", "run_bundle"]

logger = logging.getLogger("monai_fast.bundle")

TRAINER_ID = "train#trainer"  #: where the Model Zoo's train configs put the trainer
EVALUATOR_ID = "validate#evaluator"  #: and the evaluator
RUN_ID = "run"  #: the run section of the Model Zoo's train configs
LEGACY_RUN_ID = "training"  #: its older name, run when a config has no ``run`` section
TRAIN_CONFIG_NAMES = ("train.json", "train.yaml", "train.yml")  #: the train config a bundle folder is read from


class BundleError(ValueError):
    """A bundle that cannot be run as asked: the message names the file, folder or config id at fault."""


@dataclass
class BundleResult:
    """What a bundle run did.

    Attributes:
        run_dir: the folder holding the run record (``record.rank<N>.jsonl``).
        applied: FastTraining's decisions per lever (empty with ``fast=False``).
        config_files: the config files merged, in order.
        trainer_id: the config id of the trainer attached to.
        evaluator_id: the config id of the evaluator, ``None`` when the bundle has none.
        verdict: the doctor's verdict as text (``None`` when not asked for or not possible).
        metrics: the engines' last metrics as numbers: ``"train/<name>"`` from the trainer,
            ``"validate/<name>"`` from the evaluator's last validation, and ``"validate/best"`` (its best
            key metric), so that a caller compares runs without reading the bundle's own output files.
    """

    run_dir: Path
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_files: list[Path] = field(default_factory=list)
    trainer_id: str = TRAINER_ID
    evaluator_id: str | None = EVALUATOR_ID
    verdict: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """Overrides as ``monai.bundle`` takes them: ``--id value``, ``--id=value`` or ``id=value``.

    Values are read as JSON, then as a Python literal, else kept as text (``%file#key`` macros and
    ``$`` expressions stay text for the config parser to resolve).

    Raises:
        BundleError: a token that is neither form, or an option without a value, named.

    Example:
        >>> parse_overrides(["--train#trainer#max_epochs", "2", "device=$torch.device('cpu')"])
        {'train#trainer#max_epochs': 2, 'device': "$torch.device('cpu')"}
    """
    out: dict[str, Any] = {}
    i = 0
    tokens = list(tokens)
    while i < len(tokens):
        tok = tokens[i]
        if tok.startswith("--"):
            key = tok[2:]
            if "=" in key:
                key, value = key.split("=", 1)
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
                i += 1
            else:
                raise BundleError(f"override {tok} has no value (write {tok} VALUE or {tok}=VALUE)")
        elif "=" in tok and not tok.startswith("="):
            key, value = tok.split("=", 1)
        else:
            raise BundleError(f"cannot read override {tok!r}: write id=value or --id value")
        if not key:
            raise BundleError(f"override {tok!r} names no config id")
        out[key] = _value(value)
        i += 1
    return out


def _value(text: str) -> Any:
    if text.startswith(("$", "%", "@")):
        return text
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def bundle_config_files(bundle_dir: str | os.PathLike, config_files: str | Sequence[str] | None = None) -> list[Path]:
    """The config files to merge, each checked to exist.

    ``config_files`` may be a list, or a string as ``monai.bundle`` takes it (one path, or
    ``"['configs/train.json','fast.json']"``). A relative path is found in the working directory
    first, then in the bundle folder. Without it: ``configs/train.json`` (or ``.yaml``).

    Raises:
        BundleError: the bundle folder or a config file is missing, named.
        MissingExtraError: a YAML config without pyyaml installed (the ``bundle`` extra), named.
    """
    root = Path(bundle_dir)
    if not root.is_dir():
        raise BundleError(f"bundle folder {root} does not exist")
    if config_files is None:
        for name in TRAIN_CONFIG_NAMES:
            if (root / "configs" / name).is_file():
                require_yaml_reader([root / "configs" / name])
                return [root / "configs" / name]
        raise BundleError(f"{root / 'configs'} has no train.json or train.yaml; name the config with --config_file")
    if isinstance(config_files, str):
        text = config_files.strip()
        if text.startswith("["):
            try:
                config_files = [str(x) for x in ast.literal_eval(text)]
            except (ValueError, SyntaxError) as err:
                raise BundleError(f"--config_file {text!r} is not a list of paths") from err
        else:
            config_files = [text]
    found = []
    for name in config_files:
        path = Path(name)
        candidates = [path] if path.is_absolute() else [Path.cwd() / path, root / path]
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            where = ", ".join(str(c.parent) for c in candidates)
            raise BundleError(f"config file {name} not found (looked in {where})")
        found.append(hit.resolve())
    require_yaml_reader(found)
    return found


def require_yaml_reader(files: Sequence[Path]) -> None:
    """Check that the YAML files among ``files`` can be read, before any is.

    MONAI reads YAML configs through pyyaml, which the ``bundle`` extra installs; without it MONAI
    fails deep in the parse with a traceback.

    Raises:
        MissingExtraError: naming the first YAML file and the extra to install.
    """
    from monai_fast.extras import require

    for f in files:
        if Path(f).suffix in (".yaml", ".yml"):
            require("yaml", extra="bundle", feature=f"reading the YAML config {f}")
            return


def _default(root: Path, name: str) -> Path | None:
    path = root / "configs" / name
    return path if path.is_file() else None


def run_bundle(
    bundle_dir: str | os.PathLike,
    config_files: str | Sequence[str] | None = None,
    meta_file: str | os.PathLike | None = None,
    logging_file: str | os.PathLike | bool | None = None,
    overrides: Mapping[str, Any] | None = None,
    fast: bool = True,
    fast_options: Mapping[str, Any] | None = None,
    trainer_id: str = TRAINER_ID,
    evaluator_id: str | None = EVALUATOR_ID,
    run_dir: str | os.PathLike | None = None,
    init_id: str = "initialize",
    run_id: str = RUN_ID,
    final_id: str = "finalize",
    doctor: bool = True,
    on_applied: Any = None,
) -> BundleResult:
    """Run a bundle's training workflow with ``FastTraining`` attached (or without, ``fast=False``).

    Args:
        bundle_dir: the bundle folder (``configs/`` inside). ``bundle_root`` is set to it unless an
            override sets it, so a bundle whose config says ``"bundle_root": "."`` runs from anywhere.
        config_files: see :func:`bundle_config_files`.
        meta_file: default ``configs/metadata.json`` when present.
        logging_file: default ``configs/logging.conf`` when present; ``False``: none.
        overrides: config id -> value, as ``monai.bundle run --id value`` (see :func:`parse_overrides`).
        fast: attach ``FastTraining``; ``False`` runs the bundle as published, with the record.
        fast_options: keyword arguments for ``FastTraining``.
        trainer_id: the trainer's config id.
        evaluator_id: the evaluator's config id; ``None``, or an id the config lacks while left at
            its default, runs without one.
        run_dir: where the run record goes; default ``<output_dir>/monai_fast`` when the config has
            an ``output_dir``, else ``<bundle_dir>/eval/monai_fast``.
        init_id: the config's initialize section.
        run_id: the config's run section; left at ``"run"`` with a config that has only the older
            ``"training"`` section (as some Model Zoo bundles do), that one runs.
        final_id: the config's finalize section.
        doctor: read the record at the end and return the doctor's verdict (on rank 0, once every rank is done).
        on_applied: called with FastTraining's decisions once attached, before training (the CLI
            prints them there, whatever the bundle's logging does).

    Returns:
        What the run did (:class:`BundleResult`).

    Raises:
        BundleError: a missing file, or an id the config lacks, named before any training.
    """
    import torch
    from monai.bundle import ConfigWorkflow

    from monai_fast.bundle.checkpoints import atomic_checkpoints, config_checkpoint_savers
    from monai_fast.handlers import (
        FastTraining,
        InferenceSplit,
        RecordHandler,
        TimeBreakdown,
        TrainingAlgorithmTime,
    )

    root = Path(bundle_dir).resolve()
    files = bundle_config_files(root, config_files)
    meta = Path(meta_file) if meta_file is not None else _default(root, "metadata.json")
    if meta is not None and not meta.is_file():
        raise BundleError(f"meta file {meta} not found")
    if logging_file is None:
        logging_file = _default(root, "logging.conf") or False
    elif logging_file is not False and not Path(logging_file).is_file():
        raise BundleError(f"logging file {logging_file} not found")
    pairs = dict(overrides or {})
    pairs.setdefault("bundle_root", str(root))

    def make(run: str) -> Any:
        return ConfigWorkflow(
            config_file=[str(f) for f in files],
            meta_file=str(meta) if meta is not None else None,
            logging_file=str(logging_file) if logging_file else False,
            init_id=init_id,
            run_id=run,
            final_id=final_id,
            **pairs,
        )

    workflow = make(run_id)
    parser = workflow.parser
    if run_id == RUN_ID and run_id not in parser and LEGACY_RUN_ID in parser:
        logger.info(
            "bundle: no %r section: running %r, the older Model Zoo name of the run section", RUN_ID, LEGACY_RUN_ID
        )
        run_id = LEGACY_RUN_ID
        workflow = make(run_id)
        parser = workflow.parser
    if trainer_id not in parser:
        raise BundleError(
            f"the config ({', '.join(f.name for f in files)}) has no {trainer_id!r}; name the trainer with --trainer-id"
        )
    if evaluator_id is not None and evaluator_id not in parser:
        if evaluator_id != EVALUATOR_ID:
            raise BundleError(f"the config has no {evaluator_id!r} (--evaluator-id)")
        logger.info("bundle: no %s in the config: training without an evaluator", evaluator_id)
        evaluator_id = None
    if run_id not in parser:
        raise BundleError(
            f"the config has no {run_id!r} section to run" + (f" (nor {LEGACY_RUN_ID!r})" if run_id == RUN_ID else "")
        )
    workflow.initialize()
    trainer = parser.get_parsed_content(trainer_id)
    evaluator = parser.get_parsed_content(evaluator_id) if evaluator_id is not None else None
    atomic_checkpoints(config_checkpoint_savers(parser))  # a full disk keeps the previous model.pt, named in one line
    folder = Path(run_dir) if run_dir is not None else _run_dir(parser, root)
    record = RecordHandler(folder)
    record.attach(trainer)
    if evaluator is not None:
        record.attach(evaluator)
        if isinstance(getattr(evaluator, "network", None), torch.nn.Module):  # windows per volume: the doctor's
            InferenceSplit().attach(evaluator)  # evidence for (or against) sliding-window advice
    TimeBreakdown().attach(trainer)  # data wait against compute: what the doctor reads
    TrainingAlgorithmTime().attach(trainer)  # the bundle's training post-processing and metrics, also with fast=False
    result = BundleResult(run_dir=folder, config_files=files, trainer_id=trainer_id, evaluator_id=evaluator_id)
    if fast:
        handler = FastTraining(**dict(fast_options or {}))
        handler.attach(trainer, evaluator)
        result.applied = handler.applied
    if on_applied is not None:
        on_applied(result.applied)
    workflow.run()
    ranks, rank = _world_size(), _rank()  # before finalize, which may end the process group
    if ranks > 1:  # every rank's record is complete before rank 0 reads it
        import torch.distributed as dist

        dist.barrier()
    workflow.finalize()
    result.metrics = _metrics(trainer, evaluator)
    if doctor and rank == 0:
        result.verdict = _verdict(folder)
    return result


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _metrics(trainer: Any, evaluator: Any) -> dict[str, float]:
    """The engines' last metrics that read as one number each (per-class tensors and the like are left out)."""
    out: dict[str, float] = {}
    for prefix, engine in (("train", trainer), ("validate", evaluator)):
        state = getattr(engine, "state", None)
        for name, value in (getattr(state, "metrics", None) or {}).items():
            number = _number(value)
            if number is not None:
                out[f"{prefix}/{name}"] = number
    best = _number(getattr(getattr(evaluator, "state", None), "best_metric", None))
    if best is not None and evaluator is not None and getattr(evaluator.state, "best_metric_epoch", -1) > 0:
        out["validate/best"] = best
    return out


def _number(value: Any) -> float | None:
    try:
        if hasattr(value, "numel") and value.numel() != 1:
            return None
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def _run_dir(parser: Any, root: Path) -> Path:
    if "output_dir" in parser:
        try:
            out = parser.get_parsed_content("output_dir")
            if isinstance(out, (str, os.PathLike)):
                return Path(out) / "monai_fast"
        except Exception as err:  # noqa: BLE001 - an output_dir expression the parser cannot evaluate yet
            logger.info("bundle: output_dir could not be read (%s); the record goes to %s/eval", err, root)
    return root / "eval" / "monai_fast"


def _verdict(folder: Path) -> str | None:
    from monai_fast.report.doctor import doctor

    try:
        return doctor(folder).text()
    except (OSError, ValueError) as err:
        logger.warning("bundle: the doctor could not read %s (%s)", folder, err)
        return None
