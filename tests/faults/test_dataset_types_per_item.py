"""``tutorials/dataset_types.ipynb`` compares its data sets per item (one volume), not per epoch.

Their epochs do not hold the same number of items (a SmartCache epoch covers only its window), so
a time per epoch would favour the shortest epoch. The notebook's own set-up cell and ``train``
function run here, without a kernel (the kernel run is ``test_notebooks.py``'s), on a real
``SafeSmartCacheDataset`` window of in-memory volumes with its ``SmartCacheUpdater``; then its
results cell draws the figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the dev extra: pip install -e '.[dev]'")
pytest.importorskip("IPython", reason="notebook tests need the dev extra: pip install -e '.[dev]'")

NOTEBOOK = Path(__file__).resolve().parents[2] / "tutorials" / "dataset_types.ipynb"


def _cells() -> list[str]:
    """The notebook's code cells, IPython's ``%`` magics left out (they need a kernel)."""
    cells = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    return ["\n".join(ln for ln in c.source.splitlines() if not ln.lstrip().startswith("%")) for c in cells]


def _cell(cells: list[str], marker: str) -> str:
    found = [c for c in cells if marker in c]
    assert len(found) == 1, f"expected one code cell with {marker!r}, found {len(found)}"
    return found[0]


class _Trainer:
    """Keeps the trainer it is attached to, to read its ``TimeBreakdown`` after the notebook's ``train``."""

    engine: Any = None

    def attach(self, engine: Any) -> None:
        self.engine = engine


def _volumes(n: int, side: int) -> list[dict]:
    rng = np.random.default_rng(0)
    items = []
    for _ in range(n):
        label = np.zeros((1, side, side, side), np.float32)
        label[:, side // 4 : -side // 4, side // 4 : -side // 4, side // 4 : -side // 4] = 1.0
        items.append({"image": rng.random((1, side, side, side), np.float32), "label": label})
    return items


def test_the_dataset_types_notebook_compares_per_item_over_the_items_an_epoch_holds(monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    cells = _cells()
    ns: dict[str, Any] = {"SIZE": "test"}
    exec(_cell(cells, "P = {"), ns)  # the imports and test sizes
    exec(_cell(cells, "def train("), ns)
    from monai.data import ThreadDataLoader
    from monai.transforms import Compose, EnsureTyped, RandFlipd

    from monai_fast.data.smartcache import SafeSmartCacheDataset
    from monai_fast.handlers import SmartCacheUpdater

    side = ns["P"]["patch"][0]
    window = SafeSmartCacheDataset(
        _volumes(4, side),
        Compose([EnsureTyped(keys=["image", "label"]), RandFlipd(keys=["image", "label"], prob=0.5)]),
        cache_num=2,
        replace_rate=0.5,
        progress=False,
    )
    probe = _Trainer()
    ns["train"](
        "SmartCache window",
        ThreadDataLoader(window, batch_size=2, num_workers=0),
        0.5,
        handlers=[SmartCacheUpdater(window, timeout_s=60), probe],
    )
    row = ns["results"]["SmartCache window"]
    first, *later = probe.engine.state.time_breakdown
    assert row["items/epoch"] == 2  # the window, not the 4 items in the list
    assert row["first epoch ms/item"] == pytest.approx(1000 * (first.data_s + first.compute_s) / 2)
    per_item = 2 * len(later)
    assert row["later ms/item"] == pytest.approx(1000 * sum(e.data_s + e.compute_s for e in later) / per_item)
    assert row["later data wait ms/item"] == pytest.approx(1000 * sum(e.data_s for e in later) / per_item)
    assert row["later compute ms/item"] == pytest.approx(1000 * sum(e.compute_s for e in later) / per_item)
    timed = [k for k in row if k not in ("set-up s", "items/epoch")]
    assert timed and all(k.endswith("ms/item") for k in timed), row  # no time per epoch or per iteration left

    import matplotlib.pyplot as plt

    exec(_cell(cells, "plt.subplots("), ns)  # the results table and figure
    fig = plt.gcf()
    assert "per item" in fig.get_suptitle() and fig.axes[1].get_xlabel() == "ms per item (one volume)"
    plt.close(fig)
