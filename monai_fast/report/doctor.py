"""``monai-fast doctor``: name a run's bottleneck from its record alone, with the evidence and the fix.

The verdicts, the wall-clock accounting and what is advised when: docs/doctor.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from monai_fast.files import write_json, write_text
from monai_fast.report.advice import ATTACH, FIXES, fix_applies, fixes_for, unused_levers
from monai_fast.report.applied import InEffect, applied_levers, in_effect, sentence
from monai_fast.report.plots import plot_breakdown, plot_gpu, plot_wall_clock, pyplot_missing
from monai_fast.report.ranks import (
    interrupted,
    last_run,
    missing_ranks,
    node_evidence,
    rank_evidence,
    rank_times,
    segment_evidence,
    stopped_early,
)
from monai_fast.report.wall_clock import WallClock, table_lines, wall_clock, wall_clock_advice
from monai_fast.telemetry.record import Kind, Source, data_share, load_record, record_files, select

__all__ = [
    "ALGORITHM_SHARE",
    "THRESHOLDS",
    "Diagnosis",
    "algorithm_cost",
    "diagnose",
    "doctor",
    "prescribe",
    "write_report",
]

logger = logging.getLogger("monai_fast.report")

#: the share of the training epoch from which the doctor names the training post-processing and metrics
ALGORITHM_SHARE = 0.10


def algorithm_cost(rows: list[dict], threshold: float = ALGORITHM_SHARE) -> dict | None:
    """The training post-processing and metrics' cost per epoch (medians of the lowest rank's ``training_algorithm``
    rows), with the ``evidence`` sentence and the ``fix``; ``None`` below ``threshold`` or without such rows."""
    epochs = select(rows, Kind.EPOCH, Source.TRAINING_ALGORITHM, engine="train")
    if not epochs:
        return None
    rank = min(r.get("rank", 0) for r in epochs)
    epochs = [r for r in epochs if r.get("rank", 0) == rank]
    metrics = sorted({m for r in epochs for m in r.get("metrics") or []})
    post = list(dict.fromkeys(p for r in epochs for p in r.get("postprocessing") or []))
    if not metrics and not post:  # only MONAI's decollation: no algorithm of the user's to name
        return None
    parts = {k: median(float(r.get(k, 0.0)) for r in epochs) for k in ("postprocessing_s", "decollate_s", "metrics_s")}
    epoch_s = median(float(r.get("epoch_s", 0.0)) for r in epochs)
    cost = sum(parts.values())
    share = cost / epoch_s if epoch_s > 0 else 0.0
    if share < threshold:
        return None
    named, what = [], []
    if post:
        named.append(f"the training post-processing {'/'.join(post)} ({parts['postprocessing_s']:.2f} s)")
        what.append("post-processing")
    if parts["decollate_s"] >= 0.01:
        named.append(f"MONAI's decollation of each batch into items for it ({parts['decollate_s']:.2f} s)")
    if metrics:
        what.append("metric" + ("s" if len(metrics) > 1 else ""))
        named.append(f"the training {what[-1]} {', '.join(metrics)} ({parts['metrics_s']:.2f} s)")
    evidence = (
        f"your training algorithm costs {cost:.2f} s of {epoch_s:.2f} s per epoch ({100 * share:.0f}%): "
        + ", ".join(named)
        + "; monai-fast keeps them as you built them"
    )
    fix = (
        f"the training {' and '.join(what)} are yours to change (monai-fast keeps them as built): compute them every N "
        "iterations (the metric attached with an ignite MetricUsage whose iteration_completed is "
        "Events.ITERATION_COMPLETED(every=N)), or only at validation (no key_train_metric and no trainer "
        "postprocessing; the evaluator computes its own), or on the device (predictions kept on the GPU, "
        "without decollating them into CPU transforms first)"
    )
    return {
        "epoch_s": epoch_s,
        "algorithm_s": cost,
        **parts,
        "share": share,
        "threshold": threshold,
        "metrics": metrics,
        "postprocessing": post,
        "epochs": len(epochs),
        "evidence": evidence,
        "fix": fix,
    }


#: the verdict's thresholds and their defaults (docs/doctor.md); `diagnose()` and `doctor()` take any of them
THRESHOLDS: dict[str, float] = {
    "data_threshold": 0.2,
    "data_low": 0.05,
    "util_low": 60.0,
    "mem_low": 0.5,
    "algorithm_share": ALGORITHM_SHARE,
}


@dataclass
class Diagnosis:
    """The doctor's verdict with the numbers behind it."""

    verdict: str
    evidence: list[str]
    fixes: list[str]
    numbers: dict = field(default_factory=dict)
    report: str | None = None  #: the report's path, once written

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        """The diagnosis as plain text; every evidence, fix and paragraph line is a whole sentence."""
        lines = [f"verdict: {self.verdict}", "evidence:"]
        lines += [f"  - {sentence(e)}" for e in self.evidence]
        lines += ["what to change:"] + [f"  - {sentence(f)}" for f in self.fixes]
        if wc := self.numbers.get("wall_clock"):
            lines += ["where the wall clock went:"] + [f"  {x}" for x in table_lines(wc, markdown=False)]
        if inference := self.numbers.get("inference"):
            lines += ["inference:", f"  {sentence(inference['text'])}"]
        return "\n".join(lines)


