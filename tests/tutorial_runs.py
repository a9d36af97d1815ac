"""The distributed tutorial's command at the settings the resume tests share (one home for them)."""

from __future__ import annotations

from pathlib import Path

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "distributed_train.py"


def tutorial_args(data: Path, out: Path, *extra: str, epochs: int = 3) -> list[str]:
    """``tutorials/distributed_train.py`` at the reference's settings (fp32, batch 1, ``epochs``), plus ``extra``."""
    return [
        str(TUTORIAL),
        "--tiny",
        "--fp32",
        "--batch-size",
        "1",
        "--data-dir",
        str(data),
        "--out",
        str(out),
        "--max-epochs",
        str(epochs),
        *extra,
    ]
