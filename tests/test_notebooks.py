"""The notebooks in ``tutorials/`` run at test size in a real Jupyter kernel, and re-run cells behave.

Each notebook is executed once per test session with nbclient, in a kernel started from this
interpreter (so from the same virtual environment, with this checkout first on ``PYTHONPATH``),
``SIZE = "test"`` injected after its ``parameters`` cell as papermill does. Every cell tagged
``rerun`` is executed twice in a row, as a user re-running it would, and so are the training cells of
``attach_and_doctor`` (:data:`AGAIN`); the notebook itself asserts after training that no handler ran
twice and each epoch was timed once, and the run record keeps both runs of a trainer as segments.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need the dev extra: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need the dev extra: pip install -e '.[dev]'")
pytest.importorskip("ipykernel", reason="notebook tests need the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
NAMES = [p.stem for p in NOTEBOOKS]
KERNEL = "monai-fast-test"
CELL_TIMEOUT_S = 300  # "does not hang": a cell takes seconds at test size
RERUN = "rerun"
#: cells a user runs again though they are not tagged: how they begin, per notebook
AGAIN = {"attach_and_doctor": ("trainer.run()", "fast_trainer.run()")}


def _kernel_manager(spec_root: Path) -> Any:
    """A kernel manager whose only kernel spec runs ``ipykernel`` with this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = spec_root / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    return AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_root)]))


