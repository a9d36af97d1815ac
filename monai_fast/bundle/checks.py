"""A bundle's files, config ids and overrides checked, as MONAI's ``ConfigParser`` reads them, before anything
runs: each refusal is one line naming its fault."""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TRAIN_CONFIG_NAMES",
    "BundleError",
    "bundle_config_files",
    "check_component_packages",
    "check_config_files",
    "check_engine",
    "check_expressions",
    "check_overrides",
    "config_ids",
    "config_items",
    "config_targets",
    "parse_overrides",
    "require_yaml_reader",
]

TRAIN_CONFIG_NAMES = ("train.json", "train.yaml", "train.yml")  #: the train config a bundle folder is read from
META = "_meta_"  #: the id MONAI's workflow puts the meta file under


class BundleError(ValueError):
    """A bundle that cannot be run as asked: the message names the file, folder or config id at fault."""


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """Overrides as ``monai.bundle`` takes them: ``--id value``, ``--id=value`` or ``id=value``.

    Values are read as JSON, then as a Python literal, else kept as text (as are ``%``, ``@`` and ``$`` values).

    Raises:
        BundleError: a token that is neither form, or an option without a value, named.

    Examples:
        >>> parse_overrides(["--train#trainer#max_epochs", "2", "device=$torch.device('cpu')"])
        {'train#trainer#max_epochs': 2, 'device': "$torch.device('cpu')"}
    """
    out: dict[str, Any] = {}
    left = list(tokens)[::-1]  # the tokens not read yet, the next one last
    while left:
        tok = left.pop()
        if tok.startswith("--"):
            key, has_value, value = tok[2:].partition("=")
            if not has_value:
                if not left or left[-1].startswith("--"):
                    raise BundleError(f"override {tok} has no value (write {tok} VALUE or {tok}=VALUE)")
                value = left.pop()
        elif "=" in tok and not tok.startswith("="):
            key, value = tok.split("=", 1)
        else:
            raise BundleError(f"cannot read override {tok!r}: write id=value or --id value")
        if not key:
            raise BundleError(f"override {tok!r} names no config id")
        out[key] = _value(value)
    return out


def _value(text: str) -> Any:
    if not text.startswith(("$", "%", "@")):
        for read in (json.loads, ast.literal_eval):
            with contextlib.suppress(ValueError, SyntaxError):
                return read(text)
    return text


