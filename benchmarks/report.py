"""Write the docs' results page from the results JSON: one row per result, with machine, date and commit.

Each benchmark script writes ``benchmarks/results/<name>_<YYYYMMDD-HHMMSS>.json``. This script reads
every one, takes each benchmark's headline figures from its own keys (an extractor per benchmark;
one that has none is listed with its file), names the machine and the date the file records and
the commit of the code it measured (the JSON's own ``commit``; where it has none, the commit that
added the file to git), and writes ``docs/benchmarks.md``. The newest result of
each benchmark comes first in its section.

Usage:
    python benchmarks/report.py                  # writes docs/benchmarks.md
    python benchmarks/report.py --out page.md    # elsewhere
    python benchmarks/report.py --check          # exit 1 when docs/benchmarks.md is not up to date
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
_STAMP = re.compile(r"^(?P<name>.+?)_(?P<stamp>\d{8}-\d{4,6})(?:\.json)?$")

Extractor = Callable[[dict], str]


def _x(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}x"


def _s(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} s"


def _your_trainer(d: dict) -> str:
    isa = (d.get("machine") or {}).get("onednn_max_cpu_isa")
    bf16 = (d.get("machine") or {}).get("cpu_bf16_hardware")
    ratios = [r.get("epoch_ratio") for r in d.get("rows", []) if isinstance(r, dict) and r.get("epoch_ratio")]
    where = f"CPU limited to {isa}" if isa else ("bf16 hardware" if bf16 else "no bf16 hardware")
    each = ", ".join(f"{r:.2f}x" for r in ratios) if ratios else ""
    return (
        f"FastTraining on a tutorial-style trainer, per-epoch speed-up: median {_x(d.get('median_epoch_ratio'))}"
        + (f" ({each})" if each else "")
        + (f", whole run {_x(d.get('median_run_ratio'))}" if d.get("median_run_ratio") else "")
        + (
            f"; compile forced on: {_x(d.get('median_compiled_epoch_ratio'))} per epoch, "
            f"{_x(d.get('median_compiled_run_ratio'))} whole run"
            if d.get("median_compiled_epoch_ratio")
            else ""
        )
        + f"; {where}"
    )


def _time_to_dice(d: dict) -> str:
    summary = d.get("summary", {})
    parts = [
        f"{name} {_s(v.get('median_time_to_target_s'))} ({v.get('reached', '?')} reached)"
        for name, v in summary.items()
        if isinstance(v, dict)
    ]
    return "median time to Dice 0.9: " + ", ".join(parts)


def _argmax_layout(d: dict) -> str:
    rows = d.get("rows", [])
    parts = []
    for row in rows[:3]:
        ms = row.get("ms", {})
        shape = "x".join(str(s) for s in row.get("shape", []))
        part = f"{shape}: {ms.get('argmax', 0):.1f} ms -> {ms.get('innermost + argmax', 0):.1f} ms"
        if "softmax + innermost + argmax" in ms:  # the softmax before it on the prediction as given
            soft = ms["innermost + softmax + innermost + argmax"], ms["softmax + innermost + argmax"]
            part += f" (after a softmax: {soft[0]:.1f} ms reordered first -> {soft[1]:.1f} ms as given)"
        parts.append(part)
    return "argmax over classes, default layout -> classes innermost: " + "; ".join(parts)


def _overlaps(d: dict) -> str:
    summary = d.get("summary", {})
    parts = [f"{name} {_s(v.get('first_s'))}" for name, v in summary.items() if isinstance(v, dict) and "first_s" in v]
    return "fast to the first target, overlaps off / schedule / on: " + ", ".join(parts)


def _per_pair_median(d: dict, key: str) -> float | None:
    v = d.get("summary", {}).get(key)
    return v.get("median") if isinstance(v, dict) else None


def _background_fill(d: dict) -> str:
    return (
        f"first iteration, background over foreground fill: "
        f"{_x(_per_pair_median(d, 'first_iteration_s_background_over_foreground'))}; end of epoch 2: "
        f"{_x(_per_pair_median(d, 'epoch2_end_s_background_over_foreground'))}"
    )


def _compile_step(d: dict) -> str:
    return (
        f"torch.compile over eager: training step {_x(d.get('median_train_ratio'))}, "
        f"sliding window {_x(d.get('median_window_ratio'))}"
    )


def _fast_convergence(d: dict) -> str:
    return "median epochs to Dice 0.9: " + ", ".join(
        f"{k} {v.get('median_epochs')}" for k, v in d.get("summary", {}).items() if isinstance(v, dict)
    )


def _handler_overhead(d: dict) -> str:
    share = d.get("overhead_share")
    return "all telemetry handlers together: " + ("n/a" if share is None else f"{share * 100:.3f} % of a training step")


def _loader_overlap(d: dict) -> str:
    return "; ".join(
        f"{r.get('isa')} {r.get('chain')}: prefetch / on demand {_x(r.get('median_on_demand'))}, "
        f"prefetch / auto {_x(r.get('median_auto'))}"
        + (f", loader thread's own team / alone {_x(r['median_team'])}" if r.get("median_team") else "")
        for r in d.get("rows", [])
    )


def _loader_variants(d: dict) -> str:
    return "later epoch: " + ", ".join(f"{r.get('variant')} {_s(r.get('later_epoch_s'), 2)}" for r in d.get("rows", []))


def _rank_cache_memory(d: dict) -> str:
    text = "peak RSS per node: " + ", ".join(
        f"{r.get('setup')} {r.get('node_total_mib', 0):.0f} MiB" for r in d.get("rows", [])
    )
    if any("node_pss_mib" in r for r in d.get("rows", [])):  # PSS summed over the node, shared files counted once
        text += "; PSS + shared files per node: " + ", ".join(
            f"{r.get('setup')} {r.get('node_pss_mib', 0) + r.get('cache_files_mib', 0):.0f} MiB"
            for r in d.get("rows", [])
        )
    return text


def _beyond_ram(d: dict) -> str:
    speed = d.get("median_speed_vs_ram", {})
    share = min((r["items_share_min"] for r in d.get("rows", []) if r.get("items_share_min") is not None), default=None)
    return (
        f"per-epoch speed against all-in-RAM ({d.get('cached_mib', 0):.0f} MiB cached, RAM budget "
        f"{d.get('ram_budget_mib', 0):.0f} MiB): crop-reading disk tier {_x(speed.get('disk'))}, MONAI's "
        f"PersistentDataset {_x(speed.get('persistent'))}; items trained per epoch at least "
        + ("-" if share is None else f"{share:.0%}")
    )


def _smartcache_tier(d: dict) -> str:
    ram, wait = d.get("window_ram_mib", {}), d.get("median_rotation_wait_s", {})
    return (
        f"SmartCache window over the crop-reading tier against the window in RAM: loading per epoch "
        f"{_x(d.get('median_load_vs_ram'))}, window in RAM {ram.get('tier', 0):.1f} MiB against "
        f"{ram.get('ram', 0):.1f} MiB, wait per rotation {_s(wait.get('tier'), 3)} against {_s(wait.get('ram'), 3)}"
    )


def _ddp_tier_epoch(d: dict) -> str:
    rows = d.get("rows", [])
    saw = min((r["rank0_items_share"] for r in rows if r.get("variant") == "shared"), default=None)
    return (
        f"a user's DDP trainer, {(d.get('options') or {}).get('ranks')} gloo ranks: the shared crop tier with the "
        f"user's sampler at {_x(d.get('median_shared_speed_vs_partition'))} the per-epoch speed of a partition per "
        "rank; rank 0 saw " + ("-" if saw is None else f"{saw:.0%}") + " of the data set"
    )


def _elastic_restart(d: dict) -> str:
    rows = d.get("rows", [])
    return "a rank SIGKILLed and restarted: " + ", ".join(
        f"save every {r.get('save_every')}: +{_s(r.get('extra_s'))}, weights equal: {r.get('weights_equal')}"
        for r in rows
    )


def _ddp_scaling(d: dict) -> str:
    return f"2 gloo ranks on 1 CPU node over 1 rank: {_x(d.get('speedup_2x1_vs_1x1'))} (a CPU's cores are shared)"


def _inference(d: dict) -> str:
    rows = [r for r in d.get("rows", []) if r.get("available")]
    base = next((r.get("latency_s") for r in rows if r.get("backend") == "eager"), None)
    return "latency per volume: " + ", ".join(
        f"{r.get('backend')} {_s(r.get('latency_s'), 2)}"
        + (f" ({base / r['latency_s']:.2f}x eager)" if base and r.get("latency_s") else "")
        for r in rows
    )


def _segresnet_lab(d: dict) -> str:
    return (
        f"{d.get('network')}: {_s(d.get('time_per_epoch_s'), 2)} per epoch over {d.get('epochs')} epochs, "
        f"final Dice {d.get('final_dice', 0):.3f}"
    )


def _recipe_vs_commit(d: dict) -> str:
    med = d.get("medians", {})
    return f"`{d.get('recipe')}` new / old: " + ", ".join(f"{k} {v.get('ratio', 0):.2f}" for k, v in med.items())


def _tuner_quality(d: dict) -> str:
    pick = d.get("pick_over_best")
    if isinstance(pick, dict):
        return "tuner's pick over the best measured: " + ", ".join(
            f"{k} {v:.3f}" for k, v in pick.items() if isinstance(v, (int, float))
        )
    return (
        f"tuner's pick over the best measured: {pick}" if pick is not None else "tuner runs against a head-to-head race"
    )


def _pathology(d: dict) -> str:
    return "; ".join(
        f"{r.get('variant')}: {r.get('patches_per_s', 0):.1f} patches/s, AUC {r.get('best_auc', 0):.3f}"
        for r in d.get("runs", [])
        if isinstance(r, dict)
    )


def _openmp_spin(d: dict) -> str:
    return "; ".join(
        f"{r.get('condition')} GOMP_SPINCOUNT={r.get('spincount')}: fast {_s(r.get('fast_time_to_target_s'))} to "
        f"target, per-epoch ratio {_x(r.get('per_epoch_ratio'))}"
        for r in d.get("summary", [])
    )


def _bundle(d: dict) -> str:
    summary = d.get("summary", {})
    pairs = ", ".join(f"{q.get('ratio', 0):.2f}x" for q in summary.get("pairs", []))
    levers = ", ".join(f"{k} {v}" for k, v in (d.get("levers_applied") or {}).items())
    return (
        f"{d.get('bundle')} as published over monai-fast bundle run, per epoch: median "
        f"{_x(summary.get('median_ratio'))} ({pairs}); levers: {levers}"
    )


def _bundle_sweep(d: dict) -> str:
    rows = d.get("rows", [])
    builds = sum(1 for r in rows if r.get("builds"))
    trains = sum(1 for r in rows if r.get("trains"))
    measured = []
    for r in rows:
        if r.get("speedup"):
            pairs = r.get("speedup_pairs") or []
            dice = ", ".join(
                f"{p['published_metric']:.3f} / {p['fast_metric']:.3f}"
                for p in pairs
                if p.get("published_metric") is not None and p.get("fast_metric") is not None
            )
            med = r.get("speedup_medians") or {}
            plan = f" of its {r['speedup_plan_epochs']}-epoch plan" if r.get("speedup_plan_epochs") else ""
            run = "those epochs as a whole (the compile included)" if plan else "whole run"
            more = [f"{run} {med['median_run_ratio']:.2f}x"] if med.get("median_run_ratio") else []
            for v in ("eager", "compiled"):
                if med.get(f"median_ratio_{v}"):
                    more.append(f"{v} {med[f'median_ratio_{v}']:.2f}x per epoch")
            measured.append(
                f"{r['bundle']} {r['speedup']:.2f}x per epoch over {r.get('speedup_epochs')} epochs{plan}"
                + (f", {', '.join(more)}" if more else "")
                + (f" (final metric published / fast {dice})" if dice else "")
                + ("" if r.get("speedup_validated", True) else " (training only)")
            )
    isa = (d.get("machine") or {}).get("onednn_max_cpu_isa")
    return (
        (f"limited to {isa}: " if isa else "")
        + f"Model Zoo sweep ({(d.get('zoo_commit') or '?')[:7]}): {len(rows)} bundle{'s' * (len(rows) != 1)}, "
        f"{builds} build{'s' * (builds == 1)}, "
        f"{trains} train{'s' * (trains == 1)} 2 iterations with FastTraining (the table is on the bundles page)"
        + ("; measured: " + "; ".join(measured) if measured else "")
    )


def _gpu_suite(d: dict) -> str:
    steps = d.get("steps", {})
    passed = [n for n, s in steps.items() if s.get("status") == "passed"]
    failed = [n for n, s in steps.items() if s.get("status") != "passed"]
    text = f"steps passed: {', '.join(passed) or 'none'}" + (f"; failed: {', '.join(failed)}" if failed else "")
    ratio = (steps.get("your_trainer", {}).get("results") or {}).get("median_epoch_ratio")
    if ratio:
        text += f"; your_trainer {ratio:.2f}x per epoch"
    tests = (steps.get("pytest", {}).get("results") or {}).get("failed_tests")
    if tests:
        text += f"; GPU tests failing: {', '.join(t.rsplit('::', 1)[-1] for t in tests)}"
    return text


EXTRACTORS: dict[str, Extractor] = {
    "gpu_suite": _gpu_suite,
    "bundle_spleen_ct_segmentation": _bundle,
    "bundle_wholeBody_ct_segmentation": _bundle,
    "bundle_sweep": _bundle_sweep,
    "your_trainer": _your_trainer,
    "time_to_dice": _time_to_dice,
    "argmax_layout": _argmax_layout,
    "overlaps": _overlaps,
    "background_fill": _background_fill,
    "compile_step": _compile_step,
    "fast_convergence": _fast_convergence,
    "handler_overhead": _handler_overhead,
    "loader_overlap": _loader_overlap,
    "loader_variants": _loader_variants,
    "rank_cache_memory": _rank_cache_memory,
    "beyond_ram": _beyond_ram,
    "smartcache_tier": _smartcache_tier,
    "ddp_tier_epoch": _ddp_tier_epoch,
    "elastic_restart": _elastic_restart,
    "ddp_scaling": _ddp_scaling,
    "inference": _inference,
    "segresnet_lab_cpu": _segresnet_lab,
    "recipe_vs_commit": _recipe_vs_commit,
    "tuner_quality": _tuner_quality,
    "tuner_quality_demo": _tuner_quality,
    "tuner_quality_small": _tuner_quality,
    "pathology": _pathology,
    "openmp_spin": _openmp_spin,
}


def _machine(d: dict) -> str:
    m = d.get("machine")
    if isinstance(m, str):
        return m
    if isinstance(m, dict):
        text = m.get("device") or m.get("description") or m.get("processor") or ""
        if text.startswith("cuda") and m.get("description"):
            text = m["description"]
        if not text and m.get("cpus"):
            text = f"CPU ({m['cpus']} logical CPUs)"
        if m.get("onednn_max_cpu_isa"):
            text += f", ISA limited to {m['onednn_max_cpu_isa']}"
        if m.get("torch"):
            text += f", torch {m['torch']}"
        return text or "not recorded"
    if isinstance(d.get("device"), str):
        return d["device"]
    return "not recorded"


def _date(d: dict, stamp: str) -> str:
    if isinstance(d.get("date"), str):
        return d["date"][:16].replace("T", " ")
    try:
        fmt = "%Y%m%d-%H%M%S" if len(stamp) == 15 else "%Y%m%d-%H%M"
        return datetime.strptime(stamp, fmt).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return stamp


_HASH = re.compile(r"^[0-9a-f]{7,40}$")


def _commit(path: Path, data: dict | None = None) -> str:
    """The short hash of the code a result measured.

    The JSON's own ``commit`` (what the benchmark ran on) when it records one; otherwise the commit
    that added ``path`` to git; ``uncommitted`` when git does not know the file either.
    """
    data = data or {}
    machine = data.get("machine")
    recorded = data.get("commit") or (machine.get("commit") if isinstance(machine, dict) else None)
    if isinstance(recorded, str) and _HASH.match(recorded.strip().lower()):
        return recorded.strip().lower()[:7]
    try:
        out = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=%h", "--", str(path.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[-1] if out else "uncommitted"


def rows(results: Path = RESULTS) -> list[dict[str, Any]]:
    """One row per results JSON: benchmark, result, machine, date, commit, file."""
    out = []
    for path in sorted(results.glob("*.json")):
        match = _STAMP.match(path.name)
        if not match:
            continue
        name, stamp = match["name"], match["stamp"]
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"{path}: not readable as JSON ({err})") from err
        extractor = EXTRACTORS.get(name)
        try:
            result = extractor(data) if extractor else "see the JSON"
        except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            raise SystemExit(f"{path}: the {name} extractor could not read it ({err!r})") from err
        out.append(
            {
                "benchmark": name,
                "result": result,
                "machine": _machine(data),
                "date": _date(data, stamp),
                "stamp": stamp,
                "commit": _commit(path, data),
                "file": path.name,
            }
        )
    out.sort(key=lambda r: (r["benchmark"], -int(r["stamp"].replace("-", "").ljust(14, "0"))))
    return out


def render(table: list[dict[str, Any]]) -> str:
    """The results page as Markdown."""
    lines = [
        "# Benchmarks and results",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; each row names the",
        "machine and date the result records and the commit of the code it measured (the one the JSON",
        "names, else the commit that added the file). What each script measures and how to run it is in",
        "`benchmarks/README.md`. Timings are ratios of variants measured in the same run, taking turns,",
        "so a slow spell of the machine hits every variant.",
        "",
    ]
    names = sorted({r["benchmark"] for r in table})
    for name in names:
        lines += [f"## {name}", "", "| result | machine | date | commit | file |", "|---|---|---|---|---|"]
        for r in (r for r in table if r["benchmark"] == name):
            result = r["result"].replace("|", "/")
            lines.append(f"| {result} | {r['machine']} | {r['date']} | {r['commit']} | `{r['file']}` |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results JSON (default %(default)s)")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from what would be written")
    args = parser.parse_args(argv)
    table = rows(args.results)
    text = render(table)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is not up to date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"{len(table)} results from {len({r['benchmark'] for r in table})} benchmarks -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
