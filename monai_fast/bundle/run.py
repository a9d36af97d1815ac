"""Run a MONAI bundle as ``python -m monai.bundle run`` does (MONAI's ``ConfigWorkflow``), with ``FastTraining``
on its engines, its record under ``<output_dir>/monai_fast`` and a user's mistake told in one line. Parsing a config
runs the code in it, as MONAI's own runner does: run bundles you trust."""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monai_fast.bundle.checks import (
    BundleError,
    bundle_config_files,
    check_component_packages,
    check_config_files,
    check_engine,
    check_expressions,
    check_overrides,
    config_ids,
)
from monai_fast.bundle.fragment import (
    ATTACH_CALL,
    FAST,
    PUBLISHED,
    attach_fast,
    new_run_folder,
    printed_decisions,
    refuse_foreign_record,
)

__all__ = [
    "RECORDS",
    "BundleResult",
    "check_writable",
    "named_user_errors",
    "raised_by_logging_config",
    "read_only_line",
    "records_parent",
    "run_bundle",
    "user_error_line",
]

logger = logging.getLogger("monai_fast.bundle")

TRAINER_ID = "train#trainer"  #: where the Model Zoo's train configs put the trainer
EVALUATOR_ID = "validate#evaluator"  #: and the evaluator
RUN_ID = "run"  #: the run section of the Model Zoo's train configs
LEGACY_RUN_ID = "training"  #: its older name, run when a config has no ``run`` section
RECORDS = "monai_fast"  #: the folder under the bundle's output folder that holds one record folder per run


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
        metrics: the engines' last metrics: ``"train/<name>"``, ``"validate/<name>"``, ``"validate/best"``.
    """

    run_dir: Path
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    config_files: list[Path] = field(default_factory=list)
    trainer_id: str = TRAINER_ID
    evaluator_id: str | None = EVALUATOR_ID
    verdict: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _default(root: Path, name: str) -> Path | None:
    path = root / "configs" / name
    return path if path.is_file() else None


def _drop_fragment(parser: Any, init_id: str, files: Sequence[Path]) -> None:
    """Leave the fragment's ``attach_fast`` out of the ``initialize`` section: this run attaches once itself."""
    entries = parser.get(init_id)
    if not isinstance(entries, list):
        return
    kept = [e for e in entries if not (isinstance(e, str) and ATTACH_CALL in e)]
    if len(kept) < len(entries):
        logger.info(
            "bundle: the config (%s) ships the monai-fast fragment; its attach_fast is left out: "
            "this run attaches once",
            ", ".join(f.name for f in files),
        )
        parser[init_id] = kept


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
    new_keys: Sequence[str] = (),
    resume: bool = False,
) -> BundleResult:
    """Run a bundle's training workflow with ``FastTraining`` attached (or without, ``fast=False``).

    A user's mistake raises a one-line `BundleError`; ``init_id``, ``run_id``, ``final_id`` name the config's sections.

    Args:
        bundle_dir: the bundle folder (``configs/`` inside); ``bundle_root`` is set to it unless overridden.
        config_files: see `bundle_config_files()`.
        meta_file: default ``configs/metadata.json`` when present.
        logging_file: default ``configs/logging.conf`` when present; ``False``: none.
        overrides: config id -> value (`parse_overrides()`); an id the config lacks is refused unless in ``new_keys``.
        fast: attach ``FastTraining``; ``False`` runs the bundle as published, with the record.
        fast_options: keyword arguments for ``FastTraining``.
        trainer_id: the trainer's config id.
        evaluator_id: the evaluator's config id; ``None``, or the default id the config lacks: none.
        run_dir: the record's folder (another run's is refused unless ``resume``); default a new one of its own.
        doctor: return the doctor's verdict on the record (rank 0, once all ranks are done).
        on_applied: called with FastTraining's decisions once attached, before training.
        new_keys: override ids the config does not have that the user adds on purpose.
        resume: continue the record in ``run_dir`` as its next segment.
    """
    from ignite import distributed as idist
    from monai.bundle import ConfigWorkflow

    from monai_fast.bundle.checkpoints import atomic_checkpoints, config_checkpoint_savers

    root = Path(bundle_dir).resolve()
    files = bundle_config_files(root, config_files)
    meta = Path(meta_file) if meta_file is not None else _default(root, "metadata.json")
    if meta is not None and not meta.is_file():
        raise BundleError(f"meta file {meta} not found")
    if logging_file is None:
        logging_file = _default(root, "logging.conf") or False
    elif logging_file is not False and not Path(logging_file).is_file():
        raise BundleError(f"logging file {logging_file} not found")
    check_config_files([*files, *([meta] if meta is not None else [])])
    pairs = dict(overrides or {})
    check_overrides(files, pairs, new_keys, exempt=("bundle_root",))
    check_expressions(files, pairs)
    if run_dir is not None:  # checked by every rank before initialize's rendezvous, so before any rank writes
        refuse_foreign_record(run_dir, resume)
    pairs.setdefault("bundle_root", str(root))

    def make(run: str) -> Any:
        try:
            return ConfigWorkflow(
                config_file=[str(f) for f in files],
                meta_file=str(meta) if meta is not None else [],  # none: no metadata, not MONAI's error line
                logging_file=str(logging_file) if logging_file else False,
                init_id=init_id,
                run_id=run,
                final_id=final_id,
                **pairs,
            )
        except Exception as e:  # the logging file is applied as the workflow is made: one it cannot apply, named
            if logging_file and raised_by_logging_config(e):
                raise BundleError(f"logging file {logging_file}: {type(e).__name__}: {e}") from None
            raise

    workflow = make(run_id)
    if run_id == RUN_ID and run_id not in workflow.parser and LEGACY_RUN_ID in workflow.parser:
        logger.info(
            "bundle: no %r section: running %r, the older Model Zoo name of the run section", RUN_ID, LEGACY_RUN_ID
        )
        run_id = LEGACY_RUN_ID
        workflow = make(run_id)
    parser = workflow.parser
    if trainer_id not in parser:
        raise BundleError(
            f"the config ({', '.join(f.name for f in files)}) has no {trainer_id!r}; name the trainer with "
            "--trainer-id (bundle run attaches to a trainer; a config that only evaluates runs with monai.bundle)"
        )
    if evaluator_id is not None and evaluator_id.replace("::", "#") == trainer_id.replace("::", "#"):
        raise BundleError(f"--trainer-id and --evaluator-id both name {trainer_id!r}: name two engines")
    if evaluator_id is not None and evaluator_id not in parser:
        if evaluator_id != EVALUATOR_ID:
            raise BundleError(f"the config has no {evaluator_id!r} (--evaluator-id)")
        logger.info("bundle: no %s in the config: training without an evaluator", evaluator_id)
        evaluator_id = None
    if run_id not in parser:
        raise BundleError(
            f"the config has no {run_id!r} section to run" + (f" (nor {LEGACY_RUN_ID!r})" if run_id == RUN_ID else "")
        )
    check_component_packages(parser)
    _drop_fragment(parser, init_id, files)
    if run_dir is None:
        check_writable(records_parent(parser, root), str(pairs["bundle_root"]))
    with named_user_errors(parser, root, files):
        workflow.initialize()
        trainer = parser.get_parsed_content(trainer_id)
        evaluator = parser.get_parsed_content(evaluator_id) if evaluator_id is not None else None
    check_engine(trainer, trainer_id, "--trainer-id")
    if evaluator is not None:
        check_engine(evaluator, evaluator_id, "--evaluator-id")
    atomic_checkpoints(config_checkpoint_savers(parser))  # a full disk keeps the previous model.pt, named in one line
    with named_user_errors(parser, root, files):
        variant = FAST if fast else PUBLISHED
        folder = Path(run_dir) if run_dir is not None else new_run_folder(records_parent(parser, root), variant)
        # resume=True: run_dir was refused above, on every rank before any wrote (here rank 0's rows could show)
        with printed_decisions() if on_applied is not None else nullcontext():
            handler = attach_fast(
                trainer, evaluator, run_dir=folder, resume=True, fast=fast, announce=False, **dict(fast_options or {})
            )
    applied = handler.applied if handler is not None else {}
    result = BundleResult(folder, applied, files, trainer_id, evaluator_id)
    if on_applied is not None:
        on_applied(result.applied)
    with named_user_errors(parser, root, files):
        workflow.run()
    rank = idist.get_rank()  # before finalize, which may end the process group
    if idist.get_world_size() > 1:  # every rank's record is complete before rank 0 reads it
        idist.barrier()
    workflow.finalize()
    result.metrics = _metrics(trainer, evaluator)
    if doctor and rank == 0:
        result.verdict = _verdict(folder)
    return result


