"""The user's own training post-processing and metrics: what they cost per epoch, named when it is notable."""

from __future__ import annotations

from statistics import median

from monai_fast.telemetry.record import Kind, Source, select

__all__ = ["ALGORITHM_SHARE", "algorithm_cost"]

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