def diagnose(rows: list[dict], **thresholds: float) -> Diagnosis:
    """Decide the verdict from record rows.

    Args:
        rows: the record's rows (`monai_fast.telemetry.record.load_record()`).
        thresholds: any of `THRESHOLDS`, replacing its default.

    Raises:
        TypeError: a threshold that is not one of `THRESHOLDS`, naming it.
        ValueError: the rows hold no ``time_breakdown`` epochs of the training engine.
    """
    if unknown := sorted(set(thresholds) - set(THRESHOLDS)):
        raise TypeError(f"diagnose() has no threshold {', '.join(unknown)}; the thresholds are {', '.join(THRESHOLDS)}")
    limits = {**THRESHOLDS, **thresholds}
    rows, earlier = last_run(rows)
    epochs = select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")
    if not epochs:
        raise ValueError(
            "the record has no time_breakdown epochs: attach TimeBreakdown (and RecordHandler) to the trainer"
        )
    ranks = rank_times(epochs)
    n_epochs = len({(r.get("segment", 0), r["epoch"]) for r in epochs})
    data = sum(r["data_s"] for r in epochs)
    compute = sum(r["compute_s"] for r in epochs)
    share = data_share(data, compute)
    numbers: dict = {"epochs": n_epochs, "ranks": len(ranks), "data_s": data, "compute_s": compute, "data_share": share}
    over = f"over {n_epochs} epoch(s)" + (f" and {len(ranks)} ranks" if len(ranks) > 1 else "")
    evidence = [
        f"{100 * share:.1f}% of iteration time was spent waiting for data "
        f"({data:.1f} s of {data + compute:.1f} s {over})",
        *earlier,
    ]
    first = min((r.get("segment", 0), r["epoch"]) for r in epochs)
    later = [r for r in epochs if (r.get("segment", 0), r["epoch"]) != first]
    if later:
        numbers["data_share_after_first_epoch"] = data_share(
            sum(r["data_s"] for r in later), sum(r["compute_s"] for r in later)
        )
        evidence.append(f"after the first epoch: {100 * numbers['data_share_after_first_epoch']:.1f}%")
    evidence += rank_evidence(ranks, numbers) + node_evidence(rows, numbers)
    evidence += segment_evidence(rows, numbers) + stopped_early(rows, numbers) + interrupted(rows, numbers)

    gpu = select(rows, Kind.INTERVAL, Source.GPU)
    util_mean = mem_peak = None
    if gpu:
        util_mean = sum(r["gpu_util"] for r in gpu) / len(gpu)
        mem_peak = max(r["mem_used_mib"] / r["mem_total_mib"] for r in gpu)
        numbers.update(gpu_util_mean=util_mean, gpu_mem_peak_fraction=mem_peak, gpu_samples=len(gpu))
        evidence.append(
            f"GPU utilisation averaged {util_mean:.0f}% over {len(gpu)} samples; "
            f"peak memory {100 * mem_peak:.0f}% of the card"
        )
    else:
        evidence.append("no GPU samples in the record (CPU run, or GPUSampler not attached)")
    tp = select(rows, Kind.EPOCH, Source.THROUGHPUT, engine="train")
    if tp:
        per_rank = {}
        for r in tp:
            per_rank.setdefault(r.get("rank", 0), []).append(r["samples_per_s"])
        numbers["samples_per_s"] = sum(sum(v) / len(v) for v in per_rank.values())  # all ranks together
        evidence.append(
            f"throughput {numbers['samples_per_s']:.2f} samples/s" + (" (all ranks)" if len(per_rank) > 1 else "")
        )

    if share >= limits["data_threshold"]:
        verdict = "data-bound"
    elif (
        util_mean is not None
        and util_mean < limits["util_low"]
        and mem_peak is not None
        and mem_peak < limits["mem_low"]
    ):
        verdict = "gpu-under-filled"
    elif share < limits["data_low"] and (util_mean is None or util_mean >= limits["util_low"]):
        verdict = "compute-bound"
    else:
        verdict = "balanced"
    applied = applied_levers(rows)
    if applied:
        numbers["fast_training"] = {
            k: {"applied": v.get("applied"), "setting": v.get("setting")} for k, v in applied.items()
        }
    run = in_effect(rows)
    numbers["in_effect"] = json.loads(json.dumps(asdict(run)))  # as the report's JSON reads back (lists, not tuples)
    fixes = fixes_for(verdict, applied, run)
    if verdict == "compute-bound" and util_mean is None:
        fixes.insert(0, "this ran on the CPU: a CUDA GPU is the largest single step")
    if algorithm := algorithm_cost(rows, limits["algorithm_share"]):  # the user's own post-processing and metrics
        numbers["training_algorithm"] = {k: v for k, v in algorithm.items() if k not in ("evidence", "fix")}
        evidence.append(algorithm["evidence"])
        fixes.insert(0, algorithm["fix"])
    _add_wall_clock(rows, applied, run, numbers, evidence, fixes)
    if unused := unused_levers(applied, run):  # a plain trainer: the one line that applies them comes first
        numbers["unused_levers"] = unused
        if verdict == "balanced":  # the levers are the first step, before profiling
            fixes[:] = [f for f in fixes if not f.startswith("no single bottleneck")]
        fixes.insert(
            0,
            f"{ATTACH} applies the levers this run left unused, each kept only where it measures faster on "
            "this machine: " + "; ".join(unused),
        )
    numbers["thresholds"] = limits
    return Diagnosis(verdict, evidence, fixes, numbers)


