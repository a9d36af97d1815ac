"""The torchrun command line and rendezvous messages of ``monai-fast launch`` (docs/distributed.md)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import socket
import threading
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_RDZV_TIMEOUT_S",
    "STORE_ANSWER_S",
    "LaunchSpec",
    "rendezvous_failure",
    "rendezvous_timeout_message",
    "rendezvous_wait_line",
    "torchrun_args",
    "torchrun_env",
    "unanswered_endpoint_message",
]

DEFAULT_MASTER_PORT = 29500  #: torchrun's own default for ``--master-port``
#: how long ``monai-fast launch`` waits for the rendezvous (torchrun's c10d join time-out)
DEFAULT_RDZV_TIMEOUT_S = 600.0
_TORCHRUN_JOIN_TIMEOUT_S = 600  # torchrun's c10d join_timeout when --rdzv-conf does not set one
STORE_ANSWER_S = 10.0  #: how long an endpoint that accepts connections has to answer as a rendezvous store


@dataclass(frozen=True)
class LaunchSpec:
    """Where ``monai-fast launch`` starts its ranks: this node only, or one node of several.

    One node (torchrun ``--standalone``), a static rendezvous at node 0 or a c10d one. All problems
    are named in one `ValueError`, each by its flag, before anything starts (docs/distributed.md).

    Args:
        nproc, nnodes: ranks on this node (one per GPU); nodes in the job.
        node_rank, master_addr, master_port: the static form's node index, node 0's address and port.
        rdzv_endpoint, rdzv_id: the c10d form's ``HOST:PORT`` and job name.
        max_restarts: restarts of every rank when one dies (several nodes need the c10d form).
        rdzv_timeout_s: seconds to wait for the rendezvous before one line names the endpoint.

    Example:
        >>> spec = LaunchSpec(nproc=4, nnodes=2, node_rank=1, master_addr="10.0.0.1")
    """

    nproc: int = 2
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S

    def __post_init__(self) -> None:
        problems = _count_problems(self) + (
            _c10d_problems(self) if self.rdzv_endpoint or self.rdzv_id else _static_problems(self)
        )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def form(self) -> str:
        """``"standalone"`` (one node), ``"static"`` (``--master-addr``) or ``"c10d"`` (``--rdzv-endpoint``)."""
        if self.rdzv_endpoint:
            return "c10d"
        return "static" if self.master_addr else "standalone"


def _count_problems(spec: LaunchSpec) -> list[str]:
    problems = [f"--nproc must be >= 1, got {spec.nproc}"] if spec.nproc < 1 else []
    if spec.nnodes < 1:
        problems.append(f"--nnodes must be >= 1, got {spec.nnodes}")
    if spec.max_restarts < 0:
        problems.append(f"--max-restarts must be >= 0, got {spec.max_restarts}")
    if not spec.rdzv_timeout_s > 0:
        problems.append(f"--rdzv-timeout must be > 0 seconds, got {spec.rdzv_timeout_s}")
    elif spec.max_restarts and spec.nnodes > 1 and not spec.rdzv_endpoint:
        problems.append(
            f"--max-restarts {spec.max_restarts} across {spec.nnodes} nodes needs the c10d rendezvous "
            "(--rdzv-endpoint HOST:PORT --rdzv-id JOB): a --master-addr (static) rendezvous has no rounds in which "
            "the nodes' restarts meet"
        )
    return problems


def _port_problem(flag: str, port: int) -> list[str]:
    return [] if 1 <= port <= 65535 else [f"{flag} {port} is not a TCP port (1-65535)"]


def _static_problems(spec: LaunchSpec) -> list[str]:
    problems: list[str] = []
    if spec.node_rank is not None and not 0 <= spec.node_rank < max(spec.nnodes, 1):
        problems.append(
            f"--node-rank {spec.node_rank} must be below --nnodes {spec.nnodes} (nodes are numbered "
            f"0 to {max(spec.nnodes, 1) - 1}, 0 on the --master-addr host)"
        )
    if spec.master_addr is not None and (not spec.master_addr.strip() or spec.master_addr.count(":") == 1):
        problems.append(
            f"--master-addr {spec.master_addr!r} is not a host name or address"
            + (": give the port with --master-port" if ":" in spec.master_addr else "")
        )
    if spec.master_port is not None:
        problems += _port_problem("--master-port", spec.master_port)
    if spec.nnodes > 1 and spec.master_addr is None:
        problems.append(
            f"--nnodes {spec.nnodes} needs where the nodes meet: --master-addr HOST --node-rank I "
            "(static), or --rdzv-endpoint HOST:PORT --rdzv-id JOB (c10d)"
        )
    elif spec.nnodes > 1 and spec.node_rank is None:
        problems.append(
            f"--nnodes {spec.nnodes} with --master-addr needs this node's --node-rank (0 to {spec.nnodes - 1})"
        )
    elif spec.master_addr is None and (spec.node_rank or spec.master_port is not None):
        problems.append("--node-rank and --master-port need --master-addr (node 0's address)")
    return problems


def _c10d_problems(spec: LaunchSpec) -> list[str]:
    given = {"--master-addr": spec.master_addr, "--master-port": spec.master_port, "--node-rank": spec.node_rank}
    static = [flag for flag, v in given.items() if v is not None]
    problems: list[str] = []
    if static:
        problems.append(
            f"{' and '.join(static)} cannot be mixed with the c10d rendezvous (--rdzv-endpoint, --rdzv-id): "
            "use one form; under c10d torchrun numbers the nodes"
        )
    if not spec.rdzv_endpoint:
        return problems + ["--rdzv-id needs --rdzv-endpoint HOST:PORT"]
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        problems.append(f"--rdzv-endpoint {spec.rdzv_endpoint!r} is not HOST:PORT (the port is required)")
    else:
        problems += _port_problem("--rdzv-endpoint's port", int(port))
    if not spec.rdzv_id or not spec.rdzv_id.strip():
        problems.append("--rdzv-endpoint needs --rdzv-id JOB, the same on every node (and new for each job)")
    return problems


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """torchrun's options for ``spec``: where the nodes meet, ranks per node, restarts."""
    nnodes = f"--nnodes={spec.nnodes}"
    if spec.form == "c10d":
        where = [nnodes, "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id}"]
        join_timeout = math.ceil(spec.rdzv_timeout_s)
        if join_timeout != _TORCHRUN_JOIN_TIMEOUT_S:  # only what differs from torchrun's own default
            where.append(f"--rdzv-conf=join_timeout={join_timeout}")
    elif spec.form == "static":
        where = [nnodes, f"--node-rank={spec.node_rank or 0}", f"--master-addr={spec.master_addr}"]
        where += [f"--master-port={spec.master_port or DEFAULT_MASTER_PORT}", "--rdzv-backend=static"]
    else:
        where = ["--standalone"]
    return [*where, f"--nproc-per-node={spec.nproc}", f"--max-restarts={spec.max_restarts}", "--monitor-interval=1"]


