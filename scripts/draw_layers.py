"""Draw the package's layer map for the design page: ``docs/img/layers.png``.

One box per layer, the ground floor at the bottom, each naming its modules; imports point down the
stack only (``tests/test_packaging.py`` checks that, with the same layers in ``LAYERS``). The
application (``monai_fast/apps/``) sits above the plugin, which never imports it.

    python scripts/draw_layers.py                 # writes docs/img/layers.png
    python scripts/draw_layers.py --out map.png   # elsewhere
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img" / "layers.png"

#: (layer, its modules), bottom-up: the names of ``LAYERS`` in tests/test_packaging.py
LAYERS: list[tuple[str, str]] = [
    ("ground floor", "files, extras, precision_names, progress, openmp, threads"),
    ("telemetry", "telemetry/: run record, spans, CUDA, NVML, NVTX, host load"),
    ("data, distributed", "data/: caches, loaders, preflight    distributed/: launcher, backend, allreduce"),
    ("tuner core", "tune/: batch size, sliding-window batch, precision, the store"),
    ("handlers", "handlers/: ignite handlers, FastTraining"),
    ("report", "report/: doctor, wall clock, ranks, plots"),
    ("bundles", "bundle/: MONAI bundles run and tuned with FastTraining"),
    ("data sources, launchers", "apps/sources/: MSD, synthetic, S3, slides    apps/launch/: run(), torchrun"),
    ("recipes", "apps/recipes/: recipe builders, tune_recipe, pathology"),
    ("inference, training", "apps/inference/: infer()    apps/training/: a recipe to its target"),
    ("demo", "apps/demo/: the race and bench harness"),
    ("command line", "apps/cli/, __main__: parses and prints"),
]

#: the first layer of the application (``monai_fast/apps/``): the ones below are the plugin
APPS_FROM = 7

PLUGIN_COLOUR = "#dbe9f6"
HARNESS_COLOUR = "#fbe3c8"
CLI_COLOUR = "#e3e3e3"


def draw(out: Path = OUT) -> Path:
    """Write the layer map to ``out`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    height, gap, width = 0.8, 0.22, 9.4
    fig, ax = plt.subplots(figsize=(11, 7.6))
    for i, (name, modules) in enumerate(LAYERS):
        y = i * (height + gap)
        colour = CLI_COLOUR if name == "command line" else HARNESS_COLOUR if i >= APPS_FROM else PLUGIN_COLOUR
        ax.add_patch(
            FancyBboxPatch(
                (0, y), width, height, boxstyle="round,pad=0,rounding_size=0.08", fc=colour, ec="#4a4a4a", lw=1.2
            )
        )
        ax.text(0.2, y + height * 0.62, name, fontsize=12, fontweight="bold", va="center")
        ax.text(0.2, y + height * 0.26, modules, fontsize=9.5, va="center", color="#333333")
    top = len(LAYERS) * (height + gap) - gap
    ax.add_patch(
        FancyArrowPatch(
            (width + 0.6, top - 0.1), (width + 0.6, 0.1), arrowstyle="-|>", mutation_scale=22, lw=2, color="#b03a2e"
        )
    )
    ax.text(
        width + 0.85,
        top / 2,
        "imports point downward only",
        rotation=-90,
        fontsize=12,
        va="center",
        ha="left",
        color="#b03a2e",
    )
    plugin_top = APPS_FROM * (height + gap) - gap
    ax.plot([-0.35, -0.35], [0, plugin_top], color="#2f6fa7", lw=3)
    ax.text(-0.5, plugin_top / 2, "the plugin", rotation=90, fontsize=12, va="center", ha="right", color="#2f6fa7")
    ax.plot([-0.35, -0.35], [plugin_top + gap, top], color="#b5651d", lw=3)
    middle = (plugin_top + gap + top) / 2
    ax.text(-0.5, middle, "apps/", rotation=90, fontsize=12, va="center", ha="right", color="#b5651d")
    ax.set_xlim(-1.1, width + 1.5)
    ax.set_ylim(-0.25, top + 0.25)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("monai_fast: the layer map (ground floor at the bottom)", fontsize=14)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write (default %(default)s)")
    args = parser.parse_args(argv)
    print(draw(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
