"""The GPU suite: every CUDA path of monai-fast in one command, one output folder, one results JSON.

Steps (each in its own process, with its own log and time limit; a failed step is recorded and
the suite goes on): ``pytest`` (``pytest -m gpu``), ``race`` (``time_to_dice.py``: ``fast``,
``monai_tutorial``, ``baseline`` on a spleen-scale synthetic set, with the GPUSampler's readings),
``overlaps`` (``overlaps.py``: ``fast`` with its overlaps off and on, the overlaps' two ratios and the
GPU utilisation inside the training windows), ``your_trainer`` (``FastTraining`` on
``your_trainer.py``), ``tuner_quality``, ``loader_variants`` (with the GPU cache on CUDA), ``inference``,
``pathology``, ``lab`` (the SegResNet lab's measured table, ``tutorials/segresnet_lab.py``, 30 epochs at its
GPU size), ``kernels`` (the kernel summary against ``torch.profiler``'s own totals) and ``nvtx`` (the ranges
seen by Nsight Systems when an ``nsys`` binary is present).
``gpu_suite.json`` names the device, driver, torch/CUDA versions and the source commit, and is
rewritten after every step, so a suite killed midway still leaves what it measured.

    python benchmarks/gpu_suite.py                       # CUDA, about 25 minutes on one H100
    python benchmarks/gpu_suite.py --device cpu --tiny   # every step at toy size, about 2 minutes
    python benchmarks/gpu_suite.py --steps race --race-budget 60 --commit 1b837d1

Exit status 0 when every step passed, 1 otherwise, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_probes import collect, machine  # benchmarks/, the script's folder

from monai_fast.files import write_json

ROOT = Path(__file__).resolve().parent.parent


STEPS = (
    "pytest",
    "race",
    "overlaps",
    "your_trainer",
    "tuner_quality",
    "loader_variants",
    "inference",
    "pathology",
    "lab",
    "kernels",
    "nvtx",
)
logger = logging.getLogger("gpu_suite")


@dataclass(frozen=True)
class Suite:
    """What every step needs: the interpreter, the folders, the device and the sizes."""

    out: Path
    work: Path
    device: str
    tiny: bool
    race_budget: float
    race_repeats: int
    step_timeout: float | None

    def script(self, name: str) -> list[str]:
        return [sys.executable, str(ROOT / "benchmarks" / name)]

    def probe(self, name: str) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_probes.py"),
            name,
            "--device",
            self.device,
            "--out",
            str(self.out),
            "--work",
            str(self.work),
        ] + (["--tiny"] if self.tiny else [])


def race_argv(s: Suite) -> list[str]:
    """``time_to_dice.py`` on the probe's spleen-scale set, with MONAI's tutorial UNet and 96^3 patches."""
    size = (
        ["--patch", "32", "32", "32", "--channels", "4", "8", "16", "--res-units", "1", "--max-epochs", "1"]
        if s.tiny
        else [
            "--patch",
            "96",
            "96",
            "96",
            "--channels",
            "16",
            "32",
            "64",
            "128",
            "256",
            "--res-units",
            "2",
            "--max-epochs",
            "300",
        ]
    )
    return s.script("time_to_dice.py") + [
        "--recipes",
        "fast",
        "monai_tutorial",
        "baseline",
        "--repeats",
        str(s.race_repeats),
        "--data-dir",
        str(s.work / "spleen_scale"),
        "--time-budget",
        str(s.race_budget),
        "--device",
        s.device,
        "--out",
        str(s.out / "race"),
        "--run-dir",
        str(s.work / "race_runs"),
        *size,
    ]


def step_plan(s: Suite, name: str) -> tuple[list[list[str]], float]:
    """The commands of step ``name`` (run in order, all must succeed) and its time limit in seconds."""
    tiny = s.tiny
    if name == "pytest":
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-rs",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={s.out / 'pytest_gpu.xml'}",
            str(ROOT / "tests"),
        ]
        return [argv], 300 if tiny else 1200
    if name == "race":
        per_recipe = s.race_budget + (60 if tiny else 180)  # set-up and the last validation past the budget
        return [s.probe("data"), race_argv(s)], 300 + 3 * s.race_repeats * per_recipe
    if name == "overlaps":  # fast with its overlaps off and on, on the race's set and network
        size = (
            [
                "--patch",
                "32",
                "32",
                "32",
                "--channels",
                "4",
                "8",
                "16",
                "--res-units",
                "1",
                "--max-epochs",
                "2",
                "--target",
                "0.05",
                "--repeats",
                "1",
            ]
            if tiny
            else [
                "--patch",
                "96",
                "96",
                "96",
                "--channels",
                "16",
                "32",
                "64",
                "128",
                "256",
                "--res-units",
                "2",
                "--repeats",
                "2",
                "--time-budget",
                str(s.race_budget),
            ]
        )
        size += ["--variants", "off", "on"]
        return [
            s.probe("data"),
            s.script("overlaps.py")
            + [
                "--data-dir",
                str(s.work / "spleen_scale"),
                "--device",
                s.device,
                "--out",
                str(s.out / "overlaps"),
                *size,
            ],
        ], 300 + 4 * (s.race_budget + (60 if tiny else 180))
    if name == "your_trainer":
        size = (
            [
                "--cases",
                "4",
                "--shape",
                "48",
                "48",
                "32",
                "--patch",
                "32",
                "32",
                "32",
                "--channels",
                "4",
                "8",
                "--epochs",
                "1",
                "--repeats",
                "1",
                "--workers",
                "0",
            ]
            if tiny
            else ["--channels", "16", "32", "64", "128", "256", "--epochs", "6", "--repeats", "2", "--compile"]
        )
        return [
            s.script("your_trainer.py") + ["--device", s.device, "--out", str(s.out / "your_trainer"), *size]
        ], 300 if tiny else 900
    if name == "tuner_quality":
        size = (
            ["--tiny"]
            if tiny
            else ["--rounds", "2", "--tuner-runs", "2", "--h2h-rounds", "4", "--batch-range", "1", "32"]
        )
        return [
            s.script("tuner_quality.py") + ["--device", s.device, "--out", str(s.out / "tuner_quality"), *size]
        ], 300 if tiny else 1200
    if name == "loader_variants":
        size = (
            ["--cases", "4", "--epochs", "2", "--shape", "48", "48", "32"]
            if tiny
            else ["--cases", "16", "--epochs", "3"]
        )
        return [
            s.script("loader_variants.py") + ["--device", s.device, "--out", str(s.out / "loader_variants"), *size]
        ], 300 if tiny else 900
    if name == "inference":  # TensorRT and ONNX Runtime's CUDA provider run where their packages are; else named
        size = ["--tiny"] if tiny else ["--train-epochs", "5", "--rounds", "3"]
        return [
            s.script("inference.py") + ["--device", s.device, "--out", str(s.out / "inference"), *size]
        ], 300 if tiny else 900
    if name == "pathology":  # cuCIM where installed; else the tile-aware reader and torch augmentation on the GPU
        size = ["--tiny"] if tiny else ["--repeats", "2", "--time-budget", "300"]
        return [
            s.script("pathology.py") + ["--device", s.device, "--out", str(s.out / "pathology"), *size]
        ], 300 if tiny else 1500
    if name == "lab":  # the lab's expected-performance table, measured at its GPU size (30 of its 100 epochs)
        size = ["--tiny"] if tiny else ["--max-epochs", "30"]
        return [
            [
                sys.executable,
                str(ROOT / "tutorials" / "segresnet_lab.py"),
                "--device",
                s.device,
                "--no-progress",
                "--run-dir",
                str(s.work / "lab"),
                *size,
            ]
        ], 300 if tiny else 900
    return [s.probe(name)], 300 if tiny else 600


def run_logged(argv: list[str], log: Path, timeout_s: float) -> tuple[int | None, str | None]:
    """Run ``argv`` with stdout and stderr appended to ``log``; its whole process group is ended at ``timeout_s``.

    Returns ``(exit status, None)``, or ``(None, why)`` when it timed out or could not start.
    """
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(
                argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()},
            )
        except OSError as e:
            return None, f"could not start {argv[0]}: {e}"
        try:
            return proc.wait(timeout=timeout_s), None
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None, "timed out"


def _pythonpath() -> str:
    old = os.environ.get("PYTHONPATH")
    return str(ROOT) + (os.pathsep + old if old else "")


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_step(s: Suite, name: str) -> dict:
    """Run step ``name``; its status (``passed``/``failed``), time, log and collected results."""
    commands, limit = step_plan(s, name)
    limit = s.step_timeout or limit
    log = s.out / "logs" / f"{name}.log"
    t0 = time.monotonic()
    rc, error = 0, None
    for argv in commands:
        rc, error = run_logged(argv, log, max(1.0, limit - (time.monotonic() - t0)))
        if error == "timed out":
            error = f"timed out after {limit:.0f} s, the step's limit (its process group was ended)"
        elif error is None and rc != 0:
            error = f"exit status {rc}"
        if error is not None:
            break
    entry = {
        "status": "passed" if error is None else "failed",
        "seconds": round(time.monotonic() - t0, 1),
        "rc": rc,
        "log": str(log.relative_to(s.out)),
        "error": error,
    }
    try:
        entry["results"] = collect(name, s.out, s.work, s.device)
    except Exception as e:  # noqa: BLE001 - a step's results that cannot be read are recorded, not fatal
        entry["results"] = None
        entry["collect_error"] = f"{type(e).__name__}: {e}"
    if error is not None:
        entry["log_tail"] = _tail(log)
    return entry


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default %(default)s)")
    p.add_argument("--tiny", action="store_true", help="every step at toy size (seconds each): proves the suite runs")
    p.add_argument("--out", help="output folder (default benchmarks/results/gpu_suite_<time>[_tiny])")
    p.add_argument("--work", help="scratch folder for data and run folders (default <out>/work, removed at the end)")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch folder")
    p.add_argument("--commit", help="source commit to record when the tree has no .git (default: git rev-parse HEAD)")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="steps to run (default: all)")
    p.add_argument("--race-budget", type=float, help="seconds per recipe and repeat (default 120; --tiny 30)")
    p.add_argument("--race-repeats", type=int, help="race repeats (default 2; --tiny 1)")
    p.add_argument("--step-timeout", type=float, help="one time limit in seconds for every step (default: per step)")
    return p.parse_args(argv), p


def check_device(p: argparse.ArgumentParser, device: str) -> None:
    """Refuse a device this machine does not have, naming ``--device``, before anything runs."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        p.error(f"--device {device!r}: not a device name ({e}); use cuda, cuda:N or cpu")
    if dev.type not in ("cuda", "cpu"):
        p.error(f"--device {device!r}: use cuda, cuda:N or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(
            f"--device {device!r}: this torch build ({torch.__version__}) sees no CUDA device; "
            "run on a GPU machine, or use --device cpu --tiny to check the suite itself"
        )