def inject_parameters(nb: Any, **values: Any) -> Any:
    """Insert a cell setting ``values`` after the one cell tagged ``parameters`` (papermill's convention)."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    source = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    return nb


def execute(path: Path, workdir: Path, cache: Path) -> tuple[Any, list[int]]:
    """Run ``path`` at test size in ``workdir``; returns the executed notebook and the indices of re-run cells.

    A cell tagged ``rerun``, or one that begins as one of the notebook's :data:`AGAIN` cells, runs twice.
    """
    again = AGAIN.get(path.stem, ())
    nb = inject_parameters(nbformat.read(path, as_version=4), SIZE="test")
    workdir.mkdir(parents=True, exist_ok=True)
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(workdir / "kernels"),
        timeout=CELL_TIMEOUT_S,
        startup_timeout=180,
        resources={"metadata": {"path": str(workdir)}},
    )
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "MONAI_FAST_CACHE": str(cache)}
    env.pop("MPLBACKEND", None)  # the kernel picks its inline backend itself
    reran = []
    with client.setup_kernel(env=env, cleanup_kc=True):  # we own the kernel manager: shut the kernel down
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, index)  # raises CellExecutionError on an error in the cell
            if RERUN in cell.metadata.get("tags", []) or (again and cell.source.startswith(again)):
                client.execute_cell(cell, index)
                reran.append(index)
    return nb, reran


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """``executed(name)``: the notebook run once at test size (cached for the module), or its error again."""
    base = tmp_path_factory.mktemp("notebooks")
    done: dict[str, Any] = {}

    def run(name: str) -> tuple[Any, list[int]]:
        if name not in done:
            try:
                done[name] = execute(ROOT / "tutorials" / f"{name}.ipynb", base / name, base / "cache")
            except Exception as e:  # every test of this notebook reports the same failure
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]

    run.workdir = lambda name: base / name  # where the notebook ran (its run folders)
    return run


def _outputs(nb: Any) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def test_the_tutorial_notebooks_exist():
    assert {
        "attach_and_doctor",
        "dataset_types",
        "mixed_precision",
        "pathology_tumor_detection",
        "segresnet_lab",
    } <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_clean_with_a_size_parameter(name):
    nb = nbformat.read(ROOT / "tutorials" / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SIZE = " in params[0].source


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_at_test_size_without_errors(name, executed):
    nb, _ = executed(name)
    errors = [o for o in _outputs(nb) if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_shows_its_plots_inline(name, executed):
    nb, _ = executed(name)
    assert any("image/png" in o.get("data", {}) for o in _outputs(nb)), "no PNG shown in the notebook's outputs"


@pytest.mark.timeout(600)
def test_rerunning_the_attach_cells_does_not_double_handlers(executed):
    nb, reran = executed("attach_and_doctor")
    sources = [nb.cells[i].source for i in reran]
    assert any("TimeBreakdown().attach(trainer)" in s for s in sources)
    assert any("fast.attach(fast_trainer, fast_evaluator)" in s for s in sources)
    printed = "".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")
    assert "each timed once" in printed  # the notebook's own count of record rows per iteration and epoch


@pytest.mark.timeout(600)
def test_running_the_training_cells_again_passes_the_notebooks_checks_and_keeps_both_runs(executed):
    nb, reran = executed("attach_and_doctor")
    again = [
        nb.cells[i].source.split("\n", 1)[0] for i in reran if nb.cells[i].source.startswith(AGAIN["attach_and_doctor"])
    ]
    assert again == list(AGAIN["attach_and_doctor"])
    printed = "".join(o.get("text", "") for o in _outputs(nb))
    assert "each timed once (run 2 in this record)" in printed, printed[-2000:]
    record = executed.workdir("attach_and_doctor") / "runs" / "attach_and_doctor" / "record.rank0.jsonl"
    rows = [json.loads(line) for line in record.open()]
    started = [r for r in rows if r.get("what") == "segment_started"]
    assert [r["segment"] for r in started] == [0, 1]  # both runs of the trainer kept, in order
    epochs = [
        (r["segment"], r["epoch"])
        for r in rows
        if r["kind"] == "epoch" and r["source"] == "time_breakdown" and r.get("engine") == "train"
    ]
    assert epochs == [(0, 1), (0, 2), (1, 1), (1, 2)]


@pytest.mark.timeout(600)
def test_pathology_notebook_trains_plain_and_fast_and_tables_their_patches_per_s(executed):
    nb, _ = executed("pathology_tumor_detection")
    shown = "".join(o.get("data", {}).get("text/markdown", "") for o in _outputs(nb))
    assert "| variant | repeat | patches/s |" in shown and "| plain | 1 |" in shown and "| fast | 1 |" in shown
    printed = "".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")
    assert "GPU levers: cuCIM" in printed  # the one line on what this machine can use


@pytest.mark.timeout(600)
def test_lab_notebook_measures_its_table_and_reads_back_its_tensorboard_scalars_and_images(executed):
    nb, _ = executed("segresnet_lab")
    shown = "".join(o.get("data", {}).get("text/markdown", "") for o in _outputs(nb))
    for row in ("| time per epoch |", "| final validation Dice |", "| peak RSS (CPU) |", "| network | SegResNet,"):
        assert row in shown, (row, shown)
    printed = "".join(o.get("text", "") for o in _outputs(nb) if o.output_type == "stream")
    scalars = next(line for line in printed.splitlines() if line.startswith("scalars:"))
    assert all(tag in scalars for tag in ("epoch/loss", "val/mean_dice", "throughput/samples_per_s")), scalars
    images = next(line for line in printed.splitlines() if line.startswith("images:"))
    assert all(f"lab/{name}" in images for name in ("input", "label", "prediction")), images
    pngs = [o for o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(pngs) >= 3  # the data, the scalars, the prediction


def test_auto_size_is_decided_from_the_device_in_one_place():
    from monai_fast.apps.recipes.config import tutorial_size

    assert tutorial_size("auto", "cpu") == "test" and tutorial_size("auto", "cuda") == "full"
    assert tutorial_size("full", "cpu") == "full" and tutorial_size("test", "cuda") == "test"
    with pytest.raises(ValueError, match=r"SIZE must be one of \('test', 'full', 'auto'\), got 'big'"):
        tutorial_size("big")


@pytest.mark.timeout(600)
def test_auto_size_on_a_cpu_picks_the_test_size_in_every_notebook(tmp_path):
    """Each notebook's parameters cell (``SIZE = "auto"``, as committed) and its set-up cell, run in one kernel
    that sees no GPU: every notebook must resolve to the size that runs in about a minute on a CPU."""
    cells = []
    for path in NOTEBOOKS:
        code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        at = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
        assert 'SIZE = "auto"' in code[at].source, f"{path.name}: SIZE is committed as 'auto'"
        cells += [nbformat.v4.new_code_cell(code[at].source), nbformat.v4.new_code_cell(code[at + 1].source)]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path / "kernels"),
        timeout=CELL_TIMEOUT_S,
        startup_timeout=180,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "MONAI_FAST_CACHE": str(tmp_path / "cache"),
        "CUDA_VISIBLE_DEVICES": "",
    }  # a machine without a GPU
    env.pop("MPLBACKEND", None)
    with client.setup_kernel(env=env, cleanup_kc=True):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
    for path, setup in zip(NOTEBOOKS, nb.cells[1::2]):
        printed = "".join(o.get("text", "") for o in setup.outputs if o.output_type == "stream")
        assert "SIZE='test'" in printed, (path.name, printed)