def _add_wall_clock(
    rows: list[dict], applied: dict[str, dict], run: InEffect, numbers: dict, evidence: list[str], fixes: list[str]
) -> None:
    """The wall clock's evidence and fixes; its fixes go first when what they address outweighs the iterations."""
    clocks = wall_clock(rows)
    if not clocks:
        evidence.append("no wall-clock spans in the record (attach RecordHandler to the trainer and the evaluator)")
        return
    wc = clocks[min(clocks)]
    numbers["wall_clock"] = wc.to_dict()
    if inference := _inference(wc, rows, run):
        numbers["inference"] = inference
    if len(clocks) > 1:
        numbers["wall_clock_per_rank"] = {k: v.to_dict() for k, v in clocks.items()}
    more, advice = wall_clock_advice(wc, applied, run)
    evidence += more
    training = wc.share("compute") + wc.share("data_wait")
    fixes[:0] = [f for share, f in advice if share > training]
    fixes += [f for share, f in advice if share <= training]


def _inference(wc: WallClock, rows: list[dict], run: InEffect) -> dict | None:
    """The inference section: validation's time, its split into network and sliding window (`InferenceSplit`)."""
    sync, beside = wc.seconds.get("validation", 0.0), wc.overlapped.get("validation", 0.0)
    if sync + beside <= 0:
        return None
    what = "validation" if run.sliding_window is False else "validation (sliding-window inference)"
    text = (
        f"{what} took {sync:.1f} s, {100 * wc.share('validation'):.1f}% of the wall "
        "clock" + (f", and {beside:.1f} s beside training" if beside else "") + ". "
    )
    numbers: dict = {"validation_s": sync, "overlapped_s": beside, "share": wc.share("validation")}
    split = select(rows, Kind.EPOCH, Source.INFERENCE)
    split = [r for r in split if r.get("rank", 0) == min(r.get("rank", 0) for r in split)]
    parts = {k: sum(r[k] for r in split) for k in ("network_s", "sliding_window_s", "before_s", "after_s", "windows")}
    total = sum(v for k, v in parts.items() if k.endswith("_s"))
    if total > 0:
        share = {k: v / total for k, v in parts.items() if k.endswith("_s")}
        numbers["split"] = {**parts, "iteration_s": total, "shares": share}
        text += (
            f"Of its iterations ({total:.1f} s, {parts['windows']:.0f} windows): "
            f"network {100 * share['network_s']:.0f}%, "
            f"sliding window around it (cutting windows, stitching) {100 * share['sliding_window_s']:.0f}%, "
            f"before the first window (batch to device) {100 * share['before_s']:.0f}%, after the inferer "
            f"(post-processing, metric) {100 * share['after_s']:.0f}%. "
        )
        if share["sliding_window_s"] >= 0.3 and run.batches_windows:
            text += (
                "Stitching outweighs much of the network: fewer, larger window batches (sw_batch_size; "
                "FastTraining(evaluator='tune') measures it) and stitching on the network's device help. "
            )
    elif run.sliding_window is not False:
        text += "Attach monai_fast.handlers.InferenceSplit to the evaluator to split it into network and stitching. "
    text += (
        "python benchmarks/inference.py times the inference backends (eager, autocast, compile, onnx, tensorrt) "
        "on this machine, and monai-fast infer --backend NAME runs the trained network with the backend you pick."
    )
    return {**numbers, "text": text}


