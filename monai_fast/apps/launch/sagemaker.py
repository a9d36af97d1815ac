"""The SageMaker training toolkit's environment, read in one place; and the torchrun command of a multi-host job."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MASTER_PORT",
    "SageMakerEnv",
    "SageMakerEnvError",
    "decode_hyperparameters",
    "read_sagemaker_env",
    "torchrun_command",
]

#: the rendezvous port of the toolkit's torchrun runner
MASTER_PORT = 7777
DEFAULT_CONFIG_DIR = "/opt/ml/input/config"


class SageMakerEnvError(ValueError):
    """A SageMaker variable or file holds something unusable; ``name`` is the variable (or file)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


@dataclass(frozen=True)
class SageMakerEnv:
    """What the toolkit's environment says; every field ``None`` (or empty) outside SageMaker.

    Attributes:
        training_dir, model_dir, output_data_dir: ``SM_CHANNEL_TRAINING``, ``SM_MODEL_DIR``, ``SM_OUTPUT_DATA_DIR``.
        channels: every input channel's folder by channel name (``SM_CHANNEL_<NAME>``, lower case).
        tensorboard_dir: where TensorBoard events go for SageMaker to collect.
        checkpoint_dir: ``/opt/ml/checkpoints`` when it exists (SageMaker syncs it and restores it on a spot restart).
        hyperparameters: ``SM_HPS``, else ``hyperparameters.json``, values decoded (`decode_hyperparameters()`).
        hyperparameters_from: which of the two they came from (for messages).
        num_gpus, hosts, current_host: ``SM_NUM_GPUS``, ``SM_HOSTS``, ``SM_CURRENT_HOST``.
        variables: the names of the ``SM_*`` variables set.

    Example:
        >>> read_sagemaker_env({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}).node_rank
        1
    """

    training_dir: Path | None = None
    channels: dict[str, Path] = field(default_factory=dict)
    model_dir: Path | None = None
    output_data_dir: Path | None = None
    tensorboard_dir: Path | None = None
    checkpoint_dir: Path | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    hyperparameters_from: str = ""
    num_gpus: int | None = None
    hosts: tuple[str, ...] = ()
    current_host: str | None = None
    variables: tuple[str, ...] = ()

    @property
    def present(self) -> bool:
        """Whether any SageMaker variable (``SM_*``) or hyperparameters file was found."""
        return bool(self.variables) or self != SageMakerEnv()

    def channel_dir(self, name: str | None = None) -> Path:
        """The folder of the input channel ``name``; ``None``: the only channel, else ``training``.

        Raises:
            SageMakerEnvError: no such channel, or several and none named, naming the variables read.
        """
        found = ", ".join(f"SM_CHANNEL_{c.upper()}={p}" for c, p in sorted(self.channels.items())) or "none set"
        if name is not None:
            if name.lower() not in self.channels:
                raise SageMakerEnvError(f"SM_CHANNEL_{name.upper()}", f"no input channel {name!r} (channels: {found})")
            return self.channels[name.lower()]
        if len(self.channels) == 1:
            return next(iter(self.channels.values()))
        if "training" in self.channels:
            return self.channels["training"]
        if not self.channels:
            why = "none of SM_CHANNELS and SM_CHANNEL_* is set, and synthetic data do not stand in for a job's data"
            raise SageMakerEnvError("SM_CHANNEL_<NAME>", f"no input channel: {why}")
        why = f"several input channels and none named 'training' ({found}): name one with --channel"
        raise SageMakerEnvError("SM_CHANNEL_<NAME>", why)

    def describe(self) -> str:
        """One line on the job: its hosts, GPUs and hyperparameters, saying which were not given."""
        hosts = f"host {self.current_host} of {len(self.hosts)} ({', '.join(self.hosts)})"
        hosts = hosts if self.hosts else "one host (SM_HOSTS not set)"
        gpus = "GPUs: SM_NUM_GPUS not set" if self.num_gpus is None else f"{self.num_gpus} GPU(s)"
        channels = ", ".join(f"{c}={p}" for c, p in sorted(self.channels.items())) or "none"
        hps = "from " + self.hyperparameters_from if self.hyperparameters_from else "none"
        return f"{hosts}, {gpus}, channels: {channels}, hyperparameters: {hps}"

    @property
    def node_rank(self) -> int:
        """This host's place in `hosts` (0 on one host)."""
        return self.hosts.index(self.current_host) if self.current_host in self.hosts else 0