def main(argv: list[str] | None = None) -> int:
    args, p = parse(argv)
    check_device(p, args.device)
    if args.step_timeout is not None and not args.step_timeout > 0:
        p.error(f"--step-timeout must be > 0, got {args.step_timeout}")
    if args.race_budget is not None and not args.race_budget > 0:
        p.error(f"--race-budget must be > 0, got {args.race_budget}")
    if args.race_repeats is not None and args.race_repeats < 1:
        p.error(f"--race-repeats must be >= 1, got {args.race_repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stamp = dt.datetime.now()
    out = Path(
        args.out or ROOT / "benchmarks" / "results" / f"gpu_suite_{stamp:%Y%m%d-%H%M%S}{'_tiny' if args.tiny else ''}"
    )
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: cannot create it: {e.strerror or e}")
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    suite = Suite(
        out=out,
        work=work,
        device=args.device,
        tiny=args.tiny,
        race_budget=args.race_budget or (30.0 if args.tiny else 120.0),
        race_repeats=args.race_repeats or (1 if args.tiny else 2),
        step_timeout=args.step_timeout,
    )
    doc = {
        "suite": "gpu_suite",
        "format": 1,
        "date": stamp.isoformat(timespec="seconds"),
        "tiny": args.tiny,
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(args.device, args.commit, ROOT),
        "steps_requested": list(args.steps),
        "steps": {},
        "passed": [],
        "failed": [],
    }
    json_path = out / "gpu_suite.json"
    write_json(doc, json_path)
    for name in args.steps:
        logger.info("step %s ...", name)
        entry = run_step(suite, name)
        doc["steps"][name] = entry
        doc[entry["status"]].append(name)
        write_json(doc, json_path)
        logger.info(
            "step %s %s in %.0f s%s",
            name,
            entry["status"],
            entry["seconds"],
            "" if entry["error"] is None else f": {entry['error']} (see {out / entry['log']})",
        )
    if not args.keep_work and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"passed": doc["passed"], "failed": doc["failed"]}))
    print(f"wrote {json_path}")
    return 0 if not doc["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