def _summary_lines(summary: dict) -> list[str]:
    """What the handlers summarised (throughput, GPU, kernels, precision), per rank."""
    per_rank = (
        summary
        if summary and all(k.startswith("rank") and isinstance(v, dict) for k, v in summary.items())
        else {"": summary}
    )
    lines = []
    for rank, s in per_rank.items():
        who = f"{rank}: " if rank else ""
        if tp := s.get(Source.THROUGHPUT.value):
            lines.append(
                f"{who}throughput {tp['samples_per_s_mean']:.2f} samples/s, "
                f"{tp['voxels_per_s_mean']:.3g} voxels/s (mean of epochs)"
            )
        for gpu, g in (s.get(Source.GPU.value) or {}).items():
            util = "n/a" if g.get("gpu_util_mean") is None else f"{g['gpu_util_mean']:.0f}%"
            lines.append(
                f"{who}{gpu} ({g.get('name')}): mean utilisation {util}, peak memory {g.get('mem_used_peak_mib')} MiB "
                f"of {g.get('mem_total_mib')} MiB, {g.get('samples')} samples"
            )
        if k := s.get(Source.KERNELS.value):
            top = ", ".join(t["name"] for t in k.get("top", [])[:3])
            lines.append(
                f"{who}profiled window: {k.get('# Kernels', k.get('# Ops'))} kernels/ops; "
                f"top by {k.get('ranked_by')}: {top}"
            )
        for lever, v in (s.get(Source.FAST_TRAINING.value) or {}).items():
            lines.append(
                f"{who}FastTraining {lever}: "
                + (f"{v.get('setting')}: " if v.get("applied") else "left alone: ")
                + str(v.get("reason", ""))
                + _rounds_line(v.get("evidence"))
            )
        if amp := s.get(Source.AMP.value):
            lines.append(
                f"{who}precision {amp.get('precision')}"
                + (", fell back to fp32" if amp.get("fell_back") else "")
                + f"; non-finite losses {amp.get('nonfinite', 0)}, skipped steps {amp.get('skipped_steps', 0)}"
            )
    return lines


