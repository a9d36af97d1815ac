"""Run a MONAI bundle as ``python -m monai.bundle run`` does, with ``FastTraining`` on its engines.

A bundle (the Model Zoo's layout: ``configs/train.json`` or ``.yaml``, ``configs/metadata.json``,
``configs/logging.conf``) builds its ``SupervisedTrainer`` and ``SupervisedEvaluator`` from its
config. `run_bundle()` builds them the same way, through MONAI's public ``ConfigWorkflow``
(several config files merged as MONAI merges them, ``key=value`` overrides, the config's
``initialize`` / ``run`` / ``finalize`` sections), then, between ``initialize`` and ``run``,
attaches a `RecordHandler`, a
`TimeBreakdown` and `FastTraining` to the
trainer and evaluator it finds by the bundle conventions (``train#trainer``,
``validate#evaluator``) or by the ids given. With ``fast=False`` the bundle runs as published, with
the record only, for a side-by-side. The config's own objects are the ones attached to: the
``run`` section's ``$@train#trainer.run()`` resolves to the same trainer.

FastTraining's decisions are returned and printed by the command line whatever logging set-up the
bundle brings, and the doctor reads the record at the end.

Parsing a config runs the code in it (``_target_`` callables, ``$`` expressions), as MONAI's own
runner does: run bundles you trust.

Examples:
    >>> from monai_fast.bundle import run_bundle
    >>> result = run_bundle("spleen_ct_segmentation", overrides={"dataset_dir": "/data/Task09"})  # doctest: +SKIP
    >>> result.applied["precision"]["setting"]  # doctest: +SKIP
    'bf16'
"""

from __future__ import annotations

import ast
import difflib
import errno
import json
import logging
import os
import re
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BundleError",
    "BundleResult",
    "bundle_config_files",
    "check_config_files",
    "check_expressions",
    "check_overrides",
    "new_run_folder",
    "parse_overrides",
    "run_bundle",
]

logger = logging.getLogger("monai_fast.bundle")

TRAINER_ID = "train#trainer"  #: where the Model Zoo's train configs put the trainer
EVALUATOR_ID = "validate#evaluator"  #: and the evaluator
RUN_ID = "run"  #: the run section of the Model Zoo's train configs
LEGACY_RUN_ID = "training"  #: its older name, run when a config has no ``run`` section
TRAIN_CONFIG_NAMES = ("train.json", "train.yaml", "train.yml")  #: the train config a bundle folder is read from
RECORDS = "monai_fast"  #: the folder under the bundle's output folder that holds one record folder per run
FAST, PUBLISHED = "fast", "published"  #: the variants, as a run's record folder names them
ATTACH_CALL = "attach_fast("  #: what the fragment's ``initialize`` entry calls
META = "_meta_"  #: the id MONAI's workflow puts the meta file under


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

    Examples:
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
        raise BundleError(f"bundle folder {root} " + ("is a file, not a folder" if root.exists() else "does not exist"))
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


def check_config_files(files: Sequence[str | os.PathLike]) -> None:
    """Read each config file as MONAI does (``ConfigParser.load_config_file``) and name the first that is not valid.

    Raises:
        BundleError: a JSON or YAML syntax error (file, line, column), a repeated key or an unreadable file.
    """
    from monai.bundle import ConfigParser

    try:
        import yaml

        yaml_error: type[Exception] | tuple[()] = yaml.YAMLError
    except ImportError:  # without pyyaml (the bundle extra) MONAI reads JSON configs only
        yaml_error = ()
    for path in files:
        try:
            ConfigParser.load_config_file(path)
        except json.JSONDecodeError as err:
            raise BundleError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
        except yaml_error as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise BundleError(f"{where}: not valid YAML: {problem}") from None
        except (OSError, ValueError, UnicodeDecodeError) as err:  # MONAI's duplicate-key check raises ValueError
            raise BundleError(f"{path}: {err}") from None