def _metrics(trainer: Any, evaluator: Any) -> dict[str, float]:
    """The engines' last metrics that read as one number each."""
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


def _verdict(folder: Path) -> str | None:
    from monai_fast.report.doctor import doctor

    try:
        return doctor(folder).text()
    except (OSError, ValueError) as err:
        logger.warning("bundle: the doctor could not read %s (%s)", folder, err)
        return None


def read_only_line(target: str, why: str, bundle_root: str) -> str:
    """The line for a folder that cannot be written; the way on where it is under the bundle's ``bundle_root``."""
    if not Path(target).resolve().is_relative_to(Path(bundle_root).resolve()):
        return f"cannot write {target} ({why})"
    return (
        f"cannot write {target} ({why}): the bundle writes its outputs under its bundle_root ({bundle_root}); "
        "run with bundle_root=<a writable folder> (the configs are still read from the bundle folder)"
    )


def check_writable(folder: Path, bundle_root: str) -> None:
    """Refuse (`BundleError`) a record folder that cannot be made: its nearest existing folder is read-only."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise BundleError(read_only_line(str(existing), "not writable", bundle_root))


def records_parent(parser: Any, root: Path) -> Path:
    """The folder of the bundle's run records: ``<output_dir>/monai_fast``, else ``<bundle_dir>/eval/monai_fast``."""
    if "output_dir" in parser:
        try:
            out = parser.get_parsed_content("output_dir")
            if isinstance(out, (str, os.PathLike)):
                return Path(out) / RECORDS
        except Exception as err:  # noqa: BLE001 - an output_dir expression the parser cannot evaluate yet
            logger.info("bundle: output_dir could not be read (%s); the record goes to %s/eval", err, root)
    return root / "eval" / RECORDS


