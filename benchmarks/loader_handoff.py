"""Would a pause in the loader thread after each hand-over cut the ``fast`` recipe's data wait?

``SafeThreadDataLoader`` makes batches on a background thread. When the training thread takes a
queued batch, that thread wakes at once to make the next one, and the two contend for the GIL
while the training thread is still in Python. Measured per step, that contention is most of the
``fast`` recipe's data wait on a 2-core CPU (``Queue.get`` itself takes 0.02-0.04 ms).

The variant tried here (defined in this script only, not in the package): after delivering a
batch it had to wait to deliver, the loader thread sleeps ``--pause-ms`` before making the next.
The script trains the demo's ``fast`` recipe without validation, alternating no pause and the
pause, and reports the data wait per epoch (``next()`` on the loader, epochs after the first),
its share, and the epoch time. The pause is worth having only if the epoch gets shorter, not just
the measured wait. Prints a table and writes JSON.

    python benchmarks/loader_handoff.py --repeats 5 --epochs 6     # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path
from queue import Full

import torch
from ignite.engine import Events

from monai_fast.data import loaders
from monai_fast.data.msd import load_msd_datalist
from monai_fast.data.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.recipes import RecipeConfig, build_recipe
from monai_fast.telemetry import cuda_available, device_description

ORIGINAL = loaders.SafeThreadBuffer


def pausing_buffer(pause_s: float) -> type:
    """``SafeThreadBuffer`` whose thread sleeps ``pause_s`` after a hand-over it had to wait for."""

    class PausingBuffer(ORIGINAL):
        def _put(self, value):
            waited = False
            while self._running:
                try:
                    self.buffer.put(value, timeout=self.timeout)
                except Full:
                    waited = True
                    continue
                if waited:
                    time.sleep(pause_s)
                return True
            return False

    return PausingBuffer


def one_run(train, val, pause_s: float, epochs: int, device: str) -> dict:
    loaders.SafeThreadBuffer = pausing_buffer(pause_s) if pause_s > 0 else ORIGINAL
    try:
        recipe = build_recipe("fast", train, val, RecipeConfig(max_epochs=epochs, val_interval=10**6), device,
                              progress=False)
        stamps: dict = {}
        waits: list[tuple[int, float]] = []
        epoch_s: list[float] = []
        trainer = recipe.trainer
        trainer.add_event_handler(Events.GET_BATCH_STARTED, lambda e: stamps.__setitem__("batch", time.perf_counter()))
        trainer.add_event_handler(
            Events.GET_BATCH_COMPLETED, lambda e: waits.append((e.state.epoch, time.perf_counter() - stamps["batch"]))
        )
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: stamps.__setitem__("epoch", time.perf_counter()))
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epoch_s.append(time.perf_counter() - stamps["epoch"]))
        trainer.run()
    finally:
        loaders.SafeThreadBuffer = ORIGINAL
    later = [s for epoch, s in waits if epoch > 1]  # the first epoch also warms up kernels
    return {
        "pause_ms": pause_s * 1e3,
        "data_wait_ms_per_epoch": sum(later) / (epochs - 1) * 1e3,
        "data_share": sum(later) / sum(epoch_s[1:]),
        "epoch_s_median": statistics.median(epoch_s[1:]),
        "step_waits_ms_epoch2": [round(s * 1e3, 2) for epoch, s in waits if epoch == 2],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="runs per variant, alternating (default 5)")
    ap.add_argument("--epochs", type=int, default=6, help="epochs per run; the first is not counted (default 6)")
    ap.add_argument("--pause-ms", type=float, default=3.0, help="the pause to compare with none (default 3)")
    ap.add_argument("--device", default="auto", help="cpu, cuda ... (default: cuda if present)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.epochs < 2 or args.repeats < 1 or not args.pause_ms > 0:
        ap.error("--epochs must be >= 2, --repeats >= 1 and --pause-ms > 0")
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    data = synthetic_dataset("spleen-like", 16, (128, 128, 64), 0, progress=False)
    train, val = load_msd_datalist(data, val_fraction=0.25, seed=0)
    runs = []
    for i in range(args.repeats):
        for pause in (0.0, args.pause_ms / 1e3):
            r = one_run(train, val, pause, args.epochs, device)
            runs.append(r)
            print(f"  run {i + 1}, pause {r['pause_ms']:.0f} ms: {r['data_wait_ms_per_epoch']:.1f} ms/epoch "
                  f"({r['data_share'] * 100:.2f} %), epoch {r['epoch_s_median']:.3f} s", flush=True)
    ratios = [b["epoch_s_median"] / a["epoch_s_median"] for a, b in zip(runs[0::2], runs[1::2])]
    print(f"\n{'pause':>8} {'data wait ms/epoch':>20} {'share':>8} {'epoch s':>8}   (medians of {args.repeats})")
    summary: dict = {}
    for pause in sorted({r["pause_ms"] for r in runs}):
        mine = [r for r in runs if r["pause_ms"] == pause]
        med = {k: statistics.median(r[k] for r in mine) for k in ("data_wait_ms_per_epoch", "data_share", "epoch_s_median")}
        summary[f"{pause:g} ms"] = med
        print(f"{pause:>6.0f}ms {med['data_wait_ms_per_epoch']:>20.1f} {med['data_share'] * 100:>7.2f}% {med['epoch_s_median']:>8.3f}")
    summary["epoch_time_ratio_pause_over_none"] = {"per_pair": ratios, "median": statistics.median(ratios)}
    print(f"epoch time with the pause / without, per pair: {' '.join(f'{x:.3f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.3f})")
    stamp = dt.datetime.now()
    path = write_json({
        "benchmark": "loader_handoff", "date": stamp.isoformat(timespec="seconds"),
        "machine": device_description(torch.device(device)), "command": " ".join(sys.argv), "options": vars(args),
        "summary": summary, "runs": runs,
    }, Path(args.out) / f"loader_handoff_{stamp:%Y%m%d-%H%M%S}.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
