"""Re-running the training cells of ``attach_and_doctor.ipynb`` in a real Jupyter kernel: the notebook's own
checks hold (each epoch timed once per run), and the run record keeps both runs as segments."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the dev extra: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the dev extra: pip install -e '.[dev]'")
pytest.importorskip("ipykernel", reason="notebook tests need the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "tutorials" / "attach_and_doctor.ipynb"
KERNEL = "monai-fast-rerun-test"
TRAINING_CELLS = ("trainer.run()", "fast_trainer.run()")  # how the training cells begin


def _kernel_manager(spec_root: Path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = spec_root / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    return AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_root)]))


@pytest.mark.timeout(600)
def test_running_the_training_cells_again_passes_the_notebooks_own_checks(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell('SIZE = "test"'))
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path / "kernels"),
        timeout=300,
        startup_timeout=180,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "MONAI_FAST_CACHE": str(tmp_path / "cache"),
    }
    env.pop("MPLBACKEND", None)
    twice = []
    with client.setup_kernel(env=env, cleanup_kc=True):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, index)  # a failed check in the notebook raises CellExecutionError here
            if cell.source.startswith(TRAINING_CELLS):
                client.execute_cell(cell, index)  # the user runs the training cell again
                twice.append(cell.source.split("\n", 1)[0])
    assert twice == list(TRAINING_CELLS)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "each timed once (run 2 in this record)" in printed, printed[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "attach_and_doctor" / "record.rank0.jsonl").open()]
    started = [r for r in rows if r.get("what") == "segment_started"]
    assert [r["segment"] for r in started] == [0, 1]  # both runs of the trainer kept, in order
    epochs = [
        (r["segment"], r["epoch"])
        for r in rows
        if r["kind"] == "epoch" and r["source"] == "time_breakdown" and r.get("engine") == "train"
    ]
    assert epochs == [(0, 1), (0, 2), (1, 1), (1, 2)]
