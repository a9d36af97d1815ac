"""Drills on one machine: ``monai-fast launch`` processes as several nodes, and a rank killed with SIGKILL.

What a cluster does to a job, rehearsed on localhost with the real launcher (``python -m monai_fast.apps.cli
launch``, so torchrun, its rendezvous and `supervise()`):

- `run_local_nodes()` starts one launcher per "node", all meeting at ``127.0.0.1`` (a static
  rendezvous from `static_nodes()`, or any options you give), and waits for them. The ranks of
  different launchers talk over TCP as across nodes, but through loopback: no network is timed.
- `kill_drill()` runs a launcher with ``--max-restarts`` (or one per node, e.g. two at one c10d
  rendezvous), SIGKILLs one rank once the progress file shows a given iteration, and times how long
  torchrun's restart takes to bring the job back to its next completed iteration. The script appends
  each completed iteration number to a progress file (``tutorials/distributed_train.py
  --progress-file``); times come from polling it. Instead of a rank it can lose a whole node (its
  launcher's process tree, `kill_tree()`), then start a replacement with the same command; or the
  node holding the c10d rendezvous (`rdzv_host()`).

Launchers write into log files, never pipes (an orphaned rank could hold a pipe open), and a launcher
still running at the deadline gets SIGTERM, which it passes on to its ranks.

Examples:
    >>> from drill import static_nodes
    >>> static_nodes(2, 29400)[1]
    ['--nnodes', '2', '--master-addr', '127.0.0.1', '--master-port', '29400', '--node-rank', '1']
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

__all__ = [
    "KillDrill",
    "TimedRun",
    "kill_drill",
    "kill_tree",
    "launch",
    "rank_process",
    "rdzv_host",
    "read_progress",
    "run_local_nodes",
    "static_nodes",
    "timed_launch",
]

_POLL_S = 0.01


def launch(
    args: Sequence[str],
    log: str | os.PathLike,
    nproc: int = 2,
    grace_s: float = 10.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.Popen:
    """Start ``monai-fast launch --nproc NPROC --grace-s GRACE_S ARGS...`` with its output in ``log``.

    Args:
        args: launch options, then the script and its arguments.
        log: the file that takes stdout and stderr (a file, not a pipe an orphan could hold open).
        nproc: ranks on this "node".
        grace_s: how long the ranks may take to stop on SIGTERM before they are killed.
        env: variables added to this process's environment (``PYTHONUNBUFFERED=1`` always is).
        cwd: the launcher's working folder.
    """
    with open(log, "w") as f:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "monai_fast.apps.cli",
                "launch",
                "--nproc",
                str(nproc),
                "--grace-s",
                str(grace_s),
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:  # a hang: SIGTERM, which monai-fast launch passes on, then waits --grace-s
            p.send_signal(signal.SIGTERM)
            p.wait(60)


def static_nodes(nnodes: int, port: int, addr: str = "127.0.0.1") -> list[list[str]]:
    """Each node's ``monai-fast launch`` options for a static rendezvous at ``addr:port``."""
    common = ["--nnodes", str(nnodes), "--master-addr", addr, "--master-port", str(port)]
    return [[*common, "--node-rank", str(i)] for i in range(nnodes)]


def run_local_nodes(
    where: Sequence[Sequence[str]],
    script_and_args: Sequence[str],
    folder: str | os.PathLike,
    nproc: int = 1,
    timeout_s: float = 420.0,
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, str]]:
    """One ``monai-fast launch`` per entry of ``where`` (a node's options), ``nproc`` ranks each; wait for all.

    Returns:
        Each launcher's exit status and output (its log, ``FOLDER/node<I>.log``).

    Examples:
        >>> from monai_fast.apps.launch import free_port
        >>> run_local_nodes(static_nodes(2, free_port()), ["train.py"], "logs")  # doctest: +SKIP
        [(0, '...'), (0, '...')]
    """
    logs = [Path(folder, f"node{i}.log") for i in range(len(where))]
    procs = [
        launch(
            [*opts, *script_and_args],
            log,
            nproc=nproc,
            grace_s=5.0,
            env={"OMP_NUM_THREADS": "1", **(env or {})},
            cwd=folder,
        )
        for opts, log in zip(where, logs)
    ]
    try:
        for p in procs:
            p.wait(timeout_s)
    finally:
        _stop(procs)
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def read_progress(path: str | os.PathLike) -> list[int]:
    """The iteration numbers in a progress file (one per line), ``[]`` before it exists."""
    path = Path(path)
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def rank_process(launcher: subprocess.Popen, rank: str) -> psutil.Process:
    """The training process of ``rank`` under ``launcher`` (torchrun's child; not a data-loader worker)."""
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == rank and "torch.distributed.run" in " ".join(p.parent().cmdline()):
                return p
        except psutil.Error:
            continue
    raise RuntimeError(f"no rank {rank} under the launcher (pid {launcher.pid})")