def raised_by_logging_config(e: BaseException) -> bool:
    """Whether ``e`` came from applying a logging file (``logging.config.fileConfig`` or MONAI's check of it)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(Path(f.filename).match("logging/config.py") for f in frames) or "logging config file" in str(e)


_MISSING_REF = re.compile(r"the referring item `@([^`]+)` is not defined|can not find expected ID '([^']+)'")
_COMPONENT = re.compile(r"Failed to instantiate component '([^']+)'")
_TRANSFORM = re.compile(r"applying transform <([\w.]+)")
_ERROR_LINE = re.compile(r"^\w+(?:Error|Exception): .+$", re.MULTILINE)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the errors it was raised from, outermost first."""
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not c for c in out):
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def user_error_line(e: BaseException, parser: Any, root: Path, files: Sequence[Path]) -> str | None:
    """The one line for a bundle that fails on the user's side (an undefined reference, a bad argument, an empty
    data set, a missing file, a bad data item, a read-only folder), found in ``e``'s chain; else ``None``."""
    from monai_fast.data.items import DataItemError, item_line

    chain = _chain(e)
    texts = [str(c) for c in chain]
    component = next((m.group(1).rsplit(".", 1)[-1] for t in texts if (m := _COMPONENT.search(t))), None)
    built = f" (building {component})" if component else ""
    if ref := next(filter(None, map(_MISSING_REF.search, texts)), None):
        name = (ref.group(1) or ref.group(2)).replace("::", "#")
        near = difflib.get_close_matches(name, config_ids(parser.get()), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('@' + n for n in near)}?" if near else ""
        return f"the config ({', '.join(f.name for f in files)}) refers to @{name}, which it does not define{hint}"
    for cur in chain:
        if isinstance(cur, TypeError) and "unexpected keyword argument" in str(cur):
            return f"a component of the config takes no such argument{built}: {cur}"
    for cur in chain:
        if isinstance(cur, DataItemError):
            return f"bad data: {item_line(cur)}"
    for cur in chain:
        if isinstance(cur, ValueError) and "num_samples=0" in str(cur):
            data = parser.get("dataset_dir")
            read = f": dataset_dir {data} holds no items it lists" if isinstance(data, str) else ""
            return f"a data set of the config is empty{built}{read} (or too few for its validation split)"
    for cur in chain:
        if isinstance(cur, OSError) and cur.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            target = os.fsdecode(cur.filename) if cur.filename is not None else str(cur)
            return read_only_line(target, os.strerror(cur.errno), parser.get("bundle_root", str(root)))
    missing = [c for c in chain if isinstance(c, FileNotFoundError)]
    if missing:
        named = next((c for c in missing if c.filename is not None), None)
        return (f"{os.fsdecode(named.filename)}: no such file" if named else str(missing[0])) + built
    transform = next((m.group(1).rsplit(".", 1)[-1] for t in texts if (m := _TRANSFORM.search(t))), None)
    if transform is not None:  # MONAI's own loader: the first error in the chain's text is the cause
        causes = [m.group(0) for t in reversed(texts) for m in _ERROR_LINE.finditer(t)]
        cause = causes[0] if causes else f"{type(chain[-1]).__name__}: {chain[-1]}"
        return f"bad data: {transform} failed: {cause}"
    return None


@contextmanager
def named_user_errors(parser: Any, root: Path, files: Sequence[Path]) -> Iterator[None]:
    """Turn a user's mistake raised while the bundle builds or trains into a one-line `BundleError`."""
    try:
        yield
    except BundleError:
        raise
    except Exception as e:
        line = user_error_line(e, parser, root, files)
        if line is None:
            raise
        raise BundleError(line) from e
