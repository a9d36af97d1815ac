"""A real one-node SLURM cluster on localhost for the tests (Debian ``slurm-wlm`` + ``munge``).

No systemd here: munged is started as the munge user, then slurmctld and slurmd with a private
``slurm.conf`` (``proctrack/linuxproc``, ``task/none``, no accounting, one node with this
machine's CPUs) on free ports in a temporary folder. ``SLURM_CONF`` points clients at it.

    python tests/slurm_cluster.py up /tmp/slurm     # start, print the SLURM_CONF to export
    python tests/slurm_cluster.py down /tmp/slurm
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "squeue", "scontrol", "scancel")


def missing_parts() -> str | None:
    """Why a cluster cannot be started here, or ``None`` when it can."""
    missing = [b for b in (*DAEMONS, *CLIENTS) if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _start_munge() -> None:
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    for d in ("/var/log/munge", "/var/lib/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown(key, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged")], check=True)


def write_conf(root: Path) -> Path:
    """``slurm.conf`` for one node named localhost with this machine's CPUs."""
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=monaifast",
                "SlurmctldHost=localhost",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SchedulerType=sched/backfill",
                "ReturnToService=2",
                "JobRequeue=1",
                "KillWait=5",
                "AccountingStorageType=accounting_storage/none",
                "MailProg=/bin/true",
                "JobAcctGatherType=jobacct_gather/none",
                "JobCompType=jobcomp/none",
                f"NodeName=localhost CPUs={os.cpu_count() or 1} State=UNKNOWN",
                "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:2",
                "",
            ]
        )
    )
    return conf


def up(root: str | os.PathLike, timeout_s: float = 60.0) -> dict[str, str]:
    """Start munged (if not running), slurmctld and slurmd; wait until the node is idle.

    Returns:
        The environment to run SLURM clients with (``SLURM_CONF`` set).
    """
    why = missing_parts()
    if why:
        raise RuntimeError(why)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for f in ("slurmctld.log", "slurmd.log", "slurmctld.pid", "slurmd.pid"):
        (root / f).unlink(missing_ok=True)
    conf = write_conf(root)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    _start_munge()
    subprocess.run([_sbin("slurmctld"), "-f", str(conf)], check=True, env=env)
    subprocess.run([_sbin("slurmd"), "-f", str(conf), "-N", "localhost"], check=True, env=env)
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        started = all((root / f"{d}.pid").exists() for d in ("slurmctld", "slurmd"))
        if started and not (_alive(root / "slurmctld.pid") and _alive(root / "slurmd.pid")):
            break  # a daemon died: its log says why
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env)
        state = p.stdout.strip()
        if state in ("idle", "mixed", "allocated"):
            return env
        time.sleep(0.5)
    logs = "\n".join((root / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (root / f).exists())
    down(root)
    raise RuntimeError(f"SLURM node did not become idle (state {state!r}); logs:\n{logs}")


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def down(root: str | os.PathLike) -> None:
    """Stop this cluster's slurmd and slurmctld (munged is left running: it may be shared)."""
    root = Path(root)
    for name in ("slurmd", "slurmctld"):
        pid_file = root / f"{name}.pid"
        if not pid_file.exists():
            continue
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, 15)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
        except (ProcessLookupError, ValueError):
            pass


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("up", "down"):
        sys.exit(__doc__)
    if sys.argv[1] == "up":
        print(f"export SLURM_CONF={up(sys.argv[2])['SLURM_CONF']}")
    else:
        down(sys.argv[2])
