"""The CPU's argmax over the class dimension: default layout vs the classes innermost (what ``prediction_layout`` does).

MONAI's segmentation post-processing (``AsDiscrete(argmax=True)``) takes ``torch.argmax`` over the class
dimension of each ``(classes, D, H, W)`` prediction. For each shape the script times, in interleaved rounds
after one warm-up each: ``torch.argmax`` on the prediction as the sliding window returns it, the same after
:func:`~monai_fast.handlers.prediction_layout.classes_innermost` (the conversion's time included), and
``torch.max(..., dim=0).indices``, and checks the three give the same labels; and an evaluator's softmax then
argmax, the prediction reordered before the softmax too or only before the argmax (the softmax over classes is
slower on classes-innermost input). Shapes: a validation volume of ``your_trainer.py``, a CT at its original
resolution (``monai-fast infer`` takes the argmax there, after ``Invertd``), a 14-class abdomen crop. Prints a
table (medians, ms) and writes ``<out>/argmax_layout_<time>.json``::

    python benchmarks/argmax_layout.py            # about 1 minute on 2 CPU cores
    python benchmarks/argmax_layout.py --rounds 1 --shapes 2x16x16x16
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from monai_fast.files import write_json
from monai_fast.handlers.prediction_layout import classes_innermost

SHAPES = ("2x107x80x80", "2x512x512x90", "14x160x160x96")
VARIANTS = {
    "argmax": lambda p: torch.argmax(p, dim=0, keepdim=True),
    "innermost + argmax": lambda p: torch.argmax(classes_innermost(p), dim=0, keepdim=True),
    "max().indices": lambda p: torch.max(p, dim=0, keepdim=True).indices,
}
#: an evaluator's softmax then argmax (MONAI's ``Activations(softmax=True)``, ``AsDiscrete(argmax=True)``): the
#: prediction reordered before the softmax as well, or only before the argmax (what ``prediction_layout`` does)
SOFTMAX_VARIANTS = {
    "innermost + softmax + innermost + argmax": lambda p: torch.argmax(
        classes_innermost(torch.softmax(classes_innermost(p), dim=0)), dim=0, keepdim=True
    ),
    "softmax + innermost + argmax": lambda p: torch.argmax(
        classes_innermost(torch.softmax(p, dim=0)), dim=0, keepdim=True
    ),
}


def time_shape(shape: tuple[int, ...], rounds: int) -> dict:
    """Median ms per variant on a random prediction of ``shape`` (with ties), and whether they agree."""
    pred = torch.randn(shape)
    pred[:, : shape[1] // 4] = 0.0  # a quarter of the voxels tied across every class: the first class wins
    results = {name: f(pred) for name, f in VARIANTS.items()}  # warm-up, and the labels to compare
    same = all(torch.equal(results["argmax"], r) for r in results.values())
    soft = [f(pred) for f in SOFTMAX_VARIANTS.values()]  # compared with each other: softmax may round logits to ties
    same = same and torch.equal(*soft)
    variants = {**VARIANTS, **SOFTMAX_VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            start = time.perf_counter()
            f(pred)
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {
        "shape": list(shape),
        "ms": ms,
        "times_ms": times,
        "same_labels": same,
        "speedup_innermost": ms["argmax"] / ms["innermost + argmax"],
        "speedup_softmax_as_given": ms["innermost + softmax + innermost + argmax"] / ms["softmax + innermost + argmax"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="CxDxHxW prediction shapes (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per variant, interleaved (default 5)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes takes CxDxHxW, e.g. 2x64x64x64; got {args.shapes}")
    if args.rounds < 1 or any(len(s) != 4 or min(s) < 1 for s in shapes):
        p.error("--rounds must be >= 1 and every shape CxDxHxW with positive sizes")
    rows = [time_shape(s, args.rounds) for s in shapes]
    names = [*VARIANTS, *SOFTMAX_VARIANTS]
    print(f"{'prediction':<16}" + "".join(f"{n + ' ms':>{len(n) + 5}}" for n in names) + "  speed-ups  same")
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):<16}"
            + "".join(f"{r['ms'][n]:>{len(n) + 5}.1f}" for n in names)
            + f"  {r['speedup_innermost']:.1f}x {r['speedup_softmax_as_given']:.1f}x"
            + f"{'yes' if r['same_labels'] else 'NO':>6}"
        )
    doc = {
        "benchmark": "argmax_layout",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
        },
        "options": vars(args),
        "rows": rows,
    }
    out = write_json(doc, Path(args.out) / f"argmax_layout_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0 if all(r["same_labels"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