@dataclass
class TimedRun:
    """A launcher run: its status, wall time, and when each iteration showed up in the progress file.

    ``seen`` pairs each progress line (an iteration number) with the seconds since the start at which
    it was first read (polled every 10 ms).
    """

    returncode: int
    wall_s: float
    seen: list[tuple[int, float]] = field(default_factory=list)
    log: str = ""

    @property
    def steps(self) -> list[int]:
        """Completed iteration numbers in the order written (a redone one appears twice)."""
        return [i for i, _ in self.seen]

    def iteration_s(self) -> float:
        """Median seconds between consecutive iterations (validation and restarts are the outliers it skips)."""
        gaps = sorted(b - a for (_, a), (_, b) in zip(self.seen, self.seen[1:]))
        return gaps[len(gaps) // 2] if gaps else float("nan")


@dataclass
class KillDrill(TimedRun):
    """A `kill_drill()`: a `TimedRun` and when the rank was killed, after which iteration."""

    killed_after: int = 0
    killed_at_s: float = 0.0
    returncodes: list[int] = field(
        default_factory=list
    )  # each node's launcher at the end (a replaced one: its replacement)

    @property
    def redone(self) -> int:
        """Iterations completed twice: before the kill, and again after the resume."""
        return len(self.steps) - len(set(self.steps))

    @property
    def restart_s(self) -> float:
        """Seconds from the SIGKILL to the first iteration completed after the resume (NaN: none was)."""
        after = [t for _, t in self.seen if t > self.killed_at_s]
        return after[0] - self.killed_at_s if after else float("nan")


class _Watch:
    """Polls a progress file, stamping each new line with the seconds since ``t0``."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0, self.seen = path, t0, []

    def poll(self) -> None:
        lines = read_progress(self.path)
        now = time.monotonic() - self.t0
        self.seen += [(i, now) for i in lines[len(self.seen) :]]

    def until(self, launchers: Sequence[subprocess.Popen], done, deadline: float, logs: Sequence[Path]) -> None:
        while not done():
            self.poll()
            if any(p.poll() is not None for p in launchers) or time.monotonic() > deadline:
                raise RuntimeError(
                    "a launcher ended or ran past its deadline before the drill's point: "
                    + "".join(log.read_text()[-3000:] for log in logs)
                )
            time.sleep(_POLL_S)


def _finish(launchers: Sequence[subprocess.Popen], watch: _Watch, deadline: float) -> list[int]:
    try:
        while any(p.poll() is None for p in launchers) and time.monotonic() < deadline:
            watch.poll()
            time.sleep(_POLL_S)
    finally:
        _stop(launchers)
    watch.poll()
    return [p.returncode for p in launchers]


def timed_launch(
    args: Sequence[str], progress: str | os.PathLike, log: str | os.PathLike, nproc: int = 2, timeout_s: float = 420.0
) -> TimedRun:
    """Run ``monai-fast launch ARGS`` to its end, stamping the progress file's iterations as they appear.

    Examples:
        >>> r = timed_launch(["train.py", "--progress-file", "p"], "p", "run.log")  # doctest: +SKIP
        >>> r.returncode, r.wall_s, r.steps  # doctest: +SKIP
        (0, 31.2, [1, 2, 3, 4])
    """
    t0 = time.monotonic()
    launcher = launch(args, log, nproc=nproc)
    watch = _Watch(Path(progress), t0)
    (rc,) = _finish([launcher], watch, t0 + timeout_s)
    return TimedRun(rc, time.monotonic() - t0, watch.seen, Path(log).read_text())


def rdzv_host(launchers: Sequence[subprocess.Popen], port: int) -> int:
    """Which launcher's torchrun holds the c10d rendezvous store (listens on ``port``); -1: none (yet)."""
    for i, launcher in enumerate(launchers):
        try:
            tree = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
        except psutil.Error:
            continue
        for p in tree:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                    return i
            except psutil.Error:
                continue
    return -1


def kill_tree(launcher: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once, as when its node is lost; reap it."""
    procs = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    launcher.wait(60)


def _rdzv_port(nodes: Sequence[Sequence[str]]) -> int:
    opts = list(nodes[0])
    if "--rdzv-endpoint" not in opts:
        raise ValueError(
            "losing a node needs the c10d rendezvous: give each node --rdzv-endpoint HOST:PORT --rdzv-id JOB"
        )
    return int(opts[opts.index("--rdzv-endpoint") + 1].rpartition(":")[2])


class _Nodes:
    """The launchers of a drill, one per node, each with a log ``LOG.node<I>.log`` (``LOG`` itself for one node)."""

    def __init__(
        self, nodes: Sequence[Sequence[str]], args: Sequence[str], log: Path, nproc: int, max_restarts: int
    ) -> None:
        self.nodes, self.nproc, self.logs, self.starts = nodes, nproc, [], [0] * len(nodes)
        self.args = ["--max-restarts", str(max_restarts), *args]
        self.base = log if len(nodes) == 1 else log.with_suffix("")
        self.launchers = [self._start(i) for i in range(len(nodes))]

    def _start(self, i: int) -> subprocess.Popen:
        log = self.base if len(self.nodes) == 1 else Path(f"{self.base}.node{i}{'.again' * self.starts[i]}.log")
        self.starts[i] += 1
        self.logs.append(log)
        return launch(
            [*self.nodes[i], *self.args],
            log,
            nproc=self.nproc,
            env={"OMP_NUM_THREADS": "1"} if len(self.nodes) > 1 else None,
        )

    def rank(self, rank: str) -> psutil.Process:
        for launcher in self.launchers:
            try:
                return rank_process(launcher, rank)
            except RuntimeError:
                continue
        raise RuntimeError(f"no rank {rank} under the launchers (pids {[p.pid for p in self.launchers]})")

    def aim(self, what: str, rank: str) -> Callable[[], None]:
        """Find what to lose now; the returned call SIGKILLs it at once (the slow search is done before the drill's
        point).

        ``what``: ``"rank"`` (that rank's process), ``"node"`` (the whole tree of a launcher that does not hold the
        c10d rendezvous, then the same command started again: its replacement) or ``"rdzv-host"`` (the tree that does).
        """
        if what == "rank":
            proc = self.rank(rank)
            return lambda: proc.send_signal(signal.SIGKILL)
        host = rdzv_host(self.launchers, _rdzv_port(self.nodes))
        if host < 0:
            raise RuntimeError(f"no launcher listens on the c10d rendezvous port {_rdzv_port(self.nodes)}")
        i = host if what == "rdzv-host" else next(k for k in range(len(self.launchers)) if k != host)

        def fire() -> None:
            kill_tree(self.launchers[i])
            if what == "node":  # a replacement node: the same command, joining the next rendezvous round
                self.launchers[i] = self._start(i)

        return fire

    def text(self) -> str:
        return (
            "".join(f"== {log.name}\n{log.read_text()}" for log in self.logs)
            if len(self.logs) > 1
            else self.logs[0].read_text()
        )


def kill_drill(
    args: Sequence[str],
    progress: str | os.PathLike,
    log: str | os.PathLike,
    kill_after: int,
    rank: str = "1",
    nproc: int = 2,
    max_restarts: int = 1,
    timeout_s: float = 420.0,
    nodes: Sequence[Sequence[str]] = ((),),
    lose: str = "rank",
) -> KillDrill:
    """``monai-fast launch --max-restarts N ARGS`` per node; once iteration ``kill_after`` completed, lose a part;
    run to the end.

    Args:
        args: the script and its arguments (a script that resumes from its checkpoints and appends each
            completed iteration to ``progress``).
        kill_after: the iteration after which the rank is killed (mid-epoch, if you want the hard case).
        nodes: each node's launch options (one launcher per entry, ``nproc`` ranks each), e.g. the same
            ``--nnodes 2 --rdzv-endpoint HOST:PORT --rdzv-id JOB`` twice; by default one node.
        lose: ``"rank"``: SIGKILL ``rank``; ``"node"``: SIGKILL the whole tree of a launcher that does not hold
            the c10d rendezvous (a lost node), then start the same command again (its replacement);
            ``"rdzv-host"``: SIGKILL the tree of the launcher that holds it, with no replacement.

    Raises:
        RuntimeError: a launcher ended, or ``timeout_s`` passed, before iteration ``kill_after``.

    Examples:
        >>> d = kill_drill(
        ...     ["train.py", "--save-every", "3", "--progress-file", "p"], "p", "run.log", kill_after=5
        ... )  # doctest: +SKIP
        >>> d.redone, round(d.restart_s, 1), d.returncode  # doctest: +SKIP
        (2, 14.3, 0)
    """
    if lose not in ("rank", "node", "rdzv-host"):
        raise ValueError(f"lose={lose!r}: one of 'rank', 'node', 'rdzv-host'")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    run = _Nodes(nodes, args, Path(log), nproc, max_restarts)
    watch = _Watch(Path(progress), t0)
    try:
        watch.until(run.launchers, lambda: len(watch.seen) >= 1, deadline, run.logs)  # the ranks and rendezvous are up
        fire = run.aim(lose, rank)
        watch.until(run.launchers, lambda: len(watch.seen) >= kill_after, deadline, run.logs)
        killed_after = watch.seen[-1][0]
        fire()
        killed_at = time.monotonic() - t0
    except BaseException:
        _stop(run.launchers)
        raise
    rcs = _finish(run.launchers, watch, deadline)
    return KillDrill(
        next((rc for rc in rcs if rc), 0),
        time.monotonic() - t0,
        watch.seen,
        run.text(),
        killed_after,
        killed_at,
        returncodes=rcs,
    )