def _raised_by_logging_config(e: BaseException) -> bool:
    """Whether ``e`` came from applying a logging file (``logging.config.fileConfig`` or MONAI's check of it)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(Path(f.filename).match("logging/config.py") for f in frames) or "logging config file" in str(e)


def _expressions(config: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every ``$`` expression of a config, with its id."""
    if isinstance(config, str):
        if config.startswith("$"):
            yield prefix, config[1:]
        return
    items = config.items() if isinstance(config, Mapping) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        yield from _expressions(value, f"{prefix}#{key}" if prefix else str(key))


def check_expressions(files: Sequence[str | os.PathLike], overrides: Mapping[str, Any] | None = None) -> None:
    """Refuse, before anything runs, a ``$`` expression of the merged config or of an override that is not
    valid Python.

    MONAI evaluates each expression only when it is reached (a ``run`` section's typo after the whole
    set-up); its references (``@train#trainer``) read as names here, as MONAI replaces them with one.

    Raises:
        BundleError: the id of the expression, where it is written and Python's reason.
    """
    from monai.bundle import ConfigParser, ReferenceResolver

    where = f"the config ({', '.join(Path(f).name for f in files)})"
    sources = [(where, _expressions(ConfigParser.load_config_files([str(f) for f in files])))]
    sources += [("the override", _expressions(value, key)) for key, value in (overrides or {}).items()]
    for source, expressions in sources:
        for cid, text in expressions:
            code = ReferenceResolver.id_matcher.sub("_ref", ReferenceResolver.normalize_id(text))
            try:
                ast.parse(code)
            except SyntaxError as err:
                raise BundleError(f"{source} at {cid}: ${text} is not valid Python: {err.msg}") from None


def _ids(config: Any, prefix: str = "") -> Iterator[str]:
    """Every id of a config, in MONAI's ``a#b#0`` form."""
    if isinstance(config, Mapping):
        items: Any = config.items()
    elif isinstance(config, list):
        items = enumerate(config)
    else:
        return
    for key, value in items:
        cid = f"{prefix}#{key}" if prefix else str(key)
        yield cid
        yield from _ids(value, cid)


#: MONAI components of the Model Zoo's configs that need a package of an extra: (name part, module, extra)
_COMPONENT_PACKAGES = (("TensorBoard", "tensorboard", "bundle"),)


def _check_component_packages(parser: Any) -> None:
    """Refuse, before anything is built, a config whose components need a package that is not installed.

    MONAI builds a ``TensorBoardStatsHandler`` only once the engines are made, after the data sets
    may have cached for minutes, and then fails with a traceback that names neither the package nor
    how to install it.

    Raises:
        MissingExtraError: naming the component, its config id and the extra that installs the package.
    """
    from monai_fast.extras import MissingExtraError, available

    config = parser.get()
    for cid in _ids(config):
        value = parser.get(cid)
        target = value.get("_target_") if isinstance(value, Mapping) else None
        if not isinstance(target, str):
            continue
        for part, module, extra in _COMPONENT_PACKAGES:
            if part in target and not available(module):
                raise MissingExtraError(module, extra, f"the config's {target.rsplit('.', 1)[-1]} ({cid})")