def _rounds_line(evidence: dict | None) -> str:
    """The timed rounds behind a measured lever (``tune.rounds.Decision.as_row``), as `` [rounds, s: a/b, ...]``."""
    if not isinstance(evidence, dict):
        return ""
    found = evidence.get("rounds") if isinstance(evidence.get("rounds"), dict) else evidence
    rounds = found.get("rounds_s") if isinstance(found, dict) else None
    if not rounds:
        return ""
    pairs = ", ".join(f"{b:.3f}/{c:.3f}" for b, c in rounds)
    return f" [rounds, {found.get('baseline')}/{found.get('candidate')} s: {pairs}]"


@functools.cache  # the missing plots extra is said once per process
def _warn_no_pictures(missing: str) -> None:
    logger.warning("doctor: %s; report.md is written without them", missing)


def write_report(
    run_dir: str | os.PathLike, diagnosis: Diagnosis, rows: list[dict], summary: dict | None = None
) -> Path:
    """Write ``report.md`` with its PNGs (without matplotlib: none, said in its last line) and ``doctor.json``."""
    run_dir = Path(run_dir)
    epochs = select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")
    gpu = select(rows, Kind.INTERVAL, Source.GPU)
    missing = pyplot_missing("drawing the report's PNGs")
    if missing is not None:
        _warn_no_pictures(str(missing))
    pictures = missing is None
    if pictures:
        plot_breakdown(epochs, run_dir / "time_breakdown.png")
    md = [f"# monai-fast doctor: {run_dir.name}", "", f"**Verdict: {diagnosis.verdict}**", "", "## Evidence", ""]
    md += [f"- {sentence(e)}" for e in diagnosis.evidence]
    md += ["", "## What to change", ""] + [f"- {sentence(f)}" for f in diagnosis.fixes]
    if wc := diagnosis.numbers.get("wall_clock"):
        md += ["", "## Where the wall clock went", ""]
        if pictures:
            plot_wall_clock(wc, run_dir / "wall_clock.png")
            md += ["![wall clock](wall_clock.png)", ""]
        md += table_lines(wc)
    if inference := diagnosis.numbers.get("inference"):
        md += ["", "## Inference", "", sentence(inference["text"])]
    if lines := _summary_lines(summary or {}):
        md += ["", "## What the handlers measured", ""] + [f"- {sentence(x)}" for x in lines]
    md += ["", "## Time per epoch", ""] + (["![time breakdown](time_breakdown.png)", ""] if pictures else [])
    md += [
        "| run | epoch | rank | iterations | data wait s | compute s | data share |",
        "|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r.get('segment', 0)} | {r['epoch']} | {r.get('rank', 0)} | {r['iterations']} | {r['data_s']:.2f} | "
        f"{r['compute_s']:.2f} | {100 * data_share(r['data_s'], r['compute_s']):.1f}% |"
        for r in sorted(epochs, key=lambda r: (r.get("segment", 0), r["epoch"], r.get("rank", 0)))
    ]
    if gpu and pictures:
        plot_gpu(gpu, run_dir / "gpu_util.png")
        md += ["", "## GPU utilisation", "", "![GPU utilisation](gpu_util.png)"]
    if not pictures:
        md += ["", 'No pictures: they need matplotlib, which is not installed (pip install "monai-fast[plots]").']
    path = run_dir / "report.md"
    write_text("\n".join(md) + "\n", path)
    write_json(diagnosis.to_dict() | {"report": str(path)}, run_dir / "doctor.json")
    return path