def torchrun_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment variables torchrun needs for ``spec``: with restarts, a TCP store per round (a shared one keeps
    stale process-group keys, and a restarted rank 0 fails to connect)."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if spec.max_restarts else {}


def rendezvous_failure(error_file: str | os.PathLike, spec: LaunchSpec) -> str | None:
    """What a failed torchrun's error file (``TORCHELASTIC_ERROR_FILE``) says about its c10d rendezvous, in one line.

    A lost host node (``RendezvousConnectionError``: no restart brings the job back) or a join
    time-out (``RendezvousTimeoutError``); anything else (a rank's own error): ``None``.
    """
    if spec.form != "c10d":
        return None
    try:
        with open(error_file) as f:
            message = str(json.load(f).get("message", {}).get("message", ""))
    except (OSError, ValueError, AttributeError):
        return None
    if message.startswith("RendezvousConnectionError"):
        return (
            f"the c10d rendezvous at {spec.rdzv_endpoint} is gone: its host node (the one whose launcher first bound "
            "--rdzv-endpoint) was lost or stopped, and the job with it (--max-restarts cannot help: the restarts meet "
            "there). Start the launcher on every node again with the same command; a script with Preemption resumes "
            "from its latest checkpoint"
        )
    if message.startswith("RendezvousTimeoutError"):
        return (
            f"not all --nnodes {spec.nnodes} nodes joined the c10d rendezvous at {spec.rdzv_endpoint} (--rdzv-id "
            f"{spec.rdzv_id}) within --rdzv-timeout {spec.rdzv_timeout_s:g} s: start the launcher on every node, "
            "with the same --rdzv-endpoint and --rdzv-id"
        )
    return None