def check_overrides(
    files: Sequence[str | os.PathLike], keys: Sequence[str], new_keys: Sequence[str] = (), exempt: Sequence[str] = ()
) -> None:
    """Refuse an override of an id the merged config files do not have, unless it is declared new.

    The files are merged as MONAI merges them (``ConfigParser.load_config_files``) and each id is looked
    up as MONAI looks it up (``id in parser``), so ``train#trainer#max_epochs`` and ``train::trainer::max_epochs``
    both name the same one. An id a user means to add is named in ``new_keys`` (``--new-key``). A new argument
    of a component (``network_def#init_features`` where ``network_def`` has a ``_target_``) passes: the
    component's constructor refuses a name it does not take, so it cannot be ignored.

    Raises:
        BundleError: the first unknown id, with the nearest ids the config has.
    """
    from monai.bundle import ConfigParser, ReferenceResolver

    parser = ConfigParser(ConfigParser.load_config_files([str(f) for f in files]))
    declared = {ReferenceResolver.normalize_id(k) for k in new_keys}
    for key in keys:
        if key in exempt or key.startswith(META) or ReferenceResolver.normalize_id(key) in declared or key in parser:
            continue  # the metadata (``_meta_#...``) is merged by the workflow, from the meta file
        parent = ReferenceResolver.split_id(key, last=True)[0] if len(ReferenceResolver.split_id(key)) > 1 else ""
        component = parser.get(parent) if parent and parent in parser else None
        if isinstance(component, Mapping) and "_target_" in component:
            continue  # an argument of a component: its constructor refuses a name it does not take
        known = [i.replace("::", "#") for i in _ids(parser.get())]
        near = difflib.get_close_matches(key.replace("::", "#"), known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise BundleError(
            f"override {key!r}: the config ({', '.join(Path(f).name for f in files)}) has no such id{hint} "
            f"(to add it, pass --new-key {key})"
        )


def new_run_folder(parent: str | os.PathLike, variant: str) -> Path:
    """Make this run's own record folder under ``parent``: ``<variant>-<YYYYmmdd-HHMMSS>`` (``-2``, ... when taken).

    Every process of a distributed run gets rank 0's folder, so the ranks' records stay together.
    """
    import torch.distributed as dist

    folder = Path(parent)
    if _rank() == 0:
        stamp = f"{variant}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            candidate = folder / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                candidate.mkdir()
                break
            except FileExistsError:
                continue
        folder = candidate
    if _world_size() > 1:
        shared = [str(folder)]
        dist.broadcast_object_list(shared, src=0)
        folder = Path(shared[0])
    return folder


def refuse_foreign_record(run_dir: str | os.PathLike, resume: bool) -> None:
    """Refuse a record folder that holds another run's record, unless this run resumes it.

    Raises:
        BundleError: naming the folder and the two ways on.
    """
    held = sorted(Path(run_dir).glob("record.rank*.jsonl"))
    if held and not resume:
        raise BundleError(
            f"run folder {run_dir} holds another run's record ({held[0].name}); "
            "name a new folder, leave --run-dir out for a folder of this run's own, or pass --resume to continue it"
        )


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
    """The one line for a bundle that fails on the user's side (its config, its data, its folder), found in
    ``e``'s chain as MONAI's parser and transforms raise it; ``None`` for another error.

    * a reference to an id the config does not define (``@loss`` where it says ``loss_fn``), with the nearest ids;
    * a component given an argument its constructor does not take (a misspelt override of one);
    * a data set with no items (torch's ``num_samples=0``), with the ``dataset_dir`` it read;
    * a file that does not exist (a data list naming a missing file);
    * a data item that cannot be loaded or transformed (a volume smaller than the patch): its one line;
    * a folder that cannot be written (a read-only bundle folder), with the way on: ``bundle_root=`` elsewhere.
    """
    from monai_fast.data.items import DataItemError, item_line

    chain = _chain(e)
    texts = [str(c) for c in chain]
    component = next((m.group(1).rsplit(".", 1)[-1] for t in texts if (m := _COMPONENT.search(t))), None)
    built = f" (building {component})" if component else ""
    for text in texts:
        ref = _MISSING_REF.search(text)
        if ref:
            name = (ref.group(1) or ref.group(2)).replace("::", "#")
            near = difflib.get_close_matches(name, list(_ids(parser.get())), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join('@' + n for n in near)}?" if near else ""
            where = ", ".join(f.name for f in files)
            return f"the config ({where}) refers to @{name}, which it does not define{hint}"
    for cur in chain:
        if isinstance(cur, TypeError) and "unexpected keyword argument" in str(cur):
            return f"a component of the config takes no such argument{built}: {cur}"
    for cur in chain:
        if isinstance(cur, DataItemError):
            return f"bad data: {item_line(cur)}"
    for cur in chain:
        if isinstance(cur, ValueError) and "num_samples=0" in str(cur):
            data = parser.get("dataset_dir") if "dataset_dir" in parser else None
            read = f": dataset_dir {data} holds no items it lists" if isinstance(data, str) else ""
            return f"a data set of the config is empty{built}{read} (or too few for its validation split)"
    for cur in chain:
        if isinstance(cur, OSError) and cur.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            target = os.fsdecode(cur.filename) if cur.filename is not None else str(cur)
            return _read_only(target, os.strerror(cur.errno), parser.get("bundle_root", str(root)))
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


def _read_only(target: str, why: str, bundle_root: str) -> str:
    """The line for a folder that cannot be written; the way on where it is under the bundle's ``bundle_root``."""
    if not Path(target).resolve().is_relative_to(Path(bundle_root).resolve()):
        return f"cannot write {target} ({why})"
    return (
        f"cannot write {target} ({why}): the bundle writes its outputs under its bundle_root ({bundle_root}); "
        "run with bundle_root=<a writable folder> (the configs are still read from the bundle folder)"
    )


def _check_writable(folder: Path, bundle_root: str) -> None:
    """Refuse, before any work, a record folder that cannot be made: its nearest existing folder is read-only.

    Raises:
        BundleError: naming the folder and the way on (``bundle_root=`` elsewhere).
    """
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise BundleError(_read_only(str(existing), "not writable", bundle_root))


@contextmanager
def _named_user_errors(parser: Any, root: Path, files: Sequence[Path]) -> Iterator[None]:
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


def _drop_fragment(parser: Any, init_id: str, files: Sequence[Path]) -> None:
    """Leave out of the ``initialize`` section the fragment's ``attach_fast`` entry: this run attaches once itself."""
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

    Args:
        bundle_dir: the bundle folder (``configs/`` inside). ``bundle_root`` is set to it unless an
            override sets it, so a bundle whose config says ``"bundle_root": "."`` runs from anywhere.
        config_files: see `bundle_config_files()`.
        meta_file: default ``configs/metadata.json`` when present.
        logging_file: default ``configs/logging.conf`` when present; ``False``: none.
        overrides: config id -> value, as ``monai.bundle run --id value`` (see `parse_overrides()`). An id the
            config files do not have is refused (a misspelt ``max_epoch`` would otherwise train the whole run),
            unless it is in ``new_keys``.
        fast: attach ``FastTraining``; ``False`` runs the bundle as published, with the record.
        fast_options: keyword arguments for ``FastTraining``.
        trainer_id: the trainer's config id.
        evaluator_id: the evaluator's config id; ``None``, or an id the config lacks while left at
            its default, runs without one.
        run_dir: where the run record goes; a folder holding another run's record is refused unless
            ``resume``. Default: a folder of this run's own, ``<output_dir>/monai_fast/<variant>-<time>``
            (``fast-20261128-101500``, ``published-...``; ``<bundle_dir>/eval`` when the config has no
            ``output_dir``), so side-by-side runs never share a record.
        init_id: the config's initialize section.
        run_id: the config's run section; left at ``"run"`` with a config that has only the older
            ``"training"`` section (as some Model Zoo bundles do), that one runs.
        final_id: the config's finalize section.
        doctor: read the record at the end and return the doctor's verdict (on rank 0, once every rank is done).
        on_applied: called with FastTraining's decisions once attached, before training (the CLI
            prints them there, whatever the bundle's logging does).
        new_keys: override ids the config does not have that the user adds on purpose.
        resume: continue the record in ``run_dir`` (a run resumed from its checkpoint) as its next segment.

    Returns:
        What the run did (`BundleResult`).

    Raises:
        BundleError: a missing or malformed file, an override or an id the config lacks, a record folder
            of another run, named before any training.
    """
    import torch
    from monai.bundle import ConfigWorkflow

    from monai_fast.bundle.checkpoints import atomic_checkpoints, config_checkpoint_savers
    from monai_fast.bundle.fragment import printed_decisions
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
    check_config_files([*files, *([meta] if meta is not None else [])])
    pairs = dict(overrides or {})
    check_overrides(files, list(pairs), new_keys, exempt=("bundle_root",))
    check_expressions(files, pairs)
    if run_dir is not None:  # checked by every rank before initialize's rendezvous, so before any rank writes
        refuse_foreign_record(run_dir, resume)
    pairs.setdefault("bundle_root", str(root))

    def make(run: str) -> Any:
        try:
            return ConfigWorkflow(
                config_file=[str(f) for f in files],
                meta_file=str(meta) if meta is not None else None,
                logging_file=str(logging_file) if logging_file else False,
                init_id=init_id,
                run_id=run,
                final_id=final_id,
                **pairs,
            )
        except Exception as e:  # the logging file is applied as the workflow is made: one it cannot apply, named
            if logging_file and _raised_by_logging_config(e):
                raise BundleError(f"logging file {logging_file}: {type(e).__name__}: {e}") from None
            raise

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
    _check_component_packages(parser)
    _drop_fragment(parser, init_id, files)
    if run_dir is None:
        _check_writable(_records_parent(parser, root), str(pairs["bundle_root"]))
    with _named_user_errors(parser, root, files):
        workflow.initialize()
        trainer = parser.get_parsed_content(trainer_id)
        evaluator = parser.get_parsed_content(evaluator_id) if evaluator_id is not None else None
    _check_engine(trainer, trainer_id, "--trainer-id")
    if evaluator is not None:
        _check_engine(evaluator, evaluator_id, "--evaluator-id")
    atomic_checkpoints(config_checkpoint_savers(parser))  # a full disk keeps the previous model.pt, named in one line
    with _named_user_errors(parser, root, files):
        if run_dir is not None:
            folder = Path(run_dir)
        else:
            folder = new_run_folder(_records_parent(parser, root), FAST if fast else PUBLISHED)
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
        if on_applied is not None:  # it shows the decisions: logged too, each would be shown twice
            with printed_decisions():
                handler.attach(trainer, evaluator)
        else:
            handler.attach(trainer, evaluator)
        result.applied = handler.applied
    if on_applied is not None:
        on_applied(result.applied)
    with _named_user_errors(parser, root, files):
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


def _check_engine(engine: Any, cid: str | None, option: str) -> None:
    """Refuse, before anything is attached, an id that names something else than an ignite engine.

    Raises:
        BundleError: naming the id, what it builds and the option that names the engine.
    """
    from ignite.engine import Engine

    if not isinstance(engine, Engine):
        raise BundleError(
            f"the config's {cid!r} builds a {type(engine).__name__}, not an engine: name the engine's id with {option}"
        )


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


def _records_parent(parser: Any, root: Path) -> Path:
    """The folder that holds the bundle's run records: ``<output_dir>/monai_fast``, else
    ``<bundle_dir>/eval/monai_fast``."""
    if "output_dir" in parser:
        try:
            out = parser.get_parsed_content("output_dir")
            if isinstance(out, (str, os.PathLike)):
                return Path(out) / RECORDS
        except Exception as err:  # noqa: BLE001 - an output_dir expression the parser cannot evaluate yet
            logger.info("bundle: output_dir could not be read (%s); the record goes to %s/eval", err, root)
    return root / "eval" / RECORDS


def _verdict(folder: Path) -> str | None:
    from monai_fast.report.doctor import doctor

    try:
        return doctor(folder).text()
    except (OSError, ValueError) as err:
        logger.warning("bundle: the doctor could not read %s (%s)", folder, err)
        return None