def doctor(run_dir: str | os.PathLike, **thresholds: float) -> Diagnosis:
    """Load the record in ``run_dir``, diagnose it and write ``report.md``; returns the diagnosis.

    A report that cannot be written is logged; the diagnosis is returned all the same, with ``report=None``.
    """
    rows, summary = load_record(run_dir)
    diagnosis = diagnose(rows, **thresholds)
    rows = last_run(rows)[0]  # the report's tables and pictures: the run the verdict is about
    files, strays = record_files(run_dir)
    diagnosis.evidence += missing_ranks(rows, list(files), diagnosis.numbers)
    if strays:
        diagnosis.evidence.append(
            "not read, not written by this run (a record file is named exactly "
            "record.rank<N>.jsonl): " + ", ".join(p.name for p in strays)
        )
        diagnosis.numbers["strays"] = [p.name for p in strays]
    try:
        diagnosis.report = str(write_report(run_dir, diagnosis, rows, summary))
    except OSError as e:
        logger.warning("doctor: could not write the report in %s (%s); the verdict stands", run_dir, e)
    return diagnosis


#: (a fragment of the reason FastTraining logged, what unblocks the lever)
_UNBLOCK = (
    ("not known to be thread-safe", "FastTraining(loader='thread') runs your collate function in the loader thread"),
    ("no .data and .transform", "wrap your items in monai.data.Dataset(data, transform) (or CacheDataset)"),
    ("IterableDataset", "give FastTraining a map-style MONAI Dataset (items it can cache)"),
    ("custom sampler", "use shuffle=True / a DistributedSampler, or keep your sampler (the data lever stays off)"),
    (
        "custom batch sampler",
        "use batch_size= in your DataLoader, or keep your batch sampler (the data lever stays off)",
    ),
    ("amp=True", "build the trainer with amp=False and let FastTraining(precision='auto') choose"),
    ("rejects channels_last_3d", "keep the default layout: FastTraining(memory_format=False)"),
    ("evaluator='tune'", "FastTraining(evaluator='tune') measures your evaluator's sw_batch_size at its first run"),
    ("validation='tune'", "FastTraining(evaluator='tune') measures your evaluator's sw_batch_size at its first run"),
    (
        "not rebuilt from .data and .transform",
        "move the extra work into a transform of the chain (a Lambdad), or keep your class (the data lever stays off)",
    ),
)


def prescribe(rows: list[dict], diagnosis: Diagnosis | None = None) -> str:
    """The ``FastTraining`` line and the code changes for the run whose record rows are ``rows``.

    Args:
        rows: the run record's rows (`load_record()`).
        diagnosis: the doctor's verdict for them; computed when ``None``.

    Example:
        >>> print(prescribe(load_record("runs/demo/baseline")[0]))
    """
    diagnosis = diagnosis or diagnose(rows)
    rows = last_run(rows)[0]  # the levers of the run the verdict is about
    levers = applied_levers(rows)
    lines: list[str] = []
    lever_fixes = [lever for lever, _ in FIXES[diagnosis.verdict] if lever is not None]
    run = in_effect(rows)
    if not levers:
        lines.append(ATTACH)
        if unused := unused_levers(levers, run):
            lines.append("#   applies the levers this run left unused: " + "; ".join(unused))
        if lever_fixes:
            lines.append(
                f"#   applies what the {diagnosis.verdict} verdict calls for: " + ", ".join(dict.fromkeys(lever_fixes))
            )
        elif not unused:
            lines.append("#   the guide's levers, measured on your device (the verdict itself needs no lever)")
        options = [
            text
            for lever, text in FIXES[diagnosis.verdict]
            if lever is not None and "FastTraining(" in text and "'auto'" not in text and fix_applies(lever, text, run)
        ]
        lines += [f"#   an option of it where it fits: {text}" for text in options]
    else:
        lines.append("# FastTraining is attached already; what it left alone, and what lets it apply:")
        off = {k: v for k, v in levers.items() if not v.get("applied")}
        for lever, row in off.items():
            reason = str(row.get("reason", ""))
            lines.append(f"#   {lever}: {reason}")
            if fix := next((fix for fragment, fix in _UNBLOCK if fragment in reason), None):
                lines.append(f"#     -> {fix}")
        if not off:
            lines.append("#   nothing: every lever applied")
    code = [text for lever, text in FIXES[diagnosis.verdict] if lever is None and fix_applies(lever, text, run)]
    if code:
        lines.append(f"# code changes for the {diagnosis.verdict} verdict that no FastTraining option makes:")
        lines += [f"#   - {text}" for text in code]
    return "\n".join(lines)