def bundle_config_files(bundle_dir: str | os.PathLike, config_files: str | Sequence[str] | None = None) -> list[Path]:
    """The config files to merge, each checked to exist; default ``configs/train.json`` (or ``.yaml``).

    ``config_files`` may be a list, or a string as ``monai.bundle`` takes it (one path, or ``"['a.json','b.json']"``).
    A relative path is found in the working directory first, then in the bundle folder.

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
    """Raise `MissingExtraError` naming the first YAML file among ``files`` when pyyaml is not installed."""
    from monai_fast.extras import require

    for f in files:
        if Path(f).suffix in (".yaml", ".yml"):
            require("yaml", extra="bundle", feature=f"reading the YAML config {f}")
            return


def check_config_files(files: Sequence[str | os.PathLike]) -> None:
    """Read each config file as MONAI does and raise a `BundleError` naming the first that is not valid (a syntax
    error with its file, line and column, a repeated key, an unreadable file)."""
    from monai.bundle import ConfigParser
    from monai.utils import optional_import

    yaml, has_yaml = optional_import("yaml")  # without pyyaml (the bundle extra) MONAI reads JSON configs only
    yaml_error: type[Exception] | tuple[()] = yaml.YAMLError if has_yaml else ()
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


def check_expressions(files: Sequence[str | os.PathLike], overrides: Mapping[str, Any] | None = None) -> None:
    """Refuse (`BundleError`: its id, where it is written, Python's reason) a ``$`` expression of the merged config
    or of an override that is not valid Python, before MONAI reaches it."""
    from monai.bundle import ConfigParser, ReferenceResolver

    where = f"the config ({', '.join(Path(f).name for f in files)})"
    sources = {where: ConfigParser.load_config_files([str(f) for f in files]), "the override": dict(overrides or {})}
    for source, config in sources.items():
        for cid, value in config_items(config):
            if not (isinstance(value, str) and value.startswith("$")):
                continue
            code = ReferenceResolver.id_matcher.sub("_ref", ReferenceResolver.normalize_id(value[1:]))
            try:
                ast.parse(code)
            except SyntaxError as err:
                raise BundleError(f"{source} at {cid}: {value} is not valid Python: {err.msg}") from None


def config_items(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every id of a config, in MONAI's ``a#b#0`` form, with what it holds (parents before their children)."""
    if isinstance(config, Mapping):
        items: Any = config.items()
    elif isinstance(config, list):
        items = enumerate(config)
    else:
        return
    for key, value in items:
        cid = f"{prefix}#{key}" if prefix else str(key)
        yield cid, value
        yield from config_items(value, cid)


def config_ids(config: Any) -> list[str]:
    """Every id of a config, in MONAI's ``a#b#0`` form."""
    return [cid for cid, _ in config_items(config)]


def config_targets(config: Any) -> Iterator[tuple[str, str]]:
    """Every component of a config: its id and its ``_target_``."""
    for cid, value in config_items(config):
        if isinstance(value, Mapping) and isinstance(value.get("_target_"), str):
            yield cid, value["_target_"]


#: MONAI components of the Model Zoo's configs that need a package of an extra: (name part, module, extra)
_COMPONENT_PACKAGES = (("TensorBoard", "tensorboard", "bundle"),)


def check_component_packages(parser: Any) -> None:
    """Refuse (`MissingExtraError`) before anything is built a config whose components need a package that is
    not installed."""
    from monai_fast.extras import MissingExtraError, available

    for cid, target in config_targets(parser.get()):
        for part, module, extra in _COMPONENT_PACKAGES:
            if part in target and not available(module):
                raise MissingExtraError(module, extra, f"the config's {target.rsplit('.', 1)[-1]} ({cid})")


def check_overrides(
    files: Sequence[str | os.PathLike],
    overrides: Mapping[str, Any],
    new_keys: Sequence[str] = (),
    exempt: Sequence[str] = (),
) -> None:
    """Refuse (`BundleError`) an override of an id the merged config files do not have (with the nearest ids),
    unless declared new and under a parent the config has; a new argument of a component (under a ``_target_``)
    passes, its constructor checks it. Plain text where the config holds a number or a boolean (``epochs=two``),
    which MONAI would only trip over once training runs, is refused too; expressions and references pass."""
    from monai.bundle import ConfigParser, ReferenceResolver

    parser = ConfigParser(ConfigParser.load_config_files([str(f) for f in files]))
    names = ", ".join(Path(f).name for f in files)
    declared = {ReferenceResolver.normalize_id(k) for k in new_keys}
    seen: set[str] = set()
    for key, value in overrides.items():
        parent = ReferenceResolver.split_id(key, last=True)[0] if len(ReferenceResolver.split_id(key)) > 1 else ""
        new = ReferenceResolver.normalize_id(key) in declared
        seen.add(ReferenceResolver.normalize_id(key))
        if new and parent and parent not in parser and ReferenceResolver.normalize_id(parent) not in seen:
            raise BundleError(f"override {key!r} (--new-key): the config has no {parent!r} to hold it")
        if key in parser and isinstance(value, str) and value[:1] not in ("$", "@", "%"):
            held = parser.get(key)
            if isinstance(held, (bool, int, float)):
                raise BundleError(
                    f"override {key}={value}: the config ({names}) holds a {type(held).__name__} there ({held!r}), "
                    "not text: give one (or a $ expression)"
                )
        if key in exempt or key.startswith(META) or new or key in parser:
            continue  # the metadata (``_meta_#...``) is merged by the workflow, from the meta file
        component = parser.get(parent) if parent and parent in parser else None
        if isinstance(component, Mapping) and "_target_" in component:
            continue  # an argument of a component: its constructor refuses a name it does not take
        known = [i.replace("::", "#") for i in config_ids(parser.get())]
        near = difflib.get_close_matches(key.replace("::", "#"), known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise BundleError(
            f"override {key!r}: the config ({names}) has no such id{hint} (to add it, pass --new-key {key})"
        )


def check_engine(engine: Any, cid: str | None, option: str) -> None:
    """Refuse (`BundleError`) an id that names something else than an ignite engine."""
    from ignite.engine import Engine

    if not isinstance(engine, Engine):
        raise BundleError(
            f"the config's {cid!r} builds a {type(engine).__name__}, not an engine: name the engine's id with {option}"
        )