def _meeting_point(spec: LaunchSpec) -> tuple[str, str, str, str]:
    """``HOST:PORT`` where this node's launcher meets the others, its host, its port, and the flag giving the port."""
    if spec.form == "c10d":
        where, flag = str(spec.rdzv_endpoint), "--rdzv-endpoint"
    else:
        where, flag = f"{spec.master_addr}:{spec.master_port or DEFAULT_MASTER_PORT}", "--master-port"
    host, _, port = where.rpartition(":")
    return where, host, port, flag


def rendezvous_wait_line(spec: LaunchSpec) -> str | None:
    """The line ``monai-fast launch`` prints before it waits for other nodes; ``None`` on one node alone."""
    if spec.form == "standalone":
        return None
    nodes = f"{spec.nnodes} node{'s' if spec.nnodes != 1 else ''}"
    who = f"--rdzv-id {spec.rdzv_id}" if spec.form == "c10d" else f"this one --node-rank {spec.node_rank}"
    return (
        f"waiting for the rendezvous at {_meeting_point(spec)[0]} ({nodes}, {who}) "
        f"(up to {spec.rdzv_timeout_s:g} s; --rdzv-timeout)"
    )


def _tcp_answer(host: str, port: int, timeout_s: float) -> str:
    """What a plain TCP connection to ``host:port`` finds: ``"accepts"``, ``"refused"`` or ``"unreachable"``."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return "accepts"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"


def unanswered_endpoint_message(spec: LaunchSpec, answer_s: float = STORE_ANSWER_S) -> str | None:
    """One line when the meeting point accepts connections but is no rendezvous store; ``None`` otherwise.

    torch's store client waits forever on a program that accepts and never answers: a `TCPStore` client on a
    daemon thread probes the endpoint for ``answer_s`` (at most ``--rdzv-timeout``) first.
    """
    if spec.form == "standalone":
        return None
    where, host, port, flag = _meeting_point(spec)
    bound = min(answer_s, spec.rdzv_timeout_s)
    if _tcp_answer(host, int(port), min(bound, 2.0)) != "accepts":
        return None  # refused or unreachable: torchrun waits for the host node within --rdzv-timeout
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            torch.distributed.TCPStore(
                host.strip("[]"), int(port), is_master=False, timeout=dt.timedelta(seconds=bound)
            )
            outcome.append(None)
        except Exception as e:  # a store client's error: the endpoint is not a store either
            outcome.append(e)

    thread = threading.Thread(target=probe, name="monai-fast-store-probe", daemon=True)
    thread.start()
    thread.join(bound)
    if outcome and outcome[0] is None:
        return None
    found = (
        f"did not answer as a rendezvous store within {bound:g} s"
        if not outcome
        else f"is not a rendezvous store ({type(outcome[0]).__name__}: {str(outcome[0]).splitlines()[0][:200]})"
    )
    return (
        f"{where} accepts connections but {found}: another program holds that port; give {flag} a free port "
        "(or stop that program)"
    )


def rendezvous_timeout_message(spec: LaunchSpec, probe_s: float = 2.0) -> str:
    """One line saying that no rendezvous formed within ``spec.rdzv_timeout_s``, what the endpoint does, the remedy."""
    where, host, port, flag = _meeting_point(spec)
    head = f"no rendezvous at {where} within --rdzv-timeout {spec.rdzv_timeout_s:g} s"
    answer = _tcp_answer(host, int(port), probe_s)
    if answer == "accepts" and spec.nnodes == 1:
        return (
            f"{head}: {where} accepts connections but never answered as a rendezvous store: another program holds "
            f"that port; give {flag} a free port"
        )
    if answer == "accepts":
        return (
            f"{head}: {where} accepts connections but the {spec.nnodes} nodes did not all meet there: start the "
            f"launcher on every node with the same options, and check that no other program holds port {port} "
            f"on {host} (then give {flag} a free port)"
        )
    if answer == "refused":
        return (
            f"{head}: nothing listens at {where}: start the launcher on {host} (it hosts the rendezvous), "
            f"or correct the address and port"
        )
    return f"{head}: {host} cannot be reached on port {port}: check the address, the network and the firewall"
