"""``monai-fast doctor RUN --apply``: the exact ``FastTraining(...)`` line for a run (with it attached: what lets
each lever it left alone apply), and the code changes no lever makes."""

from __future__ import annotations

from monai_fast.report.advice import ATTACH, FIXES, fix_applies, unused_levers
from monai_fast.report.applied import applied_levers, in_effect
from monai_fast.report.doctor import Diagnosis, diagnose
from monai_fast.report.ranks import last_run

__all__ = ["prescribe"]

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