def decode_hyperparameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Each value JSON-decoded where it is a string that decodes, else kept (the toolkit's rule)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = json.loads(value)
        out[str(key)] = value
    return out


def _json(environ: Mapping[str, str], name: str, kind: type) -> Any:
    try:
        value = json.loads(environ[name])
    except ValueError as e:
        raise SageMakerEnvError(name, f"is not JSON ({e}): {environ[name]!r}") from None
    if not isinstance(value, kind):
        raise SageMakerEnvError(name, f"must be a JSON {kind.__name__}, got {environ[name]!r}")
    return value


def _hyperparameters(environ: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    if "SM_HPS" in environ:
        return decode_hyperparameters(_json(environ, "SM_HPS", dict)), "SM_HPS"
    path = Path(environ.get("SM_INPUT_CONFIG_DIR", DEFAULT_CONFIG_DIR)) / "hyperparameters.json"
    if not path.is_file():
        return {}, ""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SageMakerEnvError(str(path), f"cannot be read as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SageMakerEnvError(str(path), "must hold a JSON object of hyperparameters")
    return decode_hyperparameters(raw), str(path)


def _channels(environ: Mapping[str, str]) -> dict[str, Path]:
    """Every ``SM_CHANNEL_<NAME>`` with a value, by channel name in lower case (the toolkit upper-cases it)."""
    prefix = "SM_CHANNEL_"
    return {k[len(prefix) :].lower(): Path(v) for k, v in sorted(environ.items()) if k.startswith(prefix) and v}


def _hosts(environ: Mapping[str, str]) -> tuple[tuple[str, ...], str | None]:
    hosts = tuple(_json(environ, "SM_HOSTS", list)) if "SM_HOSTS" in environ else ()
    if not all(isinstance(h, str) and h for h in hosts):
        raise SageMakerEnvError("SM_HOSTS", f"must list host names, got {environ['SM_HOSTS']!r}")
    current = environ.get("SM_CURRENT_HOST")
    if hosts and current not in hosts:
        raise SageMakerEnvError("SM_CURRENT_HOST", f"{current!r} is not one of SM_HOSTS {list(hosts)}")
    return hosts, current


def read_sagemaker_env(environ: Mapping[str, str] | None = None) -> SageMakerEnv:
    """The toolkit's variables from ``environ`` (default: this process's environment).

    Raises:
        SageMakerEnvError: naming the variable (or file) that holds something unusable.
    """
    environ = os.environ if environ is None else environ

    def path(name: str) -> Path | None:
        return Path(environ[name]) if environ.get(name) else None

    num_gpus = None
    if "SM_NUM_GPUS" in environ:
        try:
            num_gpus = int(environ["SM_NUM_GPUS"])
        except ValueError:
            raise SageMakerEnvError("SM_NUM_GPUS", f"must be a whole number, got {environ['SM_NUM_GPUS']!r}") from None
        if num_gpus < 0:
            raise SageMakerEnvError("SM_NUM_GPUS", f"must be >= 0, got {num_gpus}")
    hps, hps_from = _hyperparameters(environ)
    hosts, current = _hosts(environ)
    output_data, model_dir = path("SM_OUTPUT_DATA_DIR"), path("SM_MODEL_DIR")
    output = path("SM_OUTPUT_DIR") or output_data
    checkpoints = model_dir.parent / "checkpoints" if model_dir is not None else None  # SageMaker's, if the job has one
    return SageMakerEnv(
        training_dir=path("SM_CHANNEL_TRAINING"),
        channels=_channels(environ),
        variables=tuple(sorted(k for k in environ if k.startswith("SM_"))),
        model_dir=model_dir,
        output_data_dir=output_data,
        tensorboard_dir=output / "tensorboard" if output else None,
        hyperparameters=hps,
        hyperparameters_from=hps_from,
        num_gpus=num_gpus,
        hosts=hosts,
        current_host=current,
        checkpoint_dir=checkpoints if checkpoints is not None and checkpoints.is_dir() else None,
    )


def torchrun_command(env: SageMakerEnv, command: Sequence[str], nproc_per_node: int | None = None) -> list[str]:
    """The torchrun line that starts ``command`` on this host of ``env``'s job, meeting at the first host.

    Args:
        env: the job (its hosts and this host's name).
        command: what each rank runs, as arguments of ``python`` (``["-m", "pkg", ...]`` or a script).
        nproc_per_node: processes on this host; ``None``: one per GPU (``SM_NUM_GPUS``), at least one.
    """
    if len(env.hosts) < 2:
        raise SageMakerEnvError("SM_HOSTS", f"a rendezvous needs two or more hosts, got {list(env.hosts)}")
    nproc = nproc_per_node if nproc_per_node is not None else max(env.num_gpus or 0, 1)
    args = [("--nnodes", len(env.hosts)), ("--nproc_per_node", nproc), ("--master_addr", env.hosts[0])]
    args += [("--master_port", MASTER_PORT), ("--node_rank", env.node_rank)]
    return [sys.executable, "-m", "torch.distributed.run", *(str(a) for pair in args for a in pair), *command]
