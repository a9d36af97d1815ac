"""The report's pictures stay legible: drawn for real with matplotlib and measured on its renderer."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("matplotlib", reason="plots need the plots extra: pip install -e '.[dev]'")

from monai_fast.report.plots import breakdown_figure, plot_breakdown  # noqa: E402


def _epochs(segments: int, per_segment: int, ranks: int = 1) -> list[dict]:
    return [
        {"segment": s, "epoch": e, "rank": r, "compute_s": 1.0 + 0.01 * e, "data_s": 0.2}
        for s in range(segments)
        for e in range(1, per_segment + 1)
        for r in range(ranks)
    ]


@pytest.mark.parametrize(("segments", "per_segment", "ranks"), [(1, 22, 1), (2, 11, 1), (2, 40, 2), (1, 3, 1)])
def test_epoch_labels_never_overlap(segments, per_segment, ranks):
    import matplotlib.pyplot as plt

    fig = breakdown_figure(_epochs(segments, per_segment, ranks))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        shown = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in shown]
        assert len(shown) >= min(3, segments * per_segment), [t.get_text() for t in shown]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), [t.get_text() for t in shown]
        # every label is an epoch number that exists; later segments are marked once each
        assert {int(t.get_text()) for t in shown} <= set(range(1, per_segment + 1))
        marks = [t.get_text() for t in ax.texts]
        assert marks == [f"run {s + 1}" for s in range(1, segments)], marks
    finally:
        plt.close(fig)


def test_plot_breakdown_writes_a_png(tmp_path):
    path = plot_breakdown(_epochs(2, 5), tmp_path / "time_breakdown.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
